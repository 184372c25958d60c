"""Agent host processes of ``tests/test_kv_layouts_nixl.py``: vLLM's real KV cache views,
one NIXL agent (UCX, DRAM) per engine rank, a real Redis registry, driven over a pipe.

A host is a long-lived process that plays any engine rank the test asks for: ``setup``
builds one rank's cache exactly as vLLM 0.32 does (``compute_layout_strides``,
``KVCacheTensor``, ``create_kv_cache_views`` over one flat int8 buffer), fills it (prefill:
a byte pattern derived from each byte's logical coordinates; decode: a sentinel),
describes it with ``describe_kv_caches``, registers it with a fresh ``NixlTransport`` and
publishes the agent. ``push`` does what the Sender does for a target (``peers_for``, one
WRITE per layer, request and decode rank, the wait, PushDone with the checksums of the
head slice written); ``collect`` waits for PushDones and returns decode's whole backing
buffer. Every wait has a deadline. ``host_main`` imports torch, vLLM and the connector
once and forks the sibling hosts from there, so the module pays those imports once.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any

SENTINEL = 0xA5
BACKENDS = ["UCX"]


@dataclass(frozen=True)
class CacheSpec:
    """One engine's KV cache: vLLM layout, how the backend reads the content, dtype."""

    layout: str  # a vLLM KVCacheLayout member name
    content: str  # "fused" (GPU backends), "split" (CPU attention), "latent" (MLA)
    dtype: str = "bfloat16"
    block_size: int = 8
    total_heads: int = 4  # the model's KV heads (an MLA latent: one, on every rank)
    head_size: int = 8
    layers: int = 3

    @property
    def latent(self) -> bool:
        return self.content == "latent"

    def name(self) -> str:
        return f"{self.layout}/{self.content}/{self.dtype}"

    def vllm_spec(self, tp_size: int) -> Any:
        """vLLM's KV cache spec of one rank of a TP ``tp_size`` engine."""
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        dtype = getattr(torch, self.dtype)
        if self.latent:
            return MLAAttentionSpec(block_size=self.block_size, num_kv_heads=1,
                                    head_size=self.head_size, dtype=dtype)
        return FullAttentionSpec(block_size=self.block_size,
                                 num_kv_heads=self.total_heads // tp_size,
                                 head_size=self.head_size, dtype=dtype)


def layer_names(spec: CacheSpec) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(spec.layers)]


def build_cache(spec: CacheSpec, tp_size: int, num_blocks: int, raw: Any = None
                ) -> tuple[Any, list[Any]]:
    """(flat int8 backing buffer, per-layer ``[B, H, N, C]`` views of the spec's dtype),
    placed as vLLM's ``get_kv_cache_config_from_groups`` and ``create_kv_cache_views``
    place one KV cache group; over ``raw`` (int8, the right size) when given."""
    import torch
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kv_spec = spec.vllm_spec(tp_size)
    layout = KVCacheLayout[spec.layout]
    names = layer_names(spec)
    layer_stride, block_stride, *_ = compute_layout_strides(kv_spec, num_blocks,
                                                            len(names), layout)
    size = len(names) * num_blocks * kv_spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    if raw is None:
        raw = torch.empty(size, dtype=torch.int8)
    assert raw.numel() == size, (raw.numel(), size)
    return raw, create_kv_cache_views(raw, kv_spec, num_blocks, layout, tensor)


def byte_views(views: list[Any]) -> list[Any]:
    """The same views with one uint8 element per byte (``[B, H, N, C bytes]``)."""
    import torch

    return [v.view(torch.uint8) for v in views]


def fill_pattern(views: list[Any], spec: CacheSpec, rank: int) -> None:
    """Give every byte of every (layer, block, model KV head, token, content byte) a value
    derived from those coordinates (never the sentinel). Heads are the model's: rank
    ``rank`` holds heads ``rank * H ..``; an MLA latent is the same on every rank."""
    import torch

    for layer, view in enumerate(byte_views(views)):
        blocks, heads, tokens, width = view.shape
        b = torch.arange(blocks, dtype=torch.int64).view(-1, 1, 1, 1)
        h = torch.arange(heads, dtype=torch.int64).view(1, -1, 1, 1)
        g = h * 0 if spec.latent else h + rank * heads
        n = torch.arange(tokens, dtype=torch.int64).view(1, 1, -1, 1)
        x = torch.arange(width, dtype=torch.int64).view(1, 1, 1, -1)
        key = ((((layer * 7919 + b) * 7907 + g) * 7901 + n) * 7883 + x) & 0xFFFFFFFF
        mixed = ((key * 2654435761) & 0xFFFFFFFF) >> 8
        val = mixed % 255
        val = val + (val >= SENTINEL).to(torch.int64)  # 0..255 without the sentinel
        view.copy_(val.to(torch.uint8))


def crc_of(raw: Any) -> int:
    return zlib.crc32(raw.numpy().tobytes())


# -- the host process ----------------------------------------------------------------------
@dataclass
class Rank:
    """One engine rank hosted here."""

    engine: str
    rank: int
    spec: CacheSpec
    raw: Any
    views: list[Any]
    layout: Any
    transport: Any
    registry: Any


@dataclass
class Host:
    ranks: dict[tuple[str, int], Rank] = field(default_factory=dict)
    # Backing buffers of torn-down ranks: kept alive until exit, so no memory an agent
    # may still have registered is ever reused.
    graveyard: list[Any] = field(default_factory=list)
    clients: dict[str, Any] = field(default_factory=dict)
    conn: Any = None  # to the test process: a command waiting there ends a collect

    def client(self, url: str) -> Any:
        import redis

        if url not in self.clients:
            self.clients[url] = redis.Redis.from_url(url)
        return self.clients[url]


def _setup(host: Host, *, role: str, engine: str, rank: int, tp_size: int, spec: CacheSpec,
           num_blocks: int, generation: int, redis_url: str) -> dict[str, Any]:
    from kvpush.common.keys import RedisKeys
    from kvpush.common.wire import AgentInfo, encode
    from kvpush.connector.nixl_transport import NixlTransport
    from kvpush.connector.registry import AgentRegistry
    from kvpush.connector.worker_side import describe_kv_caches

    raw, views = build_cache(spec, tp_size, num_blocks)
    if role == "prefill":
        fill_pattern(views, spec, rank)
    else:
        raw.view(-1).fill_(SENTINEL - 256)  # int8
    names = layer_names(spec)
    layout, ranges = describe_kv_caches(
        dict(zip(names, views, strict=True)), num_blocks=num_blocks,
        block_size=spec.block_size, tp_rank=rank, tp_size=tp_size,
        cache_layout=spec.layout, content=spec.content,
        head_size=0 if spec.latent else spec.head_size,
        total_kv_heads=1 if spec.latent else spec.total_heads)
    name = f"{engine}-r{rank}-{generation}"
    transport = NixlTransport(name, BACKENDS)
    transport.register(layout, ranges)
    registry = AgentRegistry(host.client(redis_url), RedisKeys(), ttl_s=30)
    registry.publish(AgentInfo(engine_id=engine, rank=rank, agent_name=name,
                               agent_metadata=transport.metadata(), backends=BACKENDS,
                               generation=generation, layout=layout))
    host.ranks[(engine, rank)] = Rank(engine, rank, spec, raw, views, layout, transport,
                                      registry)
    return {"layout": encode(layout), "crc": crc_of(raw), "agent": name}


def _target(rid: str, decode_engine: str, decode_generation: int, dblocks: list[int],
            num_tokens: int, deadline_s: float) -> Any:
    from kvpush.common.wire import now_ms
    from kvpush.connector.metadata import SendTarget

    return SendTarget(rid=rid, decode_engine=decode_engine,
                      decode_generation=decode_generation, block_ids=[list(dblocks)],
                      skip_blocks=[0], num_tokens=num_tokens,
                      deadline_ms=now_ms() + int(deadline_s * 1000))


def _push(host: Host, *, engine: str, rank: int, decode_engine: str, decode_generation: int,
          requests: list[tuple[str, list[int], list[int], int]], layers: list[int],
          deadline_s: float) -> list[list[dict[str, Any]]]:
    """What the Sender does for each request: pick the decode ranks and byte runs
    (``peers_for``), post one WRITE per layer and decode rank, wait for all of them,
    then PushDone to each decode rank with the checksums of the heads it got."""
    from kvpush.common.wire import PushDone, encode
    from kvpush.connector import integrity
    from kvpush.connector.targets import peers_for
    from kvpush.connector.transport import geometry_of, page_runs

    r = host.ranks[(engine, rank)]
    jobs = []
    for rid, pblocks, dblocks, num_tokens in requests:
        target = _target(rid, decode_engine, decode_generation, dblocks, num_tokens,
                         deadline_s)
        jobs.append((rid, pblocks, dblocks, num_tokens,
                     peers_for(target, r.layout, r.registry, r.transport,
                               r.layout.block_size)))
    xfers = []
    for layer in layers:  # layer by layer, as save_kv_layer posts them
        for _rid, pblocks, dblocks, _n, peers in jobs:
            for peer, _heads in peers:
                xfers.append(r.transport.write(peer, [layer], pblocks, dblocks))
    r.transport.wait(xfers, time.monotonic_ns() + int(deadline_s * 1e9))
    geometry = geometry_of(r.layout)
    groups = [0] * len(r.layout.layer_names)
    out = []
    for rid, pblocks, _dblocks, num_tokens, peers in jobs:
        sent = []
        for peer, heads in peers:
            sums = integrity.checksums(r.views, groups, [pblocks], [0], num_tokens, geometry,
                                       (heads.first, heads.count))
            r.transport.notify(peer, encode(PushDone(
                request_id=rid, num_tokens=num_tokens, checksums=sums,
                tp_size=r.layout.tp_size)))
            sent.append({"decode_rank": peer.rank, "agent": peer.agent_name,
                         "heads": (heads.first, heads.count),
                         "runs": len(page_runs(r.layout, peer.local)),
                         "remote_runs": len(page_runs(peer.layout, peer.remote)),
                         "descriptors": sum(x.descriptors for x in xfers if x.peer is peer),
                         "nbytes": sum(x.nbytes for x in xfers if x.peer is peer)})
        out.append(sent)
    r.transport.notifications()  # progress: push the notifications out
    return out


def _collect(host: Host, *, engine: str, rank: int, expect: list[tuple[str, str]],
             deadline_s: float) -> dict[str, Any]:
    """Wait for a PushDone of each (request id, sender agent) in ``expect`` (progressing
    NIXL meanwhile), then return every one received and the whole backing buffer."""
    from kvpush.common.wire import PushDone, decode

    r = host.ranks[(engine, rank)]
    want = set(expect)
    got: dict[tuple[str, str], bytes] = {}
    deadline = time.monotonic() + deadline_s
    while True:
        for agent, msg in r.transport.notifications():
            got[(decode(msg, PushDone).request_id, agent)] = msg
        if want <= got.keys():
            break
        if host.conn is not None and host.conn.poll():
            raise RuntimeError(f"{engine} rank {rank}: collect given up for the next "
                               f"command, no PushDone for {sorted(want - got.keys())}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{engine} rank {rank}: no PushDone for "
                               f"{sorted(want - got.keys())} in {deadline_s} s")
        time.sleep(0.0005)
    return {"raw": r.raw.numpy().tobytes(), "notes": got}


def _refusals(host: Host, *, engine: str, rank: int, decode_engine: str,
              decode_generation: int, num_tokens: int, dblocks: list[int]
              ) -> dict[str, tuple[str, str] | None]:
    """How ``peers_for`` and ``transport.peer`` answer a decode engine's layout:
    None when accepted, else (exception type, message)."""
    from kvpush.connector.targets import peers_for

    r = host.ranks[(engine, rank)]
    out: dict[str, tuple[str, str] | None] = {}
    target = _target("refused", decode_engine, decode_generation, dblocks, num_tokens, 10)
    try:
        peers_for(target, r.layout, r.registry, r.transport, r.layout.block_size)
        out["peers_for"] = None
    except Exception as exc:
        out["peers_for"] = (type(exc).__name__, str(exc))
    info = r.registry.fetch(decode_engine, 0, decode_generation)
    try:
        r.transport.peer(info)
        out["peer"] = None
    except Exception as exc:
        out["peer"] = (type(exc).__name__, str(exc))
    return out


def _teardown(host: Host) -> int:
    n = len(host.ranks)
    for r in host.ranks.values():
        r.registry.close()
        r.transport.close()
        host.graveyard.append(r.raw)
    host.ranks.clear()  # each agent goes with its last reference (no gc pass: 0.3 s)
    return n


HANDLERS = {"setup": _setup, "push": _push, "collect": _collect, "refusals": _refusals,
            "teardown": _teardown}


def host_main(conns: list[Any], env: dict[str, str]) -> None:
    """Import torch, vLLM and the connector once, then fork one sibling host per further
    connection in ``conns`` (before any thread, NIXL agent or Redis connection exists),
    and serve ``conns[0]``: the imports are paid once for every host."""
    os.environ.update(env)
    import torch  # noqa: F401  (paid once for every host)
    import vllm.v1.kv_cache_interface  # noqa: F401

    import kvpush.connector.nixl_transport
    import kvpush.connector.targets
    import kvpush.connector.worker_side  # noqa: F401

    children = []
    for conn in conns[1:]:
        pid = os.fork()
        if pid == 0:
            for other in conns:
                if other is not conn:
                    other.close()
            _serve(conn, [])
        children.append(pid)
    for conn in conns[1:]:
        conn.close()
    _serve(conns[0], children)


def _serve(conn: Any, children: list[int]) -> None:
    """Answer (command, kwargs) from ``conn`` with ("ok", result) or ("err", message,
    traceback) until "exit" or the test process goes away; then reap ``children``."""
    host = Host(conn=conn)
    conn.send(("ok", os.getpid()))
    while True:
        try:
            if not conn.poll(900):
                break  # the test process is stuck
            cmd, kwargs = conn.recv()
        except (EOFError, OSError):
            break  # the test process is gone
        if cmd == "exit":
            break
        try:
            conn.send(("ok", HANDLERS[cmd](host, **kwargs)))
        except Exception as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    try:
        _teardown(host)
        deadline = time.monotonic() + 10
        while children and time.monotonic() < deadline:
            children = [c for c in children if os.waitpid(c, os.WNOHANG)[0] == 0]
            time.sleep(0.01)
        for c in children:
            os.kill(c, signal.SIGKILL)
            os.waitpid(c, 0)
    finally:
        # A peer already gone can make a graceful UCX teardown wait: leave at once.
        os._exit(0)
