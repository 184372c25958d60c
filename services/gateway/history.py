"""The holder's leg of a history push: the engine that holds the prompt's leading blocks (a
conversation's earlier turns, by its KV events) runs them as a prefill leg of its own
whose push goes to the prefill engine, which computes only the rest of the prompt.

The holder gets the prompt's first ``history_tokens + 1`` token ids: its prefix cache
serves the whole history (vLLM computes at least one token of a prompt), it computes one
token, and it pushes only the history (``push_tokens``). The prefill leg names the holder,
the holder's request id and push key, and the digest of the history's tokens, so a prefill
that rendered the prompt into other tokens computes the history itself. Whatever befalls
this leg (the holder evicted the blocks: it recomputes them; it answered an error: its
connector ends the push and prefill recomputes the history), the request is answered; the
leg's answer is dropped.

A holder that cannot be connected to, whose connection drops under its leg, or that stops
answering health probes while prefill waits for the history (dead, frozen or cut off) will
tell prefill nothing: prefill would wait out ``history_deadline_s`` and then the
quarantine of blocks no fence frees. The request is placed again at once instead, the
holder kept off (:class:`HolderUnreachable`, ``Flight``'s race). That is safe whatever the
holder may still write: the new placement computes into new blocks, and the first prefill
leg's blocks stay out of vLLM's hands until the holder fences its WRITEs or the
quarantine's bound passes (connector/README.md, *Late WRITEs*).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from kvpush.common.wire import Assignment, KVTransferParams, history_digest
from kvpush.services.gateway.engines import EngineFailed, post_json
from kvpush.services.gateway.openai_api import COMPLETIONS, ParsedRequest

if TYPE_CHECKING:
    from kvpush.services.gateway.context import RequestCtx
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)


class HolderUnreachable(EngineFailed):
    """The history's holder could not be reached, or its connection dropped: no answer,
    and no word to prefill, will come from it (module docstring)."""


@dataclass(frozen=True)
class History:
    """One request's history push: who holds it, how much, and the leg's names."""

    engine: str
    url: str
    tokens: int
    request_id: str
    push_key: str
    digest: str

    def prefill_fields(self) -> dict[str, Any]:
        """What the prefill leg's ``kv_transfer_params`` add to receive the history."""
        return {"history_engine": self.engine, "history_request_id": self.request_id,
                "history_tokens": self.tokens, "history_push_key": self.push_key,
                "history_digest": self.digest}


_EARLIER_TURN_ROLES = frozenset(("assistant", "tool", "function"))
_EARLIER_TURN_TYPES = frozenset(("function_call", "function_call_output", "reasoning"))


def continues_conversation(parsed: ParsedRequest) -> bool:
    """Whether the request carries an earlier turn's answer (a chat's assistant or tool
    message, a Responses input's output items, or a ``previous_response_id`` already
    expanded into them): the KV of that answer is on the engine that generated it."""
    items = parsed.body.get("messages", parsed.body.get("input"))
    if not isinstance(items, list):
        return False
    return any(isinstance(it, dict) and (it.get("role") in _EARLIER_TURN_ROLES
                                         or it.get("type") in _EARLIER_TURN_TYPES)
               for it in items)


def plan_history(gw: Gateway, ctx: RequestCtx, a: Assignment, request_id: str
                 ) -> History | None:
    """The history push ``a`` asks for, or None (no history, or none this gateway can
    name: it has no token ids of the prompt)."""
    n = a.history_tokens
    if not (a.disaggregated and a.history_engine and a.history_url and a.prefill_engine) \
            or not 0 < n < len(ctx.prompt_ids):
        return None
    hrid = f"{request_id}-h"
    return History(a.history_engine, a.history_url, n, hrid,
                   gw.push_keys.for_request(hrid), history_digest(ctx.prompt_ids[:n]))


def holder_call(gw: Gateway, ctx: RequestCtx, parsed: ParsedRequest, h: History,
                prefill_engine: str, deadline_ms: int, traceparent: str | None
                ) -> asyncio.Task[None]:
    """Send the holder its leg in the background."""
    params = KVTransferParams(kvpush="prefill", request_id=h.request_id,
                              decode_engine=prefill_engine, deadline_ms=deadline_ms,
                              traceparent=traceparent, push_key=h.push_key,
                              push_tokens=h.tokens)
    body: dict[str, Any] = {"prompt": ctx.prompt_ids[:h.tokens + 1], "max_tokens": 1,
                            "temperature": 0.0, "stream": False,
                            "kv_transfer_params": params.to_dict()}
    for field in ("model", "cache_salt"):
        # The same salt as the prompt's, or the holder's prefix cache misses it all.
        if isinstance(parsed.body.get(field), str):
            body[field] = parsed.body[field]
    headers = {"X-Request-Id": h.request_id}
    if traceparent:
        headers["traceparent"] = traceparent
    return asyncio.create_task(_run(gw, h, f"{h.url}{COMPLETIONS}", body, headers))


async def _run(gw: Gateway, h: History, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> None:
    try:
        await post_json(gw.http, "history", h.engine, url, body, headers)
    except EngineFailed as exc:
        if isinstance(exc.__cause__, aiohttp.ClientError):
            # Not connected, or the connection failed under the leg (the engine died).
            raise HolderUnreachable("history", h.engine, str(exc.__cause__)) from exc
        # The holder answered: prefill hears of its failure from the holder's connector,
        # or computes the history itself at its history deadline.
        logger.warning("history leg %s: %s", h.request_id, exc)
