"""Worker side of the push connector, one per rank: registers the KV cache and hands each
step to the prefill ``Sender`` and the decode ``Receiver``."""

from __future__ import annotations

import collections
import logging
import zlib
from collections.abc import Callable, Iterable, Sequence

import redis
import torch

from kvpush.common.keys import RedisKeys
from kvpush.common.settings import CommonSettings
from kvpush.common.wire import AgentInfo, KVLayout, PushTarget
from kvpush.connector import integrity, page_layout
from kvpush.connector.config import ConnectorConfig, RedisAccessError, connector_redis
from kvpush.connector.device import Device, device_of
from kvpush.connector.groups import region_groups
from kvpush.connector.metadata import KVPushMetadata
from kvpush.connector.nixl_transport import NixlTransport
from kvpush.connector.receiver import Receiver
from kvpush.connector.registry import AgentRegistry
from kvpush.connector.sender import Sender
from kvpush.connector.stats import KVPushStats, TransferObserver
from kvpush.connector.target_reader import TargetReader
from kvpush.connector.targets import unpairable_peers
from kvpush.connector.transport import Transport

logger = logging.getLogger(__name__)

# Builds a rank's transport from its agent name and backends (NixlTransport in engines).
TransportFactory = Callable[[str, Sequence[str]], Transport]


class UnsupportedLayout(RuntimeError):
    """The engine's KV cache cannot be pushed block by block as registered."""


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], *, num_blocks: int,
                       block_size: int, tp_rank: int, tp_size: int,
                       cache_layout: str = "LBHNC", content: str = "split",
                       head_size: int = 0, layer_groups: dict[str, int] | None = None,
                       total_kv_heads: int = 0) -> tuple[KVLayout, list[tuple[int, int]]]:
    """The :class:`KVLayout` a rank publishes for vLLM's per-layer cache views
    (``[B, H, N, C]``, or ``[B, N, C]`` for an MLA latent) placed by KV cache layout
    ``cache_layout`` and read by the backend as ``content`` (``page_layout.Content``),
    and the memory ranges (addr, len) to register. Raises :class:`UnsupportedLayout`
    naming what does not fit."""
    if not kv_caches:
        raise UnsupportedLayout("no KV cache layers to register")
    names = list(kv_caches)
    first = kv_caches[names[0]]
    storages: dict[int, int] = {}
    bases: list[int] = []
    for n in names:
        t = kv_caches[n]
        if not isinstance(t, torch.Tensor):
            raise UnsupportedLayout(
                f"layer {n} has a {type(t).__name__} KV cache; only plain attention "
                "layers are supported (no hybrid/mamba models)"
            )
        if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
                or t.device != first.device):
            raise UnsupportedLayout(
                f"layer {n} has KV cache {tuple(t.shape)}/{t.stride()}/{t.dtype}; every "
                f"layer must match {tuple(first.shape)}/{first.stride()}/{first.dtype}"
            )
        if t.ndim not in (3, 4) or t.shape[0] != num_blocks:
            raise UnsupportedLayout(
                f"layer {n}: KV cache {tuple(t.shape)} is not vLLM's [blocks, heads, "
                f"tokens, content] view of {num_blocks} blocks"
            )
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        bases.append(t.data_ptr())
    try:
        geom = page_layout.geometry(cache_layout, content, tuple(first.shape),
                                    tuple(first.stride()), first.element_size(), head_size)
    except page_layout.UnsupportedPage as exc:
        raise UnsupportedLayout(f"KV cache layout {cache_layout} ({content} K/V): {exc}"
                                ) from exc
    if geom.tokens != block_size:
        raise UnsupportedLayout(f"pages of {geom.tokens} tokens for block size {block_size}")
    memory = "DRAM" if first.device.type == "cpu" else "VRAM"
    # NIXL registers device memory by the CUDA ordinal of the rank's own GPU.
    device_id = 0 if first.device.type == "cpu" else max(first.get_device(), 0)
    latent = geom.content is page_layout.Content.LATENT
    layout = KVLayout(
        layer_names=names, base_addrs=bases, region_len=first.nbytes,
        block_len=geom.page_bytes, num_blocks=num_blocks,
        block_size=block_size, dtype=str(first.dtype).removeprefix("torch."),
        kv_splits=1, tp_rank=tp_rank, tp_size=tp_size, memory=memory,
        device_id=device_id, block_stride=first.stride(0) * first.element_size(),
        page=integrity.LATENT if latent else integrity.HEADS,
        layer_groups=region_groups(names, layer_groups or {}),
        kv_heads=geom.heads, total_kv_heads=total_kv_heads or geom.heads * tp_size,
        cache_layout=geom.layout, content=geom.content.value, parts=geom.parts,
        part_bytes=geom.part_bytes, head_stride=geom.head_stride,
        part_stride=geom.part_stride, token_stride=geom.token_stride,
    )
    return layout, sorted(storages.items())


def generation_of(cfg: ConnectorConfig, instance_id: str) -> int:
    """The engine generation every rank and the scheduler side agree on."""
    if cfg.generation:
        return cfg.generation
    # vLLM stamps one instance id per engine start and ships it to every worker.
    return zlib.crc32(instance_id.encode()) or 1


class WorkerSide:
    """Per-rank connector logic; vLLM calls it from the model runner's thread only.

    A rank may push (prefill), receive (decode) or both; the ``sender`` and ``receiver``
    share this rank's transport, registry entry and stats observer.
    """

    def __init__(self, cfg: ConnectorConfig, *, tp_rank: int, tp_size: int, block_size: int,
                 num_blocks: int, generation: int, client: redis.Redis | None = None,
                 tracing: bool = False, read_targets: bool = False,
                 transport_factory: TransportFactory = NixlTransport,
                 layer_groups: dict[str, int] | None = None, mla: bool = False,
                 total_kv_heads: int = 0, cache_layout: str = "LBHNC",
                 content: str | None = None, head_size: int = 0) -> None:
        self.cfg = cfg
        # The model's KV heads (0: this rank's times the TP size); one latent for MLA.
        self.total_kv_heads = 1 if mla else total_kv_heads
        # vLLM's resolved KVCacheLayout and how the attention backend reads a head's
        # content (page_layout.Content); vLLM's CPU attention splits K from V per head.
        self.cache_layout = cache_layout
        self.content = "latent" if mla else (content or "split")
        self.head_size = head_size
        # KV cache group of each attention layer (hybrid models); MLA pages hold latents.
        self.layer_groups = dict(layer_groups or {})
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.generation = generation
        self.keys = RedisKeys(cfg.key_prefix)
        self._redis = client or connector_redis(cfg)
        self._transport_factory = transport_factory
        self.registry = AgentRegistry(self._redis, self.keys, cfg.agent_ttl_s, cfg.heartbeat_s)
        self.observer = TransferObserver(cfg.stats_file, tracing=tracing)
        self.transport: Transport | None = None
        self.layout: KVLayout | None = None
        verify_rate = (cfg.verify_kv if cfg.verify_kv is not None
                       else CommonSettings().verify_kv)
        # A pushing rank reads its engine's target stream itself (see Sender._targets).
        targets: collections.deque[PushTarget] | None = None
        self._target_reader: TargetReader | None = None
        if read_targets:
            targets = collections.deque(maxlen=4096)
            # Its own connection: XREAD BLOCK holds one for up to a second.
            self._target_reader = TargetReader(
                connector_redis(cfg, check=False), self.keys.targets(cfg.engine_id), targets,
                log_skips=False)
        self.receiver = Receiver(cfg, tp_rank=tp_rank, block_size=block_size,
                                 observer=self.observer)
        self.sender = Sender(cfg, tp_rank=tp_rank, block_size=block_size,
                             registry=self.registry, observer=self.observer,
                             verify_rate=verify_rate,
                             on_notifications=self.receiver.on_notifications,
                             targets=targets)

    # -- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register every layer's paged KV cache with the transport and publish the agent."""
        layout, ranges = self._describe(kv_caches)
        name = f"{self.cfg.engine_id}-r{self.tp_rank}-{self.generation}"
        transport = self._transport_factory(name, self.cfg.backends)
        transport.register(layout, ranges)
        self.bind(transport, layout, [kv_caches[n] for n in layout.layer_names],
                  device=device_of(kv_caches[layout.layer_names[0]]))
        try:
            self.registry.publish(AgentInfo(
                engine_id=self.cfg.engine_id, rank=self.tp_rank, agent_name=name,
                agent_metadata=transport.metadata(), backends=list(self.cfg.backends),
                generation=self.generation, layout=layout,
            ))
        except redis.RedisError as exc:
            # e.g. an ACL user without write access to the agent keys
            raise RedisAccessError(
                f"cannot publish agent metadata to Redis key "
                f"{self.keys.agent(self.cfg.engine_id, self.tp_rank)}: {exc}"
            ) from exc
        self._check_registered_peers(layout)
        logger.info(
            "kvpush worker rank %s/%s registered %s layers x %s blocks of %s bytes "
            "(layout %s, %s K/V, stride %s, %s, %s pages of %s/%s KV heads, groups %s) on "
            "%s, generation %s",
            self.tp_rank, self.tp_size, len(layout.layer_names), layout.num_blocks,
            layout.block_len, layout.cache_layout, layout.content, layout.block_stride,
            layout.dtype, layout.page,
            layout.kv_heads, layout.total_kv_heads, sorted(set(layout.layer_groups)),
            self.cfg.backends, self.generation,
        )

    def _check_registered_peers(self, layout: KVLayout) -> None:
        """Name, at startup, every engine already registered whose KV layout this one
        cannot pair with (a push between them would fail each request at pairing)."""
        if self.tp_rank != 0:
            return
        try:
            ids = [e.decode() if isinstance(e, bytes) else str(e)
                   for e in self._redis.zrange(self.keys.engines(), 0, -1)]
            ids = [e for e in ids if e != self.cfg.engine_id]
            refused = unpairable_peers(layout, self.registry, ids)
        except redis.RedisError as exc:  # e.g. an ACL user that may not list engines
            logger.debug("cannot list engines to check their KV layouts: %s", exc)
            return
        for engine_id, why in refused.items():
            logger.error("kvpush cannot pair engine %s with engine %s: %s",
                         self.cfg.engine_id, engine_id, why)

    def bind(self, transport: Transport, layout: KVLayout, layers: list[torch.Tensor],
             device: Device | None = None) -> None:
        """Hand the sender and receiver a transport registered over ``layers`` (region
        order of ``layout``) on ``device`` (the host's when not given);
        ``register_kv_caches`` does this, tests may call it alone."""
        self.transport = transport
        self.layout = layout
        self.sender.bind(transport, layout, layers, device=device)
        self.receiver.bind(transport, layout, layers, device=device)

    def _describe(self, kv_caches: dict[str, torch.Tensor]
                  ) -> tuple[KVLayout, list[tuple[int, int]]]:
        return describe_kv_caches(
            kv_caches, num_blocks=self.num_blocks, block_size=self.block_size,
            tp_rank=self.tp_rank, tp_size=self.tp_size, cache_layout=self.cache_layout,
            content=self.content, head_size=self.head_size,
            layer_groups=self.layer_groups, total_kv_heads=self.total_kv_heads)

    # -- per step ------------------------------------------------------------------------
    def on_metadata(self, meta: KVPushMetadata) -> None:
        """Take this step's instructions; runs before the forward pass."""
        self.sender.on_metadata(meta)
        self.receiver.on_metadata(meta)

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """Drain WRITEs still reading the blocks of requests vLLM just preempted."""
        self.sender.handle_preemptions(preempted)

    def save_kv_layer(self, layer_name: str) -> None:
        """Post this layer's WRITEs (forward pass hot path)."""
        self.sender.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """After the forward pass: finish the step's layer-wise writes, post catch-ups."""
        self.sender.wait_for_save()

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call."""
        sending = self.sender.take_finished() | self.receiver.take_released()
        recving, failed = self.receiver.take_results()
        return sending, recving, failed

    def failed_block_ids(self) -> set[int]:
        """Blocks of failed receives: reported through ``failed_recving`` instead."""
        return set()

    def take_stats(self) -> KVPushStats | None:
        """Finished transfers since the last call."""
        return self.observer.take()

    def has_inflight(self) -> bool:
        """True while this rank has pushes or receives in progress."""
        return bool(self.sender.jobs or self.receiver.jobs)

    def pending_ids(self) -> Iterable[str]:
        """Request ids this rank still tracks (for shutdown diagnostics)."""
        return [*self.sender.jobs, *self.receiver.jobs]

    def shutdown(self) -> None:
        """Stop heartbeats and drop peers; in-flight pushes are abandoned."""
        self.registry.close()
        if self._target_reader is not None:
            self._target_reader.close()
        if self.transport is not None:
            self.transport.close()
