"""What one request carries from arrival to its last byte: tenant, quota admission, SERVER span."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from kvpush.common.quotas import Admission
from kvpush.common.redis_client import REDIS_CALL_ERRORS, lost_connection
from kvpush.common.tenancy import Tenant
from kvpush.services.gateway.shedding import Ticket

if TYPE_CHECKING:
    from kvpush.services.gateway.conversations import Conversation
    from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

DEFAULT_TENANT = Tenant(id="default", name="default")
"""The tenant of every request while ``gateway_auth`` is off."""
# Label of requests refused before their tenant is known (bad or missing key).
NO_TENANT = "-"


def span_traceparent(span: Span, fallback: str | None = None) -> str | None:
    """W3C ``traceparent`` naming ``span``; ``fallback`` when tracing is off (no valid span)."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return fallback
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def fail_span(span: Span, exc: BaseException) -> None:
    """Record ``exc`` on ``span`` and mark it failed."""
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))


class RequestCtx:
    """What one request carries from arrival to its last byte: tenant, quota, span."""

    def __init__(self, gw: Gateway, endpoint: str, path: str, arrived: float,
                 span: Span, incoming_tp: str | None) -> None:
        self.gw = gw
        self.endpoint = endpoint
        self.path = path
        self.arrived = arrived
        self.span = span
        self.incoming_tp = incoming_tp
        self.tenant = NO_TENANT
        self.admission: Admission | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.dispatched = False
        self.streaming = False  # the span and the admission now belong to the stream's end
        self.prefix_hashes: list[int] = []  # of the prompt's leading chunks, for placement
        # The prompt as the gateway tokenized it: a history push sends its holder a prefix.
        self.prompt_ids: list[int] = []
        self.migrations = 0  # times the stream moved to another decode after tokens went out
        # One choice of an n > 1 request (services/gateway/fanout.py): the first sample's
        # decode engine and when it holds the prompt's KV; the other samples go there alone.
        self.colocate_on: str | None = None
        self.placed_on: str | None = None
        self.kv_ready: asyncio.Event | None = None
        self.prompt_billed = True  # False: another choice of the request pays the prompt
        self.backlog: Ticket | None = None  # in the load shedder's backlog until served
        # A /v1/responses request that continues a stored response or is kept itself.
        self.conversation: Conversation | None = None
        self._finished = False

    @property
    def otel_context(self) -> Any:
        """Context whose current span is the SERVER span (parent of every child span)."""
        return trace.set_span_in_context(self.span)

    def reached_first_token(self) -> None:
        """Prefill answered or the first token went out: the request leaves the backlog
        ahead of new ones, and its prompt counts toward the measured service rate."""
        self._leave_backlog(served=True)

    def first_token_out(self, at: float | None = None) -> None:
        """The client got its first token (``at``, by default now): the shedding
        headroom is learned from the time since the request arrived."""
        sh = self.gw.shedder
        if self.backlog is not None and sh is not None:
            sh.first_token(self.backlog, at)
            self.gw.metrics.shed_headroom.set(sh.headroom)

    def _leave_backlog(self, served: bool) -> None:
        sh = self.gw.shedder
        if self.backlog is None or sh is None:
            return
        if served:
            sh.served(self.backlog)
        else:
            sh.forget(self.backlog)  # ended before its first token (a no-op after it)
        self.gw.metrics.backlog.set(sh.backlog_tokens)

    async def finish(self, status: int) -> None:
        """Release the quota admission and end the SERVER span; idempotent."""
        if self._finished:
            return
        self._finished = True
        self._leave_backlog(served=False)
        if self.admission is not None:
            # Refund what the request did not use; nothing was used if it never reached
            # an engine.
            prompt = self.prompt_tokens if self.prompt_billed else 0
            used = prompt + self.completion_tokens if self.dispatched else 0
            try:
                await self.admission.release(used)
            except REDIS_CALL_ERRORS as exc:
                logger.warning("releasing the quota admission of tenant %s failed: %s",
                               self.tenant, exc)
                if lost_connection(exc):
                    adm = self.admission
                    self.gw.release_later(f"the quota admission of tenant {self.tenant}",
                                          lambda: adm.release(used), adm.lease_expiry_ms)
        if self.dispatched:
            if self.prompt_billed:
                self.gw.metrics.tokens.labels(self.tenant, "prompt").inc(self.prompt_tokens)
            self.gw.metrics.tokens.labels(self.tenant, "completion").inc(self.completion_tokens)
        sp = self.span
        sp.set_attribute("http.response.status_code", status)
        sp.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if status >= 500:
            sp.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        sp.end()
