"""Service settings: one pydantic-settings class per service, all read from ``KVPUSH_*`` env vars.

Every field carries a docstring; ``kvpush <service> --help`` and the settings tables of
docs/configure.md are built from them, so the docstring is the documentation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_CONFIG = SettingsConfigDict(
    env_prefix="KVPUSH_",
    env_file=None,
    extra="ignore",
    use_attribute_docstrings=True,
)


def parse_sentinels(value: str) -> list[tuple[str, int]]:
    """``host:port,host:port`` as (host, port) pairs; raises ValueError on a malformed entry."""
    out: list[tuple[str, int]] = []
    for item in (x.strip() for x in value.split(",")):
        host, sep, port = item.rpartition(":")
        if not item or not sep or not host or not port.isdigit():
            raise ValueError(f"Sentinel address {item!r} is not host:port")
        out.append((host.strip("[]"), int(port)))
    return out


class CommonSettings(BaseSettings):
    """Settings every kvpush process reads."""

    model_config = _CONFIG

    redis_url: str | None = None
    """Redis URL (``redis://``, ``rediss://`` for TLS, ``unix://``); with ``redis_cluster``
    any one node of the cluster. Unset (and no Sentinels): ``kvpush up`` starts an embedded
    local Redis; other services refuse to start."""

    redis_cluster: bool = False
    """Talk Redis Cluster: ``redis_url`` names any node and the client finds the rest and
    follows slot moves and failovers."""

    redis_sentinels: str | None = None
    """Redis Sentinels as ``host:port,host:port``: the client asks them for the master of
    ``redis_sentinel_master`` and follows a failover without a restart (``redis_url`` and
    the TLS settings are then not used)."""

    redis_sentinel_master: str | None = None
    """Name of the master the Sentinels monitor (required with ``redis_sentinels``)."""

    redis_sentinel_username: str | None = None
    """ACL user name for the Sentinels themselves (when they require AUTH)."""

    redis_sentinel_password: str | None = None
    """Password for the Sentinels themselves (when they require AUTH)."""

    redis_username: str | None = None
    """Redis ACL user name; overrides the one in the URL."""

    redis_password: str | None = None
    """Redis password (AUTH / ACL); overrides the one in the URL."""

    redis_tls_ca: Path | None = None
    """CA bundle that verifies the Redis server certificate (``rediss://`` URLs)."""

    redis_tls_cert: Path | None = None
    """Client certificate for mutual TLS to Redis."""

    redis_tls_key: Path | None = None
    """Private key for ``redis_tls_cert``."""

    redis_socket_timeout_s: float = Field(10.0, gt=0)
    """Deadline of one Redis reply. A silent partition otherwise hangs a call until TCP gives
    up (hours); every blocking read kvpush issues (XREAD BLOCK) waits well under this."""

    redis_connect_timeout_s: float = Field(5.0, gt=0)
    """Deadline of opening a Redis connection."""

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_list(cls, value: str | None) -> str | None:
        if value is not None:
            parse_sentinels(value)
        return value

    key_prefix: str = "kvpush"
    """Prefix of every Redis key; lets several clusters share one Redis."""

    request_shards: int = Field(1, ge=1, le=256)
    """Streams the request queue is split over (a hash of the request id picks one): on a
    Redis Cluster each shard sits in its own slot, so the queue spreads over the masters.
    Every gateway and scheduler must agree: schedulers read shards ``0 .. N-1`` only. To add
    shards, raise it on the schedulers first, then on the gateways; to remove some, lower it
    on the gateways first and on the schedulers once the dropped shards are empty."""

    log_level: str = "INFO"
    """Python log level of the process."""

    otlp_endpoint: str | None = None
    """OTLP traces endpoint (``http://host:4318`` for HTTP, ``grpc://host:4317`` for gRPC).
    Unset: tracing is off and costs nothing."""

    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Share of new traces sampled (parent-based: a sampled parent is always followed)."""

    model_dir: Path = Path.home() / ".cache" / "kvpush" / "models"
    """Directory that holds the locally built models."""

    run_dir: Path = Path.home() / ".cache" / "kvpush" / "run"
    """Directory for pid files, logs and the embedded Redis of ``kvpush up``."""

    engine_api_key: SecretStr | None = None
    """Token the engines require on their OpenAI routes (vLLM's ``VLLM_API_KEY``) and the
    gateway sends: only kvpush's own gateway can submit requests to an engine. Unset: the
    engines accept anyone who reaches their port (``kvpush up`` makes one per run)."""

    scheduler_min_disagg_tokens: int = Field(0, ge=0)
    """Prompts shorter than this go to a decode engine alone, with no transfer. The
    schedulers place by it; the gateway reads it too, to send no such prompt to prefill
    at admission (``gateway_early_prefill``)."""

    scheduler_history_push_tokens: int = Field(512, ge=0)
    """History push: when another engine (a decode that served the conversation's last
    turn, or another prefill) holds at least this many more leading prompt tokens than the
    prefill picked, by the engines' KV events, the holder may push them into blocks that
    prefill reserves, and prefill computes only the rest (connector/README.md); whether it
    does is the cost model's choice (``scheduler_history_cost_model``). 0: off; prefill
    recomputes whatever it does not hold. A shorter history is recomputed without weighing:
    a push costs a leg on the holder and a wait for its step, which a few hundred tokens
    of compute rarely outlast (``kvpush bench multiturn``, BENCHMARKS.md "History push").
    The gateway reads it too: it sends no longer prompt that carries an earlier
    turn's answer to prefill at admission (``gateway_early_prefill``), since only the
    placement knows whether a holder would save prefill the work."""

    verify_kv: float = Field(0.0, ge=0.0, le=1.0)
    """Share of pushes whose KV is checksummed end to end (0 off, 1 every request): prefill
    sends a CRC per layer and block with PushDone, decode recomputes it over the blocks it
    received before it schedules the request and fails the receive on a mismatch."""


class EngineSettings(CommonSettings):
    """Settings of ``kvpush engine``: one vLLM OpenAI server with a P/D connector."""

    engine_id: str | None = None
    """Stable engine id published to Redis; defaults to ``<role>-<host>-<port>``."""

    engine_host: str = "127.0.0.1"
    """Address the vLLM server binds and advertises."""

    engine_port: int = 8100
    """HTTP port of the vLLM server."""

    engine_cpus: str | None = None
    """CPU list the engine is bound to (``taskset`` syntax, e.g. ``0`` or ``2-3``); with
    TP, split among the ranks."""

    engine_tp: int = Field(1, ge=1)
    """Tensor-parallel size of the engine (``kvpush engine --tp``): one worker process per
    rank, each bound to its share of the engine's CPUs."""

    engine_kv_events: bool = True
    """Publish the engine's KV cache events (vLLM's ``--kv-events-config``) and relay the
    prefix chunks it holds to Redis, where placement reads them
    (services/engine/kv_events.py). Needs the engine's Redis, like the heartbeat."""

    engine_worker_in_core: bool = True
    """Without TP, run the model in vLLM's engine-core process (its ``uni`` executor), as
    vLLM does on GPUs, instead of a worker process of its own (vLLM's CPU default): one
    process less to start, and no hop between scheduler and model at every step."""

    engine_kv_cache_gib: float = Field(1.0, gt=0)
    """KV cache size on CPU (``--kv-cache-memory-bytes``), in GiB; ``kvpush up`` gives
    each of its engines this much (``--kv-cache-gib``)."""

    engine_max_model_len: int = Field(2048, ge=1)
    """Maximum sequence length (prompt plus generated tokens) the engine accepts;
    ``kvpush up`` starts every engine with it and its gateway refuses longer requests
    (``--max-model-len``)."""

    engine_block_size: int | None = Field(None, ge=1)
    """Tokens per KV block; unset keeps vLLM's platform default (128 on CPU, where the
    attention kernel needs a multiple of 32). ``kvpush up`` applies it to every engine
    (``--block-size``)."""

    engine_ready_timeout_s: float = 300.0
    """How long to wait for the engine's /health before giving up."""

    engine_zygote: bool = True
    """Fork engines from a warm zygote, an interpreter that has imported vLLM already
    (services/engine/zygote.py): an engine starts, restarts or scales up in about a third
    of the time. Off: every engine is a fresh interpreter."""

    engine_zygote_dir: Path | None = None
    """Directory whose zygotes every launcher on this host shares (``kvpush up`` and
    ``kvpush engine`` processes alike; a shared zygote leaves after 10 idle minutes).
    Unset, each launcher keeps zygotes of its own, except ``kvpush engine``, which starts
    one engine and never restarts it, so uses none."""

    engine_nixl_backends: list[str] = Field(default_factory=lambda: ["UCX"])
    """NIXL backends of the kvpush connector, in preference order: ``["UCX"]`` here,
    ``["LIBFABRIC"]`` on AWS EFA (env value is JSON, e.g. ``'["LIBFABRIC"]'``)."""

    engine_quarantine_max_s: float = Field(60.0, gt=0)
    """Longest the kvpush connector of a decode engine keeps a failed push's blocks from
    vLLM while it waits for every prefill rank to say that none of its WRITEs can still
    land; past it the blocks go back anyway, counted as a cut-off (connector/README.md,
    *Late WRITEs*)."""

    engine_side_channel_port: int = 5600
    """NIXL side-channel port of the stock connectors (distinct per engine)."""

    engine_heartbeat_s: float = 1.0
    """Interval between engine status publications to Redis."""

    engine_status_ttl_s: float = 5.0
    """TTL of the engine status key; a dead engine vanishes after it."""

    engine_drain_timeout_s: float = 60.0
    """On SIGTERM/SIGINT, ``kvpush engine`` marks itself draining (no new assignments) and
    waits up to this long for what it holds to finish before it stops; 0 stops at once.
    A second signal stops at once too."""


class SchedulerSettings(CommonSettings):
    """Settings of ``kvpush scheduler``: the push scheduler on Redis Streams."""

    scheduler_id: str | None = None
    """Consumer name inside the group; defaults to ``<host>-<pid>``."""

    scheduler_group: str = "schedulers"
    """Consumer group on the request stream."""

    scheduler_lease_s: float = 30.0
    """Lease of a decode reservation; released on completion or when it expires."""

    scheduler_claim_idle_ms: int = 5000
    """Idle time after which another scheduler reclaims a pending entry (XAUTOCLAIM)."""

    scheduler_max_deliveries: int = 3
    """Deliveries after which an entry goes to the dead-letter stream."""

    scheduler_queue_timeout_s: float = 10.0
    """Longest a request waits for a free decode slot before it is rejected."""

    scheduler_max_queue: int = 1024
    """Most requests held back for lack of a decode slot before new ones are rejected."""

    scheduler_prefix_affinity: bool = True
    """Prefer the decode and prefill engines holding the longest prefix of the prompt (the
    gateway's prefix hashes against what the engines' KV events say they hold), when their
    load allows; with engines that relay no KV events, the ones that got the same prefix
    before (services/scheduler/affinity.py)."""

    scheduler_history_cost_model: bool = True
    """Push a held history (``scheduler_history_push_tokens`` or more) only when prefill's
    measured wait for a history push is shorter than computing those tokens at its measured
    prompt throughput (common/history_cost.py; both come with prefill's heartbeat). Until
    a prefill has measured both, histories are pushed. False: every history past the
    threshold is pushed."""

    scheduler_history_explore_every: int = Field(16, ge=0)
    """Of the histories the cost model recomputes, every this many is pushed anyway, so a
    wait measured while the holders were busy is measured again. 0: never."""

    scheduler_decode_alone_tokens: int = 16
    """Conditional disaggregation: when the decode engine picked holds a prompt's prefix
    (by its KV events) and fewer than this many prompt tokens are left to compute, it
    computes them itself, with no prefill and no transfer: a retry, a regenerate, a
    repeated prompt whose every whole chunk decode holds. 16 by default: on the CPU engines
    measured (``kvpush bench conditional``, BENCHMARKS.md) decode alone answered as soon as
    P/D for tails of 1-16 tokens and stalled decode's running streams no longer, saving
    prefill's pass and the push; 32 tokens were already 1.23x slower. Set it to the tail
    your engines compute within one TPOT objective (hundreds of tokens on a GPU); 0 turns
    it off."""

    scheduler_placement: str = "least_loaded"
    """Decode placement policy: ``least_loaded`` or ``best_fit``."""

    scheduler_refresh_s: float = 0.5
    """Interval between full re-reads of the engine view (engines heartbeat every second)."""

    scheduler_retry_s: float = 0.05
    """Interval between attempts to place waiting requests; each re-reads only the decode
    engines' reservation levels, and only while requests wait."""

    scheduler_sweep_s: float = 5.0
    """Interval between sweeps that purge expired reservations on every engine."""

    scheduler_batch: int = 128
    """Most stream entries read (and answered in one pipeline) at a time."""

    scheduler_retry_after_s: float = 1.0
    """Retry-After hint sent with a rejection for overload or missing engines."""

    scheduler_once_ttl_s: float = 600.0
    """How long a request id is remembered, so that a duplicate entry reserves only once."""

    scheduler_assign_maxlen: int = 10000
    """Approximate cap on the length of each gateway's assignment stream."""

    scheduler_dead_maxlen: int = 100_000
    """Approximate cap on the length of the dead-letter stream (oldest dropped first)."""

    scheduler_metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the scheduler's Prometheus metrics (the planner's replica counts, which KEDA
    scales on); None: not served."""

    planner_enabled: bool = True
    """Run the fleet planner (services/scheduler/planner.py) in this scheduler; one of the
    group leads it at a time. It only publishes counts; it starts or stops nothing."""

    planner_period_s: float = Field(2.0, gt=0)
    """How often the leading planner reads the fleet and publishes its counts."""

    planner_ttft_s: float = Field(2.0, gt=0)
    """Objective for the gateways' p90 time to first token: past it, with prefill queueing,
    the planner asks for another prefill engine."""

    planner_itl_s: float = Field(0.2, gt=0)
    """Objective for the mean time per output token: past it, another decode engine."""

    planner_kv_high: float = Field(0.85, gt=0, le=1)
    """Decode KV usage (reserved or used blocks over all) past which another decode engine
    is asked for: new requests would soon wait for blocks."""

    planner_kv_low: float = Field(0.4, gt=0, le=1)
    """A role shrinks only while its load would fit on one engine fewer under this KV usage
    (decode) and nothing queues on it, with its latency under half its objective."""

    planner_up_stable_s: float = Field(10.0, ge=0)
    """Pressure must hold this long before the planner adds an engine."""

    planner_down_stable_s: float = Field(120.0, ge=0)
    """Room must hold this long before the planner removes one (scale-down drains first,
    so a flapping load costs a boot, never a request)."""

    planner_min_prefill: int = Field(1, ge=0, le=1024)
    """Fewest prefill engines the planner asks for."""

    planner_max_prefill: int = Field(8, ge=0, le=1024)
    """Most prefill engines the planner asks for."""

    planner_min_decode: int = Field(1, ge=1, le=1024)
    """Fewest decode engines the planner asks for."""

    planner_max_decode: int = Field(8, ge=1, le=1024)
    """Most decode engines the planner asks for."""


class GatewaySettings(CommonSettings):
    """Settings of ``kvpush gateway``: the OpenAI-compatible HTTP front."""

    gateway_id: str | None = None
    """Name of this gateway; its assignment stream is keyed by it."""

    gateway_host: str = "127.0.0.1"
    """Address the HTTP server binds."""

    gateway_port: int = 8000
    """Port the OpenAI API is served on."""

    gateway_model: str | None = None
    """Model name served; defaults to the model the engines report."""

    gateway_tokenizer: str | None = None
    """Tokenizer path used to count prompt tokens; defaults to the served model's directory
    under ``model_dir`` (``kvpush up``: the model directory its engines serve)."""

    gateway_request_timeout_s: float = 120.0
    """Deadline of one request from arrival to last token."""

    gateway_dispatch_retries: int = Field(2, ge=0, le=8)
    """Times a request whose engine failed before the first token (refused, reset, 5xx,
    no response headers in time) is placed again on other engines within its deadline."""

    gateway_suspect_cooldown_s: float = Field(2.0, ge=0)
    """First cool-down of the circuit breaker: an engine a dispatch failed on gets no new
    requests from any scheduler for this long, doubling on repeated failures up to 30 s.
    0 turns the breaker off (failed dispatches are still re-routed)."""

    gateway_unresponsive_s: float = Field(5.0, ge=0)
    """A request still waiting for its first token leaves an engine (decode or prefill)
    that has answered no ``/health`` probe for this long (frozen, wedged, cut off) and is
    placed again on others. Probes run only while requests wait; 0 turns them off."""

    gateway_first_byte_timeout_s: float = Field(10.0, gt=0)
    """A streaming decode engine that sends no response headers this long after the
    request is treated as failed (a frozen engine accepts connections but never answers)."""

    gateway_auth: bool = False
    """Require ``Authorization: Bearer`` API keys mapped to tenants."""

    gateway_auth_cache_s: float = Field(2.0, ge=0.0)
    """How long a verified API key is trusted without asking Redis again: a key revoked
    elsewhere is refused by this gateway within this bound (0: ask Redis every request)."""

    gateway_expose_metrics: bool = False
    """Serve ``/metrics`` on the API port too. Off: clients cannot read the gateway's tenant
    labels and load; scrape ``gateway_metrics_port`` instead."""

    gateway_metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of a separate listener (on ``gateway_host``) that serves only ``/metrics``.
    Unset: no metrics listener."""

    gateway_expose_docs: bool = False
    """Serve FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` on the API port."""

    gateway_max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest request body accepted; a larger one gets HTTP 413 before it is parsed."""

    gateway_body_timeout_s: float = Field(30.0, gt=0)
    """Longest a client may take to send its request body (HTTP 408 after it)."""

    gateway_max_header_bytes: int = Field(32 * 1024, ge=1024)
    """Largest request header block accepted (HTTP 431). The HTTP parser itself refuses
    header blocks over twice this while reading them."""

    gateway_max_json_depth: int = Field(32, ge=4, le=256)
    """Deepest nesting of objects and arrays accepted in a request body."""

    gateway_max_tokens: int = Field(32768, ge=1)
    """Largest ``max_tokens`` / ``max_completion_tokens`` a request may ask for."""

    gateway_responses_ttl_s: float = Field(30 * 86400.0, ge=0)
    """How long a stored ``/v1/responses`` answer (``store``, true unless the request says
    false) stays readable and continuable with ``previous_response_id``; OpenAI keeps
    them 30 days. 0: nothing is stored, and answers say ``"store": false``."""

    gateway_responses_max_bytes: int = Field(64 << 20, ge=1 << 16)
    """Most bytes of stored responses one tenant keeps in Redis (compressed, each holding
    its conversation so far); storing past it drops the tenant's soonest-expiring ones."""

    gateway_responses_max_count: int = Field(10_000, ge=1)
    """Most stored responses one tenant keeps; past it the soonest-expiring one goes."""

    gateway_response_max_bytes: int = Field(8 << 20, ge=1 << 10)
    """Largest conversation one stored response may hold (its input items and output,
    encoded, before compression). A request continuing one already at it gets HTTP 400;
    an answer that grows past it is served but not stored (``"store": false``)."""

    gateway_max_choices: int = Field(64, ge=1, le=4096)
    """Most choices one request may ask for: the prompts of a ``/v1/completions`` batch
    times ``n``. Each choice is placed as a request of its own, with its own reservation
    and quota admission; a request for more gets HTTP 400 before anything is reserved."""

    gateway_shed_ttft_s: float = Field(2.0, ge=0)
    """Objective for a request's wait to its first token. A request whose estimated wait
    (the prompt tokens admitted ahead of it, over the measured rate at which they reach
    their first token) passes it is shed at once with ``gateway_shed_status`` and a
    Retry-After computed from the backlog, instead of queueing behind it. 0 turns shedding
    off (requests then queue up to the scheduler's ``scheduler_queue_timeout_s``)."""

    gateway_shed_tpot_s: float = Field(0.0, ge=0)
    """Objective for the time per output token: while the mean gap between the tokens the
    gateway relays passes it, new requests are shed too (another stream would slow every
    running one). 0 (the default): not watched, since a fitting value depends on the model
    and hardware. Needs ``gateway_shed_ttft_s`` above 0."""

    gateway_shed_headroom: float = Field(0.5, gt=0, le=1)
    """Fraction of ``gateway_shed_ttft_s`` the estimated wait may reach before requests
    are shed. The estimate is a mean wait; in a queue the slowest requests wait a few times
    the mean, so admitting up to half the objective keeps the admitted requests' tail, not
    only their typical wait, within it. 1: admit up to the objective itself. With
    ``gateway_shed_learn`` it is where the learned headroom starts and the most it grows
    to."""

    gateway_shed_learn: bool = True
    """Learn the headroom from what was admitted: the admitted requests' p99 time to first
    token, from their arrival at the gateway, is kept at 70 % of ``gateway_shed_ttft_s``,
    each change of the headroom judged only on requests admitted under it (those still
    waiting counted with their wait so far); it shrinks when the p99 passes that and grows
    while requests are shed and the p99 is well under it, up to ``gateway_shed_headroom``,
    where it starts. False: the headroom stays ``gateway_shed_headroom``."""

    gateway_shed_over_share: float = Field(0.5, gt=0, le=1)
    """A tenant holding more than its weighted share of the backlog is shed once the
    estimate passes this fraction of the admission limit (``gateway_shed_ttft_s`` times
    ``gateway_shed_headroom``); the others only past the limit itself. So a flooding
    tenant is shed first and a light one keeps its latency."""

    gateway_shed_status: Literal[429, 503] = 429
    """HTTP status of a shed request (429, as the scheduler's own overload answer, or 503)."""

    gateway_max_model_len: int | None = Field(None, ge=1)
    """Context length of the served model: prompt plus ``max_tokens`` above it are refused
    before anything is reserved. Unset: the tokenizer's ``model_max_length`` if it states
    one (``kvpush up``: its engines' ``engine_max_model_len``)."""

    gateway_http: Literal["h11", "httptools"] = "httptools"
    """HTTP/1.1 parser: ``httptools`` (C, vLLM's own) or ``h11`` (pure Python, slower);
    both refuse a header block over twice ``gateway_max_header_bytes`` while reading it."""

    gateway_max_connections: int | None = Field(4096, ge=1)
    """Most concurrent connections plus requests; more get HTTP 503 (unset: no limit)."""

    gateway_keepalive_s: int = Field(30, ge=1)
    """Idle keep-alive connections are closed after this long."""

    gateway_migrations: int = Field(1, ge=0, le=4)
    """Times a stream whose decode engine fails after tokens reached the client moves to
    another decode (the prompt plus what was generated, prefilled again) instead of ending
    with an error event; 0 turns migration off."""

    gateway_continue_from_prefill: bool = True
    """Decode goes on from prefill's first token instead of recomputing the prompt's last
    token and sampling the first token again: a greedy answer is then a colocated engine's
    token for token (``services/gateway/continuation_exact.py`` says which requests; decode
    engines whose failed pushes are recomputed do not, ``EngineStatus.continues``)."""

    gateway_first_token_from_prefill: bool = True
    """Stream a request's first token from prefill's answer instead of waiting for decode
    to stream it (greedy or seeded requests without per-token extras; decode's first token
    is checked against it, see ``services/gateway/lead.py``)."""

    gateway_early_prefill: bool = True
    """Send a prompt to a dedicated prefill engine at admission, while the schedulers pick
    its decode, so the scheduler's decision races prefill's forward pass instead of coming
    before it. A placement that goes elsewhere cancels the call
    (``services/gateway/early_prefill.py``)."""

    gateway_early_prefill_queue_s: float = Field(0.05, ge=0)
    """No early prefill while one of this gateway's requests has waited longer than this
    for its assignment: the schedulers have a queue, and their fair order across tenants
    decides whose prompt is computed first. A placement takes a few milliseconds."""

    gateway_early_prefill_min_tokens: int | None = Field(None, ge=0)
    """Shortest prompt sent early. Unset, it is ``scheduler_min_disagg_tokens`` (read from
    the same environment), below which the schedulers place a request on decode alone and
    the early call would be wasted."""

    gateway_early_prefill_refresh_s: float = Field(1.0, gt=0)
    """How often the gateway re-reads which prefill engines are up, for early prefill."""

    gateway_prefix_affinity: bool = True
    """Send the schedulers hashes of the prompt's leading token chunks, so that requests
    sharing a prefix (multi-turn chat, a common system prompt) go where its KV is."""

    gateway_forward_token_ids: bool = True
    """A completion's text prompt is tokenized once, by the gateway (it counts the tokens
    anyway), and both engines get the token ids instead of the text."""

    gateway_redis_outage_s: float = Field(5.0, ge=0)
    """How long a request rides out Redis being unreachable (a restart, a Sentinel or
    Cluster failover) while it is authenticated, admitted and enqueued, before it gets
    HTTP 503; never past its deadline."""

    gateway_header_timeout_s: float = Field(10.0, gt=0)
    """A connection whose request header block is not complete this long after its first
    byte (or after the connection opened) is closed: slow-loris clients hold nothing."""

    gateway_write_timeout_s: float = Field(30.0, gt=0)
    """A streaming client that reads nothing for this long is cut off, and its reservation
    and quota lease are released."""


class StackSettings(CommonSettings):
    """Settings of ``kvpush up``: a whole local P/D stack on one machine."""

    stack_model: str = "smollm2-135m"
    """Model every engine of the stack serves (``kvpush up --model``): a local model's name
    (see ``kvpush models``: ``smollm2-135m`` is a real instruction-tuned model, the others
    have random weights) or a model directory of one's own, used as is by the engines and,
    for counting prompt tokens, by the gateway; clients name it by its base name."""

    stack_connector: str = "kvpush"
    """Connector of the local stack: ``kvpush``, ``nixl-pull``, ``nixl-push`` or ``none``."""

    stack_port: int = 8000
    """Port of the stack's OpenAI API."""

    stack_prefill_port: int = 8100
    """HTTP port of the first prefill engine (the next ones count up by 2: the stock
    connectors' side channel takes port + 1)."""

    stack_decode_port: int = 8200
    """HTTP port of the first decode engine (the next ones count up by 2)."""

    stack_prefill_engines: int = Field(1, ge=1, le=64)
    """Prefill engines of the local stack (``kvpush up --prefill N``)."""

    stack_decode_engines: int = Field(1, ge=1, le=64)
    """Decode engines of the local stack (``kvpush up --decode M``)."""

    stack_prefill_tp: int = Field(1, ge=1, le=64)
    """Tensor-parallel size of each prefill engine (``kvpush up --prefill-tp N``); it may
    differ from decode's when one divides the other."""

    stack_decode_tp: int = Field(1, ge=1, le=64)
    """Tensor-parallel size of each decode engine (``kvpush up --decode-tp M``)."""

    stack_autoscale: bool = False
    """Apply the fleet planner's counts to the stack's engines (``kvpush up --autoscale``):
    engines are added up to ``stack_max_prefill`` / ``stack_max_decode`` and drained, then
    removed, down to one per role (services/local/autoscale.py)."""

    stack_max_prefill: int | None = Field(None, ge=1, le=64)
    """Most prefill engines under ``--autoscale`` (``--max-prefill``); None: one more than
    the stack starts with."""

    stack_max_decode: int | None = Field(None, ge=1, le=64)
    """Most decode engines under ``--autoscale`` (``--max-decode``); None: one more than
    the stack starts with."""

    stack_redis_port: int = 6390
    """Port of the embedded Redis started when no Redis URL is configured."""
