"""``KVPushConnector``: the thin vLLM-facing facade over the scheduler and worker sides."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpush.common.log import setup_logging
from kvpush.common.settings import CommonSettings
from kvpush.common.telemetry import TelemetryConfigError, init_tracing
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.metadata import KVPushMetadata, KVPushWorkerMeta
from kvpush.connector.scheduler_side import SchedulerSide
from kvpush.connector.stats import (
    PUSH_LAYERWISE,
    KVPushPromMetrics,
    KVPushStats,
    layerwise_on,
    push_mode,
)
from kvpush.connector.worker_side import UnsupportedLayout, WorkerSide, generation_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


class UnsupportedDeployment(RuntimeError):
    """A parallelism or model shape the push connector refuses (see the message)."""


def _check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Declare what the connector supports; refuse anything else at startup."""
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        raise UnsupportedDeployment(
            "KVPushConnector supports pipeline_parallel_size=1 only "
            f"(got {par.pipeline_parallel_size})"
        )
    if getattr(par, "decode_context_parallel_size", 1) != 1 or getattr(
            par, "prefill_context_parallel_size", 1) != 1:
        raise UnsupportedDeployment("KVPushConnector does not support context parallelism")
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    pushable = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) not in pushable:
            raise UnsupportedDeployment(
                f"KVPushConnector cannot push KV cache group {i} ({type(spec).__name__}, "
                f"layers {', '.join(group.layer_names[:4])}): supported are full attention, "
                "MLA and sliding-window attention (no mamba / linear attention, chunked "
                "local attention or cross-attention)"
            )


def _group_windows(kv_cache_config: KVCacheConfig | None) -> list[int]:
    """Sliding window (tokens) of each KV cache group; 0 for full attention and MLA."""
    if kv_cache_config is None:
        return [0]
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return [g.kv_cache_spec.sliding_window
            if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0
            for g in kv_cache_config.kv_cache_groups] or [0]


def _layer_groups(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    """KV cache group of every attention layer."""
    if kv_cache_config is None:
        return {}
    return {name: i for i, g in enumerate(kv_cache_config.kv_cache_groups)
            for name in g.layer_names}


def _cache_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """The KV cache layout vLLM's engine core resolved (every worker adopts it)."""
    name = (getattr(kv_cache_config, "kv_cache_layout", None)
            or getattr(vllm_config.cache_config, "kv_cache_layout", None))
    return str(name or "LBHNC")


def _page_content(vllm_config: VllmConfig) -> str:
    """How the engine's attention backends read a head's K and V
    (``page_layout.Content``): vLLM's CPU attention re-views one head's bytes as K of
    every token, then V; the CUDA and ROCm backends split each (head, token) cell."""
    model = vllm_config.model_config
    if model is not None and model.use_mla:
        return "latent"
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = {b.get_name() for b in get_current_attn_backends(vllm_config)}
    except Exception as exc:  # the lookup's home moves between vLLM releases
        logger.warning("cannot read the attention backends (%s); assuming the platform's",
                       exc)
        from vllm.platforms import current_platform

        return "split" if current_platform.is_cpu() else "fused"
    split = {n for n in names if n.startswith("CPU")}
    if split and split != names:
        raise UnsupportedDeployment(
            f"attention backends {sorted(names)} read K and V differently; the push "
            "needs one page format per engine")
    return "split" if split else "fused"


def init_connector_tracing(cfg: ConnectorConfig, role: str, tp_rank: int | None = None
                           ) -> bool:
    """Start exporting spans from this engine process; returns whether tracing is on.

    The endpoint is the extra config's ``otlp_endpoint`` or ``KVPUSH_OTLP_ENDPOINT``. When
    vLLM runs with ``--otlp-traces-endpoint`` it has installed its tracer provider in this
    process already (engine core and every worker), and the connector's spans go through
    it to the same collector; otherwise the connector installs kvpush's own.
    """
    from opentelemetry import trace

    settings = CommonSettings()
    endpoint = cfg.otlp_endpoint or settings.otlp_endpoint
    if not endpoint:
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True
    try:
        return init_tracing("kvpush-engine", endpoint, settings.trace_sample_ratio,
                            engine_id=cfg.engine_id, role=role, tp_rank=tp_rank)
    except TelemetryConfigError as exc:
        logger.warning("kvpush connector tracing off: %s", exc)
        return False


def flush_tracing(timeout_ms: int = 2000) -> None:
    """Export the spans still queued (the engine's processes are about to exit)."""
    from opentelemetry import trace

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush(timeout_ms)


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    """Push-based KV transfer: prefill WRITEs each layer into decode's reserved blocks.

    Supported: any prefill and decode TP sizes that divide each other (each prefill rank
    writes its heads into the matching head slice of every decode rank holding them,
    ``tp_mapping``), full attention, MLA and sliding-window layers in any number of KV
    cache groups (vLLM's hybrid KV cache manager stays on: ``SupportsHMA``), block-major
    paged layouts (LBHNC, or MLA's latent pages), NIXL backends UCX and LIBFABRIC.
    Anything else is refused at startup, or at pairing for a peer's layout, with a clear
    error.
    """

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # vLLM configures only its own logger; the connector's records need a handler.
        setup_logging()
        _check_supported(vllm_config, kv_cache_config)
        ktc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config, ktc.engine_id)
        if self.cfg.failure_policy and role == KVConnectorRole.SCHEDULER:
            # vLLM's scheduler reads the policy right after building the connector.
            ktc.kv_load_failure_policy = self.cfg.failure_policy
        generation = generation_of(self.cfg, vllm_config.instance_id)
        block_size = vllm_config.cache_config.block_size
        kv_role = _ROLE.get(str(ktc.kv_role), str(ktc.kv_role))
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self.tracing = False
        if role == KVConnectorRole.SCHEDULER:
            self.tracing = init_connector_tracing(self.cfg, kv_role)
            self.scheduler_side = SchedulerSide(
                self.cfg, block_size=block_size, generation=generation,
                kv_role=str(ktc.kv_role), block_ids_of=self._block_ids_of,
                windows=_group_windows(kv_cache_config),
                continues=ktc.kv_load_failure_policy != "recompute",
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            num_blocks = kv_cache_config.num_blocks if kv_cache_config else 0
            tp_rank = get_tensor_model_parallel_rank()
            # Workers are processes of their own: each exports its spans itself.
            self.tracing = init_connector_tracing(self.cfg, kv_role, tp_rank)
            self.worker_side = WorkerSide(
                self.cfg, tp_rank=tp_rank,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                block_size=block_size, num_blocks=num_blocks, generation=generation,
                tracing=self.tracing,
                read_targets=(str(ktc.kv_role) in ("kv_producer", "kv_both")
                              or self.cfg.history_source),
                layer_groups=_layer_groups(kv_cache_config),
                mla=bool(vllm_config.model_config and vllm_config.model_config.use_mla),
                total_kv_heads=(vllm_config.model_config.get_total_num_kv_heads()
                                if vllm_config.model_config else 0),
                cache_layout=_cache_layout(vllm_config, kv_cache_config),
                content=_page_content(vllm_config),
                head_size=(vllm_config.model_config.get_head_size()
                           if vllm_config.model_config else 0),
            )
        logger.info("KVPushConnector %s for engine %s (role %s, generation %s, backends %s, "
                    "tracing %s)", role.name, self.cfg.engine_id, ktc.kv_role, generation,
                    self.cfg.backends, self.tracing)
        if self.worker_side is not None:
            logger.info("kvpush push mode: %s (CUDA graph mode %s)",
                        "layer-wise" if push_mode(vllm_config) == PUSH_LAYERWISE
                        else "per-step after the forward pass",
                        getattr(getattr(vllm_config, "compilation_config", None),
                                "cudagraph_mode", None))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """A preference, as vLLM's own NIXL connector states it: head-major pages make a
        block (and a head slice under heterogeneous TP) one NIXL descriptor. vLLM drops
        it where the backends cannot take it (an explicit ``VLLM_KV_CACHE_LAYOUT`` wins
        too); the push then addresses whatever layout vLLM resolved (``page_layout``).
        An MLA latent has no heads to order."""
        model = vllm_config.model_config
        if model is not None and model.use_mla:
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise writes need the per-layer hooks, which a FULL CUDA graph replay
        skips: vLLM then runs PIECEWISE graphs, attention (and the hooks) outside them.
        Wherever the hooks still do not run for a step, ``wait_for_save`` writes the
        step's blocks after the forward pass, ordered behind the step's device event."""
        return layerwise_on(extra_config)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34 and later: NIXL registers the device cache with UCX or RDMA (and UCX
        maps it through cuda_ipc for a peer on the same host), so each segment must be one
        physical allocation, as for vLLM's own NIXL connector. vLLM 0.32 never asks."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: the NIXL registration of the cache and the agent peers publish would not
        follow the remap of vLLM's sleep mode (vLLM 0.34 and later ask)."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        """Rebuild worker stats in vLLM's logger process."""
        stats = KVPushStats(data=dict(data or {}))
        stats.data.setdefault("transfers", [])
        return stats

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        """``kvpush_kv_*`` series on the engine's /metrics (built in the API server)."""
        return KVPushPromMetrics(vllm_config, metric_types, labelnames,
                                 per_engine_labelvalues)

    # -- scheduler side ------------------------------------------------------------------
    def _block_ids_of(self, req_id: str) -> list[list[int]]:
        assert self._kv_cache_manager is not None
        return [list(g) for g in self._kv_cache_manager.get_block_ids(req_id)]

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A push restores the request's own blocks in every group."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Decode: the prompt past the local prefix hit will be pushed, asynchronously."""
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Decode publishes its blocks; prefill starts tracking its request."""
        assert self.scheduler_side is not None
        block_ids = ([list(g) for g in blocks.get_block_ids()] if num_external_tokens > 0
                     else [])
        self.scheduler_side.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Metadata for the workers: prefill steps, targets, holds, receives."""
        assert self.scheduler_side is not None
        counts = scheduler_output.num_scheduled_tokens
        scheduled = [(req_id, counts.get(req_id, 0), resumed)
                     for req_id, _blocks, resumed in yield_req_data(scheduler_output)]
        return self.scheduler_side.build_connector_meta(
            scheduled, scheduler_output.preempted_req_ids or ())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Workers finished sends and receives."""
        assert self.scheduler_side is not None
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self.scheduler_side.update_connector_output(
            connector_output.finished_sending, connector_output.finished_recving,
            getattr(connector_output, "failed_recving", None),
            worker_meta if isinstance(worker_meta, KVPushWorkerMeta) else None,
        )

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill holds blocks until its push ends; decode releases its reservation."""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(request, [list(block_ids)]), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with every KV cache group's blocks (hybrid models)."""
        assert self.scheduler_side is not None
        return self.scheduler_side.request_finished(
            request, [list(g) for g in block_ids]), None

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a finished prefill still holds blocks."""
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the paged KV cache with NIXL and publish the agent to Redis."""
        assert self.worker_side is not None
        try:
            self.worker_side.register_kv_caches(kv_caches)
        except UnsupportedLayout as exc:
            raise UnsupportedDeployment(f"KVPushConnector: {exc}") from exc

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward pass: WRITEs still reading a preempted request's
        blocks must finish before vLLM hands those blocks to another request."""
        if self.worker_side is not None and isinstance(kv_connector_metadata, KVPushMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata.preempted)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's metadata before the forward pass (start_load_kv may run after)."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(connector_metadata, KVPushMetadata):
            self.worker_side.on_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to load: decode's KV is pushed into its blocks by prefill."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a pushed request runs only after its KV arrived."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Post this layer's WRITEs as soon as the layer's KV is in the cache."""
        if self.worker_side is not None:
            self.worker_side.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """After the forward pass: post catch-up writes, poll, seal finished pushes."""
        if self.worker_side is not None:
            self.worker_side.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Completed pushes (blocks can be freed) and receives (request can run)."""
        assert self.worker_side is not None
        sending, recving, failed = self.worker_side.get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Legacy entry point; vLLM calls :meth:`get_transfer_results`."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failed pushes are reported per request (``failed_recving``), not per block."""
        return self.worker_side.failed_block_ids() if self.worker_side else set()

    def build_connector_worker_meta(self) -> KVPushWorkerMeta | None:
        """Decode: prefill's first token of the requests received this step, those received
        verified and those quarantined; prefill: how many pushes the fence still polls."""
        if self.worker_side is None:
            return None
        receiver = self.worker_side.receiver
        tokens, kept = receiver.take_first_tokens(), receiver.take_kept()
        closing = receiver.take_closing()
        lingering = self.worker_side.sender.fence.take_lingering()
        told = {self.worker_side.tp_rank: lingering} if lingering is not None else {}
        if tokens or kept or closing or told:
            return KVPushWorkerMeta(tokens, kept, closing, told)
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Transfers finished since the last step."""
        return self.worker_side.take_stats() if self.worker_side is not None else None

    def shutdown(self) -> None:
        """Stop background threads and drop NIXL peers."""
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if self.tracing:
            flush_tracing()
