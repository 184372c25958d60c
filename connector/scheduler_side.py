"""Scheduler side of the push connector: what decode loads and publishes, what prefill holds."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import redis

from kvpush.common.backoff import Backoff
from kvpush.common.keys import RedisKeys, valid_id
from kvpush.common.push_key import target_allowed
from kvpush.common.redis_client import lost_connection
from kvpush.common.wire import (
    KVTransferParams,
    PushTarget,
    WireError,
    encode,
    history_digest,
    now_ms,
    parse_kv_transfer_params,
)
from kvpush.connector.config import ConnectorConfig, connector_redis
from kvpush.connector.groups import push_skips
from kvpush.connector.metadata import (
    BlockIds,
    FenceTo,
    KVPushMetadata,
    KVPushWorkerMeta,
    PrefillStep,
    RecvSpec,
    SendTarget,
)
from kvpush.connector.state import (
    Action,
    DecodeState,
    DecodeTransfer,
    PrefillState,
    PrefillTransfer,
    Transition,
)
from kvpush.connector.target_reader import TargetReader

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
# A target or cancel for a request this engine has not seen yet is kept this long past
# its deadline: the prefill request may still be on its way through the HTTP server.
_PENDING_SLACK_MS = 10_000
# Targets held for requests this engine has not seen yet (they race the request itself).
_MAX_PENDING = 4096
# Targets held per unknown request: a forged one arriving first must not crowd out its
# decode's (the key decides once the request is known).
_PENDING_PER_REQUEST = 4
# Socket timeouts of the client that writes push targets from the engine loop itself: a
# Redis that does not answer in this long stalls one step at most this long, and the write
# goes to the background publisher instead.
_INLINE_TIMEOUT_S = 0.1


def push_params(request: Request) -> KVTransferParams | None:
    """The request's kvpush params, or None for a request that is not pushed.

    Malformed params never raise here: this runs inside vLLM's scheduler, where an
    exception kills the engine. The engine's API guard refuses such requests with a 400
    before they get this far; one that slips past is served as a plain local request.
    """
    raw = request.kv_transfer_params
    if not raw or not isinstance(raw, dict) or "kvpush" not in raw:
        return None
    try:
        return parse_kv_transfer_params(raw)
    except WireError as exc:
        logger.warning("request %s: ignoring kv_transfer_params (%s); computing it locally",
                       request.request_id, exc)
        request.kv_transfer_params = None
        return None


@dataclass
class PrefillReq:
    req_id: str
    rid: str
    request: Request
    deadline_ms: int
    machine: PrefillTransfer
    target: PushTarget | None = None
    traceparent: str | None = None
    decode_engine: str | None = None  # the decode the assignment named
    push_key: str | None = None  # what its target must carry (common/push_key.py)
    push_tokens: int = 0  # pushes only the prompt's first push_tokens (0: all of it)


@dataclass
class DecodeReq:
    req_id: str
    rid: str
    prefill_engine: str
    deadline_ms: int
    params: KVTransferParams
    machine: DecodeTransfer
    request: Request | None = None
    continues: bool = False  # goes on from prefill's first token (KVTransferParams.continues)
    first_token: int = -1  # as the receiving ranks reported it
    recheck: bool = False  # received verified: its blocks are checked again when it ends
    # A prefill leg's history (KVTransferParams.history_engine): the prompt's first
    # ``history_tokens`` arrive from the holder, then this engine computes and pushes the
    # rest as the prefill leg ``outer`` says.
    history_tokens: int = 0
    outer: KVTransferParams | None = None


class _Publisher:
    """One thread that runs Redis writes off the engine loop, in order. A write that meets
    a lost connection (a failover, a restart) is retried until its deadline: a push target
    dropped there would leave its request waiting for KV until the deadline anyway.

    Latency-critical writes (decode's push targets) are tried inline first: vLLM's engine
    loop spins in Python while requests wait for KV, so a background thread gets the GIL
    only at the interpreter's switch interval (5 ms), twice per round trip. Inline, with a
    short socket timeout, a target reaches Redis in a fraction of a millisecond."""

    def __init__(self, inline_client: Any = None) -> None:
        self._q: queue.Queue[tuple[Callable[[], Any], int] | None] = queue.Queue()
        self._inline_client = inline_client
        self._outstanding = 0  # writes queued or running: an inline write must not pass them
        self._lock = threading.Lock()
        self._inline_after = 0.0  # monotonic; no inline try until then after a failure
        self._t = threading.Thread(target=self._run, name="kvpush-publish", daemon=True)
        self._t.start()

    def put(self, fn: Callable[[], Any], until_ms: int = 0) -> None:
        """Run ``fn``; retry it on a lost connection until ``until_ms`` (0: once)."""
        with self._lock:
            self._outstanding += 1
        self._q.put((fn, until_ms))

    def put_now(self, fn: Callable[[Any], Any], until_ms: int) -> None:
        """Run ``fn(client)`` inline on the short-timeout client when no queued write is
        ahead of it, else (or when that fails) like :meth:`put` with the normal client."""
        client = self._inline_client
        if client is not None and not self._outstanding and time.monotonic() >= self._inline_after:
            try:
                fn(client)
                return
            except (redis.RedisError, OSError) as exc:
                logger.info("kvpush inline Redis write failed (%s); retrying in the background",
                            exc)
                self._inline_after = time.monotonic() + 1.0
        self.put(lambda: fn(None), until_ms)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, until_ms = item
            try:
                self._attempt(fn, until_ms)
            finally:
                with self._lock:
                    self._outstanding -= 1

    @staticmethod
    def _attempt(fn: Callable[[], Any], until_ms: int) -> None:
        backoff = Backoff(first=0.05, cap=1.0)
        while True:
            try:
                fn()
                return
            except (redis.RedisError, OSError) as exc:
                delay = backoff.next()
                if not lost_connection(exc) or now_ms() + delay * 1000 >= until_ms:
                    logger.warning("kvpush Redis write failed: %s", exc)
                    return
                time.sleep(delay)

    def close(self) -> None:
        self._q.put(None)
        self._t.join(timeout=5)


class SchedulerSide:
    """Per-engine connector logic in vLLM's scheduler (engine-core process)."""

    def __init__(self, cfg: ConnectorConfig, *, block_size: int, generation: int,
                 kv_role: str, block_ids_of: Callable[[str], BlockIds],
                 client: redis.Redis | None = None, windows: Sequence[int] = (0,),
                 continues: bool = True) -> None:
        self.cfg = cfg
        # Decode goes on from prefill's first token only where a failed push fails its
        # request: a recomputed prompt would sample a first token of its own, and the
        # gateway already answered prefill's (EngineStatus.continues says which).
        self.continues = continues
        self.block_size = block_size
        # Sliding window (tokens) of each KV cache group; 0 for full attention.
        self.windows = list(windows)
        self.generation = generation
        self.keys = RedisKeys(cfg.key_prefix)
        self._block_ids_of = block_ids_of
        self._redis = client or connector_redis(cfg)
        self._prefill: dict[str, PrefillReq] = {}
        self._prefill_by_rid: dict[str, str] = {}
        self._decode: dict[str, DecodeReq] = {}
        self._rechecking: set[str] = set()  # ended, blocks held until their ranks checked
        # By rank, pushes whose WRITEs the fence still polls: the engine keeps stepping.
        self._lingering: dict[int, int] = {}
        # rid -> (target or cancel, expiry unix ms) for requests not seen yet
        self._pending: dict[str, tuple[list[PushTarget], int]] = {}
        self._inbox: collections.deque[PushTarget] = collections.deque()
        self._meta = KVPushMetadata()
        # Short timeouts: this client is used from the engine loop itself (see _Publisher).
        # Every role publishes targets: decode for its pushes, prefill for histories.
        self._publisher = _Publisher(
            connector_redis(cfg, check=False, timeout_s=_INLINE_TIMEOUT_S))
        self._reservations: Any = None
        self._reader: TargetReader | None = None
        if kv_role in ("kv_producer", "kv_both") or cfg.history_source:
            # Its own connection: XREAD BLOCK holds a connection for up to a second.
            self._reader = TargetReader(connector_redis(cfg, check=False),
                                        self.keys.targets(cfg.engine_id), self._inbox)

    # -- decode: what to load ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Decode: every prompt token past the local prefix hit arrives by push.

        vLLM recomputes the last prompt token after an async load that covers the whole
        prompt (it needs its logits), so counting all of them is right; the pushed KV of
        that token is simply overwritten with the same values.
        """
        d = self._decode.get(request.request_id)
        if d is None:
            params = push_params(request)
            if params is None or request.request_id in self._prefill:
                return 0, False
            if params.kvpush == DECODE:
                d = self._track_decode(request, params)
            elif params.history_engine:
                d = self._track_history(request, params)
            else:
                return 0, False
        if d.machine.state is not DecodeState.AWAIT_ALLOC:
            # Re-admitted after a failed push (recompute) or a preemption: compute locally.
            return 0, False
        n = (request.num_prompt_tokens if d.outer is None else d.history_tokens) \
            - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def _track_decode(self, request: Request, p: KVTransferParams) -> DecodeReq:
        assert p.prefill_engine is not None  # parse_kv_transfer_params checked it
        d = DecodeReq(request.request_id, p.request_id, p.prefill_engine,
                      self._deadline(p), p, DecodeTransfer(), request,
                      p.continues and self.continues)
        if p.continues and not self.continues:
            logger.warning("request %s asks to go on from prefill's first token, which this "
                           "engine does not (kv_load_failure_policy recompute): it "
                           "recomputes the prompt's last token", p.request_id)
        self._decode[request.request_id] = d
        return d

    def _track_history(self, request: Request, p: KVTransferParams) -> DecodeReq:
        """A prefill leg whose history arrives by push: received like a decode leg of its
        own (the holder's request id and push key), whole blocks only, and never the
        prompt's last token, which this engine computes to answer."""
        assert p.history_engine is not None and p.history_request_id is not None
        whole = min(p.history_tokens, request.num_prompt_tokens - 1)
        ids = request.prompt_token_ids
        if ids is None or history_digest(ids[:p.history_tokens]) != p.history_digest:
            # This engine rendered the prompt into other tokens than the gateway did: the
            # pushed KV would be another prompt's. Computed here instead.
            logger.warning("request %s: its prompt does not start with the history's "
                           "tokens; computing the history locally", p.request_id)
            whole = 0
        leg = msgspec.structs.replace(
            p, kvpush=DECODE, request_id=p.history_request_id,
            prefill_engine=p.history_engine, push_key=p.history_push_key,
            reservation_id=None, fencing_token=0, continues=False)
        # A holder that is gone or slow costs this much before the history is recomputed.
        deadline = min(self._deadline(p), now_ms() + int(self.cfg.history_deadline_s * 1000))
        d = DecodeReq(request.request_id, p.history_request_id, p.history_engine,
                      deadline, leg, DecodeTransfer(), request,
                      history_tokens=whole // self.block_size * self.block_size, outer=p)
        self._decode[request.request_id] = d
        return d

    def _default_deadline(self) -> int:
        return now_ms() + int(self.cfg.push_deadline_s * 1000)

    def _deadline(self, p: KVTransferParams) -> int:
        """The request's push deadline, capped at ``max_push_deadline_s`` from now."""
        cap = now_ms() + int(self.cfg.max_push_deadline_s * 1000)
        return min(p.deadline_ms or self._default_deadline(), cap)

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        """Decode: publish the allocated blocks. Prefill: start tracking the request."""
        if request.request_id in self._prefill:
            return  # a later chunk of a prefill already tracked: nothing to parse again
        d = self._decode.get(request.request_id)
        if d is not None and d.outer is not None:
            self._receive_history(d, block_ids, num_external_tokens)
            self._track_prefill(request, d.outer)
            return
        params = d.params if d is not None else push_params(request)
        if params is None:
            return
        if params.kvpush == PREFILL:
            self._track_prefill(request, params)
            return
        if num_external_tokens <= 0:
            return
        d = d or self._track_decode(request, params)
        self._receive(d, block_ids, request.num_prompt_tokens, num_external_tokens)

    def _receive_history(self, d: DecodeReq, block_ids: BlockIds,
                         num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            # This engine's own cache held the history after all: the holder's leg is
            # cancelled, so it frees its blocks now instead of at its deadline.
            self._apply_decode(d, d.machine.on_finished())
            return
        self._receive(d, block_ids, d.history_tokens, num_external_tokens)

    def _receive(self, d: DecodeReq, block_ids: BlockIds, n_prompt: int,
                 num_external_tokens: int) -> None:
        """Publish ``d``'s target, the blocks of its first ``n_prompt`` tokens, and tell
        the workers to expect them."""
        n_blocks = -(-n_prompt // self.block_size)
        blocks = [list(g[:n_blocks]) for g in block_ids]
        skip = push_skips(n_prompt, (n_prompt - num_external_tokens) // self.block_size,
                          self.windows, self.block_size)
        target = PushTarget(
            request_id=d.rid, decode_engine=self.cfg.engine_id,
            decode_generation=self.generation, block_ids=blocks, num_tokens=n_prompt,
            skip_blocks=skip, deadline_ms=d.deadline_ms,
            traceparent=d.params.traceparent, push_key=d.params.push_key,
            first_token=d.continues,
        )
        self._apply_decode(d, d.machine.on_allocated(), target)
        # Wall clock: the worker (another process) starts the kvpush.kv.wait span here.
        self._meta.recvs[d.req_id] = RecvSpec(
            d.rid, d.prefill_engine, blocks, skip, d.deadline_ms,
            traceparent=d.params.traceparent, allocated_ns=time.time_ns(),
            first_token=d.continues, history=d.outer is not None,
        )

    # -- prefill: tracking and targets -------------------------------------------------
    def _track_prefill(self, request: Request, p: KVTransferParams) -> None:
        r = PrefillReq(request.request_id, p.request_id, request,
                       self._deadline(p), PrefillTransfer(),
                       traceparent=p.traceparent, decode_engine=p.decode_engine,
                       push_key=p.push_key, push_tokens=p.push_tokens)
        self._prefill[r.req_id] = r
        self._prefill_by_rid[r.rid] = r.req_id
        pending = self._pending.pop(r.rid, None)
        if pending is not None:
            # A cancel beats any target: this prefill must never push that request.
            for t in sorted(pending[0], key=lambda t: not t.cancel):
                if self._on_target(r, t):
                    break

    def _on_target(self, r: PrefillReq, t: PushTarget) -> bool:
        """Apply ``t`` to ``r`` if it comes from ``r``'s decode; False if ignored."""
        if not target_allowed(r.decode_engine, r.push_key, t.decode_engine, t.push_key):
            # Anyone who can write the target stream could otherwise steer this push.
            logger.warning("request %s: ignoring a target from %s (assigned decode %s, "
                           "push key %s)", r.rid, t.decode_engine, r.decode_engine or "-",
                           "wrong" if r.push_key else "-")
            return False
        if t.cancel:
            self._apply_prefill(r, r.machine.on_cancel())
            # A rank no target reached tells this decode when its push ended (fence.py).
            self._fence(r.req_id, FenceTo(r.rid, t.decode_engine, t.decode_generation))
            return True
        r.target = t
        self._apply_prefill(r, r.machine.on_target())
        return True

    def _drain_inbox(self) -> None:
        now = now_ms()
        while self._inbox:
            t = self._inbox.popleft()
            req_id = self._prefill_by_rid.get(t.request_id)
            if req_id is not None:
                self._on_target(self._prefill[req_id], t)
                continue
            # Whoever can write the stream chooses deadline_ms: cap how long and how many
            # targets for unknown requests are held.
            cap = now + int(self.cfg.max_push_deadline_s * 1000)
            expiry = min(t.deadline_ms or self._default_deadline(), cap) + _PENDING_SLACK_MS
            if expiry < now:
                self._fence_unknown(t)
                continue
            held = self._pending.get(t.request_id)
            if held is None and len(self._pending) >= _MAX_PENDING:
                logger.warning("dropping a target for unknown request %s: %d are held",
                               t.request_id[:80], len(self._pending))
                continue
            if held is None:
                self._pending[t.request_id] = ([t], expiry)
            elif len(held[0]) < _PENDING_PER_REQUEST:
                held[0].append(t)
                self._pending[t.request_id] = (held[0], max(held[1], expiry))
            else:
                logger.warning("dropping a target for unknown request %s: %d are held for "
                               "it", t.request_id[:80], len(held[0]))
        if self._pending:
            for rid in [k for k, (_t, exp) in self._pending.items() if exp < now]:
                for t in self._pending.pop(rid)[0]:
                    self._fence_unknown(t)

    def _fence_unknown(self, t: PushTarget) -> None:
        """Decode cancelled a request this engine never had, and its time is up: no rank
        took a target for it (a rank takes one only for a request it computes), so the
        ranks close it and tell that decode, which otherwise holds the blocks until its
        quarantine's bound. Only after the deadline: a forged cancel cannot close a
        request still on its way."""
        if t.cancel:
            self._fence(t.request_id, FenceTo(t.request_id, t.decode_engine,
                                              t.decode_generation))

    def _fence(self, req_id: str, to: FenceTo) -> None:
        """Have the ranks tell ``to``'s decode that the push ended; a cancel that names no
        engine (a gateway's, for an early prefill it gave up) has no decode waiting."""
        if valid_id(to.decode_engine):
            self._meta.fence[req_id] = to

    def _check_deadlines(self) -> None:
        now = now_ms()
        for r in list(self._prefill.values()):
            late = now > r.deadline_ms or bool(
                r.target and r.target.deadline_ms and now > r.target.deadline_ms
            )
            if late and not r.machine.state.terminal and not r.machine.cancelled:
                self._apply_prefill(r, r.machine.on_deadline())

    # -- every step ----------------------------------------------------------------------
    def build_connector_meta(self, scheduled: list[tuple[str, int, bool]],
                             preempted: Iterable[str] = ()) -> KVPushMetadata:
        """This step's metadata; ``scheduled`` is (req id, tokens this step, resumed),
        ``preempted`` the requests vLLM preempted (and freed the blocks of) this step."""
        for req_id in preempted:
            if req_id in self._prefill:
                self._meta.preempted.add(req_id)
            d = self._decode.get(req_id)
            if d is not None and d.recheck:
                d.recheck = False  # recomputed into other blocks: nothing to check again
                self._meta.unkeep.add(req_id)
        if self._inbox or self._pending:
            self._drain_inbox()
        if self._prefill:
            self._check_deadlines()
            for req_id, n_tokens, resumed in scheduled:
                r = self._prefill.get(req_id)
                if r is None or r.machine.state not in (PrefillState.WAIT_TARGET,
                                                        PrefillState.PUSHING):
                    continue
                before = r.request.num_computed_tokens
                n_prompt = r.request.num_prompt_tokens
                self._meta.steps[req_id] = PrefillStep(
                    r.rid, [list(g) for g in self._block_ids_of(req_id)], before,
                    before + n_tokens,
                    min(r.push_tokens, n_prompt) if r.push_tokens else n_prompt, resumed,
                    decode_engine=r.decode_engine,
                    push_key=r.push_key, deadline_ms=r.deadline_ms, traceparent=r.traceparent,
                )
        meta, self._meta = self._meta, KVPushMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: BlockIds) -> bool:
        """vLLM ended the request; True when the workers free its blocks later."""
        h = self._decode.get(request.request_id)
        waiting = False  # it ended still waiting for its history
        if h is not None and h.outer is not None:
            # Its history's receive ends with it (vLLM keeps the blocks of a request
            # still waiting for remote KV until the receive is reported).
            waiting = h.machine.state is DecodeState.RECEIVING
            self._apply_decode(h, h.machine.on_finished())
        # A prefill request never scheduled computed nothing: nothing to push or hold.
        r = self._prefill.get(request.request_id)
        if r is not None:
            from vllm.v1.request import RequestStatus

            ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED)
            out = r.machine.on_finished(ok)
            self._apply_prefill(r, out)
            # A request that never left its history's wait posted no WRITE: its push holds
            # nothing. Holding would report the request twice to vLLM (sent, then received),
            # and the receive's report would name a request vLLM had already freed.
            if out.hold_blocks and not waiting:
                self._meta.held[r.req_id] = [list(g) for g in block_ids]
                if ok and request.output_token_ids:
                    self._meta.first_tokens[r.req_id] = request.output_token_ids[0]
            else:
                self._meta.forget.add(r.req_id)
                t = r.target
                if (t is not None or r.decode_engine) and r.req_id not in self._meta.fence:
                    # Decode may still wait: a rank that never pushed tells it so.
                    self._fence(r.req_id, FenceTo(
                        r.rid, t.decode_engine if t else str(r.decode_engine),
                        t.decode_generation if t else None))
                self._drop_prefill(r)
            return out.hold_blocks and not waiting
        d = self._decode.get(request.request_id)
        if d is not None:
            self._apply_decode(d, d.machine.on_finished())
            if d.recheck:
                # Its verified blocks are checked again before vLLM may reuse them.
                self._meta.recheck.add(d.req_id)
                self._rechecking.add(d.req_id)
                return True
        return False

    def update_connector_output(self, finished_sending: set[str] | None,
                                finished_recving: set[str] | None,
                                failed_recving: set[str] | None,
                                worker_meta: KVPushWorkerMeta | None = None) -> None:
        """Workers reported finished transfers (and, from decode ranks, prefill's first
        token of the requests they received, and which they received verified: vLLM
        reports a request received once every rank did, maybe steps after the first)."""
        if worker_meta is not None:
            for req_id, token in worker_meta.first_tokens.items():
                d = self._decode.get(req_id)
                if d is not None:
                    d.first_token = token
            for req_id in worker_meta.kept:
                d = self._decode.get(req_id)
                if d is not None and d.outer is not None:
                    # A history is prefill's input, pushed on at once: the push's own
                    # checksums cover it from here.
                    self._meta.unkeep.add(req_id)
                elif d is not None:
                    d.recheck = True
            for req_id in worker_meta.closing:
                d = self._decode.get(req_id)
                if d is not None:
                    # Quarantined: prefill stops and fences its WRITEs once it reads this.
                    self._apply_decode(d, d.machine.on_give_up())
            self._lingering.update(worker_meta.lingering)
        for req_id in finished_sending or ():
            self._rechecking.discard(req_id)
            r = self._prefill.get(req_id)
            if r is not None:
                r.machine.on_worker_done()
                self._drop_prefill(r)
        failed = failed_recving or set()
        for req_id in finished_recving or ():
            d = self._decode.get(req_id)
            if d is not None:
                ok = req_id not in failed
                if ok and d.continues:
                    ok = self._continue(d)
                self._apply_decode(d, d.machine.on_recv_done(ok))

    def _continue(self, d: DecodeReq) -> bool:
        """Append prefill's first token to ``d``'s prompt, so decode's first step computes
        that token over the pushed KV, as a colocated engine's second step does. It joins
        the prompt, not the output: vLLM hands the worker a new request's prompt token ids
        and no output, and the gateway asks decode for one token less."""
        req, token = d.request, d.first_token
        if req is None or token < 0 or req.prompt_token_ids is None:
            # The receiver fails a push that brings no first token; never reached.
            logger.error("request %s: received without prefill's first token", d.rid)
            return False
        req.prompt_token_ids = [*req.prompt_token_ids, token]
        if req.prompt_is_token_ids is not None:
            req.prompt_is_token_ids = [*req.prompt_is_token_ids, True]
        req._all_token_ids.append(token)
        req.num_prompt_tokens += 1
        req.update_block_hashes()
        return True

    def has_pending_push_work(self) -> bool:
        """True while the workers have something to finish without new requests: a
        finished prefill's held blocks, WRITEs the fence still polls, a receive whose
        request ended (it ends, and vLLM frees its blocks, only once prefill fenced), a
        recheck, or metadata that waits to ship."""
        return (not self._meta.is_empty() or bool(self._rechecking)
                or any(self._lingering.values())
                or any(r.machine.holds_blocks for r in self._prefill.values())
                or any(d.machine.state is DecodeState.ABANDONED
                       for d in self._decode.values()))

    # -- actions -------------------------------------------------------------------------
    def _apply_prefill(self, r: PrefillReq, out: Transition) -> None:
        for action in out.actions:
            if action is Action.SEND_TARGET and r.target is not None:
                t = r.target
                own = r.traceparent
                self._meta.targets[r.req_id] = SendTarget(
                    t.request_id, t.decode_engine, t.decode_generation,
                    [list(g) for g in t.block_ids], list(t.skip_blocks), t.num_tokens,
                    t.deadline_ms or r.deadline_ms,
                    traceparent=own or t.traceparent, first_token=t.first_token,
                )
            elif action is Action.CANCEL_PUSH:
                self._meta.cancel.add(r.req_id)
            elif action is Action.RELEASE_BLOCKS:
                self._meta.release.add(r.req_id)

    def _drop_prefill(self, r: PrefillReq) -> None:
        self._prefill.pop(r.req_id, None)
        if self._prefill_by_rid.get(r.rid) == r.req_id:
            del self._prefill_by_rid[r.rid]

    def _apply_decode(self, d: DecodeReq, out: Transition, target: PushTarget | None = None
                      ) -> None:
        stream = self.keys.targets(d.prefill_engine)
        for action in out.actions:
            if action is Action.PUBLISH_TARGET and target is not None:
                self._xadd(stream, target)
            elif action is Action.PUBLISH_CANCEL:
                self._xadd(stream, PushTarget(
                    request_id=d.rid, decode_engine=self.cfg.engine_id,
                    decode_generation=self.generation, block_ids=[], skip_blocks=[],
                    num_tokens=0, deadline_ms=d.deadline_ms, cancel=True,
                    push_key=d.params.push_key,
                ))
            elif action is Action.ABANDON_RECV:
                self._meta.abandoned.add(d.req_id)
            elif action is Action.RELEASE_RESERVATION:
                self._release_reservation(d)
        if d.machine.state.terminal:
            self._decode.pop(d.req_id, None)

    def _xadd(self, stream: str, target: PushTarget) -> None:
        data = encode(target)
        maxlen = self.cfg.targets_maxlen

        def xadd(client: Any) -> None:
            (client or self._redis).xadd(stream, {"m": data}, maxlen=maxlen,
                                         approximate=True)

        self._publisher.put_now(xadd, until_ms=target.deadline_ms)

    def _release_reservation(self, d: DecodeReq) -> None:
        resv = d.params.reservation_id
        if not resv:
            return
        token = d.params.fencing_token
        engine = self.cfg.engine_id

        def release() -> None:
            if self._reservations is None:
                from kvpush.common.reservations import Reservations

                self._reservations = Reservations(self._redis, self.keys)
            status = self._reservations.release(engine, str(resv), token)
            logger.debug("released reservation %s on %s: %s", resv, engine, status)

        self._publisher.put(release)

    def shutdown(self) -> None:
        """Stop the background threads."""
        if self._reader is not None:
            self._reader.close()
        self._publisher.close()

    # -- introspection for tests ---------------------------------------------------------
    def tracked(self) -> dict[str, PrefillState | DecodeState]:
        """State of every tracked request, by vLLM request id."""
        out: dict[str, PrefillState | DecodeState] = {
            k: r.machine.state for k, r in self._prefill.items()}
        out.update({k: d.machine.state for k, d in self._decode.items()})
        return out

