"""The per-request key that ties a push target to the request its gateway dispatched.

Every engine may write to a prefill engine's target stream, so a target names its decode
engine but proves nothing by that. The gateway gives prefill and decode the same key for a
request (an HMAC of the request id under a secret of the gateway process's own); decode
copies it into its targets, and prefill accepts a target only if it carries that key. A
request sent to prefill at admission has no assigned decode to check against, so the key is
what keeps another engine from steering its KV to itself.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_CHARS = 32


class PushKeys:
    """Derives push keys for one gateway process (its secret never leaves the process)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret or secrets.token_bytes(32)

    def for_request(self, request_id: str) -> str:
        """The key both legs of ``request_id`` carry."""
        mac = hmac.new(self._secret, request_id.encode(), hashlib.sha256)
        return mac.hexdigest()[:KEY_CHARS]


def target_allowed(expected_decode: str | None, expected_key: str | None,
                   decode_engine: str, key: str | None) -> bool:
    """Whether a target from ``decode_engine`` carrying ``key`` may steer a push that
    expects ``expected_decode`` (None: the assignment is not known yet) and
    ``expected_key`` (None: a request made without one, by hand)."""
    if expected_decode and decode_engine != expected_decode:
        return False
    if expected_key is None:
        return True
    return key is not None and hmac.compare_digest(key, expected_key)
