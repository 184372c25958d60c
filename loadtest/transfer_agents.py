"""The two processes of the transfer microbenchmark: block layouts, NIXL agents (receiver,
sender), the methods each measures, byte checks, idle CPU."""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SENTINEL = 0xA5  # receiver fill before each checked transfer; blocks not written keep it


class TransferBenchError(RuntimeError):
    """A benchmark process failed or did not answer in time."""


class BytesMismatch(TransferBenchError):
    """Bytes on the receiver differ from what the sender wrote."""


@dataclass(frozen=True)
class BlockLayout:
    """One engine's paged KV cache as the connector registers it on CPU.

    One region per layer (vLLM's CPU backend keeps K and V of a block together), each region
    ``pool_blocks`` blocks of ``block_len`` bytes; one request covers ``request_tokens``.
    """

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int
    request_tokens: int = 512

    @property
    def block_len(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes * self.block_size

    @property
    def request_blocks(self) -> int:
        """Blocks one request occupies per layer."""
        return -(-self.request_tokens // self.block_size)

    @property
    def pool_blocks(self) -> int:
        """Blocks per region: room for a fully scattered request (every other block)."""
        return 2 * self.request_blocks

    @property
    def request_bytes(self) -> int:
        """KV bytes one request moves (every layer)."""
        return self.num_layers * self.request_blocks * self.block_len


def model_layout(model: str, block_size: int, request_tokens: int = 512) -> BlockLayout:
    """The block layout of local model ``model`` (see ``services.models``)."""
    from kvpush.services.local.models import model_spec

    spec = model_spec(model)
    return BlockLayout(
        name=f"{model}-b{block_size}",
        num_layers=spec.num_layers,
        kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype_bytes=2 if spec.dtype in ("bfloat16", "float16") else 4,
        block_size=block_size,
        request_tokens=request_tokens,
    )


def parse_layouts(text: str, request_tokens: int = 512) -> list[BlockLayout]:
    """Layouts from ``tiny-b16,kv-heavy-b32``-style names."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        model, _, bs = part.rpartition("-b")
        if not model or not bs.isdigit():
            raise ValueError(f"layout {part!r} is not <model>-b<block size>")
        out.append(model_layout(model, int(bs), request_tokens))
    return out


def block_ids(n: int, run: int, pool: int) -> tuple[list[int], list[int]]:
    """Local and remote block ids of one request: runs of ``run`` adjacent blocks with a
    one-block gap between runs (``run >= n``: contiguous; ``run == 1``: fully scattered).

    Remote runs come in reverse order so that no two consecutive ids are adjacent across a
    run boundary on either side.
    """
    if run <= 0:
        raise ValueError("run must be positive")
    runs: list[list[int]] = []
    pos = 0
    left = n
    while left > 0:
        k = min(run, left)
        runs.append(list(range(pos, pos + k)))
        pos += k + 1
        left -= k
    if pos - 1 > pool:
        raise ValueError(f"{n} blocks in runs of {run} need {pos - 1} blocks, pool has {pool}")
    local = [b for r in runs for b in r]
    # Remote: the same run structure, runs reversed (each run still ascending).
    remote = [b for r in reversed(runs) for b in r]
    return local, remote


def merged_runs(ids: list[int]) -> int:
    """How many contiguous runs ``ids`` form (in order)."""
    return 1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1) if ids else 0


def _pattern(layout: BlockLayout, region: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + region)
    return rng.integers(0, 256, size=layout.pool_blocks * layout.block_len, dtype=np.uint8)


def _contig_pattern(layout: BlockLayout, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + 999)
    return rng.integers(0, 256, size=layout.request_bytes, dtype=np.uint8)


def _kv_layout(layout: BlockLayout, regions: list[np.ndarray]) -> Any:
    from kvpush.common.wire import KVLayout

    return KVLayout(
        layer_names=[f"layers.{i}" for i in range(len(regions))],
        base_addrs=[r.ctypes.data for r in regions],
        region_len=regions[0].nbytes,
        block_len=layout.block_len,
        num_blocks=layout.pool_blocks,
        block_size=layout.block_size,
        dtype="bfloat16" if layout.dtype_bytes == 2 else "float32",
        kv_splits=1,
        tp_rank=0,
        tp_size=1,
        memory="DRAM",
    )


def _setup_agent(name: str, layout: BlockLayout, seed: int | None
                 ) -> tuple[Any, list[np.ndarray], np.ndarray, Any]:
    """A transport with a paged pool and a contiguous buffer registered (filled when
    ``seed`` is given, else with the sentinel)."""
    from kvpush.connector.nixl_transport import NixlTransport

    if seed is None:
        regions = [np.full(layout.pool_blocks * layout.block_len, SENTINEL, dtype=np.uint8)
                   for _ in range(layout.num_layers)]
        contig = np.full(layout.request_bytes, SENTINEL, dtype=np.uint8)
    else:
        regions = [_pattern(layout, r, seed) for r in range(layout.num_layers)]
        contig = _contig_pattern(layout, seed)
    transport = NixlTransport(name, ["UCX"])
    kvl = _kv_layout(layout, regions)
    transport.register(kvl, [(r.ctypes.data, r.nbytes) for r in regions])
    transport.agent.register_memory([(contig.ctypes.data, contig.nbytes, 0, "")], "DRAM",
                                    backends=transport.backends)
    return transport, regions, contig, kvl


# -- receiver process ----------------------------------------------------------------------

def run_receiver(layout: BlockLayout, conn: Any, sender_seed: int, ucx_tls: str | None) -> None:
    """Owns the destination memory; resets, verifies and idles on the sender's command."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    transport, regions, contig, kvl = _setup_agent(f"recv-{os.getpid()}", layout, None)
    conn.send(("ready", transport.metadata(), kvl, contig.ctypes.data))
    src_regions: list[np.ndarray] | None = None
    while True:
        # Poll notifications while waiting: some UCX transports need target progress.
        while not conn.poll(0.0005):
            transport.notifications()
        cmd, *args = conn.recv()
        if cmd == "reset":
            for r in regions:
                r.fill(SENTINEL)
            contig.fill(SENTINEL)
            conn.send(("ok",))
        elif cmd == "verify":
            local, remote, is_contig = args
            if src_regions is None:
                src_regions = [_pattern(layout, r, sender_seed) for r in range(layout.num_layers)]
            conn.send(("verified", *_verify(layout, regions, contig, src_regions,
                                            sender_seed, local, remote, is_contig)))
        elif cmd == "idle":
            # Nothing at all runs here: the parent reads this process's CPU time meanwhile.
            time.sleep(float(args[0]))
            conn.send(("ok",))
        elif cmd == "stop":
            conn.send(("ok",))
            transport.close()
            return


def _verify(layout: BlockLayout, regions: list[np.ndarray], contig: np.ndarray,
            src_regions: list[np.ndarray], sender_seed: int, local: list[int],
            remote: list[int], is_contig: bool) -> tuple[int, int]:
    """(bytes checked, bytes wrong) over every receiver byte: written blocks must equal the
    sender's, every other byte must still be the sentinel."""
    checked = wrong = 0
    if is_contig:
        want = _contig_pattern(layout, sender_seed)
        checked += contig.nbytes
        wrong += int(np.count_nonzero(contig != want))
        for r in regions:
            checked += r.nbytes
            wrong += int(np.count_nonzero(r != SENTINEL))
        return checked, wrong
    bl = layout.block_len
    for dst, src in zip(regions, src_regions, strict=True):
        want = np.full_like(dst, SENTINEL)
        d = want.reshape(layout.pool_blocks, bl)
        d[remote] = src.reshape(layout.pool_blocks, bl)[local]
        checked += dst.nbytes
        wrong += int(np.count_nonzero(dst != want))
    checked += contig.nbytes
    wrong += int(np.count_nonzero(contig != SENTINEL))
    return checked, wrong


# -- sender process ------------------------------------------------------------------------

@dataclass
class MethodResult:
    """One method on one (layout, fragmentation) point."""

    layout: str
    method: str
    run: int  # blocks per contiguous run (>= request blocks: contiguous)
    blocks: int
    bytes: int
    descriptors: int  # descriptors posted per request
    posts: int  # posts per request
    iters: int
    prep_us_p50: float | None  # building the transfer handle alone (descriptor work)
    post_us_p50: float  # time in post calls per request (critical path of the forward pass)
    post_us_p90: float
    total_ms_p50: float  # first post to every WRITE complete
    total_ms_p90: float
    gbps: float  # bytes / total_ms_p50
    verified_bytes: int | None = None
    wrong_bytes: int | None = None


def _ask(conn: Any, *msg: Any, timeout_s: float = 120.0) -> tuple:
    conn.send(msg)
    if not conn.poll(timeout_s):
        raise TransferBenchError(f"receiver did not answer {msg[0]!r} in {timeout_s}s")
    return conn.recv()


def _stats(layout: BlockLayout, method: str, run: int, nbytes: int, descs: int, posts: int,
           post_s: list[float], total_s: list[float],
           prep_s: list[float] | None = None) -> MethodResult:
    def q(xs: list[float], p: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, round((len(s) - 1) * p))]

    t50 = statistics.median(total_s)
    return MethodResult(
        layout=layout.name, method=method, run=run, blocks=layout.request_blocks,
        bytes=nbytes, descriptors=descs, posts=posts, iters=len(total_s),
        prep_us_p50=statistics.median(prep_s) * 1e6 if prep_s else None,
        post_us_p50=statistics.median(post_s) * 1e6, post_us_p90=q(post_s, 0.9) * 1e6,
        total_ms_p50=t50 * 1e3, total_ms_p90=q(total_s, 0.9) * 1e3,
        gbps=nbytes / t50 / 1e9 if t50 > 0 else 0.0,
    )


def run_sender(layout: BlockLayout, conn: Any, results: Any, runs: list[int], iters: int,
            seed: int, idle_s: float, ucx_tls: str | None) -> None:
    """Runs every method against the receiver and puts the results on ``results``."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    try:
        results.put(("done", _sender_main(layout, conn, results, runs, iters, seed, idle_s)))
    except Exception as exc:  # reported to the parent, which raises it
        logger.exception("transfer sender failed")
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _sender_main(layout: BlockLayout, conn: Any, results: Any, runs: list[int], iters: int,
                 seed: int, idle_s: float) -> list[dict[str, Any]]:
    import torch

    from kvpush.common.wire import AgentInfo

    transport, regions, contig, kvl = _setup_agent(f"send-{os.getpid()}", layout, seed)
    if not conn.poll(120):
        raise TransferBenchError("receiver never came up")
    _tag, meta, rkvl, r_contig_addr = conn.recv()
    peer = transport.peer(AgentInfo(engine_id="recv", rank=0, agent_name="recv",
                                    agent_metadata=meta, backends=["UCX"], generation=1,
                                    layout=rkvl))
    agent = transport.agent
    all_regions = list(range(layout.num_layers))
    far = 60_000_000_000
    out: list[MethodResult] = []

    def timed(post: Any) -> tuple[float, float, int, int]:
        t0 = time.perf_counter()
        xfers = post()
        t1 = time.perf_counter()
        transport.wait(xfers, time.monotonic_ns() + far)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, sum(x.descriptors for x in xfers), len(xfers)

    def run_method(name: str, run: int, post: Any, verify: tuple | None,
                   prep: Any = None) -> None:
        if verify is not None:
            _ask(conn, "reset")
        timed(post)  # the first request also warms the peer connection
        checked = wrong = None
        if verify is not None:
            _t, checked, wrong = _ask(conn, "verify", *verify)
            if wrong:
                logger.error("%s %s run=%s: %s of %s bytes wrong", layout.name, name, run,
                             wrong, checked)
        post_s, total_s = [], []
        for _ in range(iters):
            p, t, descs, posts = timed(post)
            post_s.append(p)
            total_s.append(t)
        prep_s = []
        for _ in range(iters if prep is not None else 0):
            t0 = time.perf_counter()
            handles = prep()
            prep_s.append(time.perf_counter() - t0)
            for h in handles:
                agent.release_xfer_handle(h)
        res = _stats(layout, name, run, layout.request_bytes, descs, posts, post_s, total_s,
                     prep_s)
        res.verified_bytes, res.wrong_bytes = checked, wrong
        out.append(res)
        logger.info("%s %-18s run=%-3s descs=%-6s post p50 %.1f us, total p50 %.3f ms, "
                    "%.2f GB/s", layout.name, name, run, res.descriptors, res.post_us_p50,
                    res.total_ms_p50, res.gbps)

    for run in runs:
        local, remote = block_ids(layout.request_blocks, run, layout.pool_blocks)
        verify = (local, remote, False)

        def layerwise(local: list[int] = local, remote: list[int] = remote) -> list:
            return [transport.write(peer, [r], local, remote) for r in all_regions]

        def one_post(local: list[int] = local, remote: list[int] = remote) -> list:
            return [transport.write(peer, all_regions, local, remote)]

        def dynamic(local: list[int] = local, remote: list[int] = remote) -> list:
            # Per request: merge contiguous runs into descriptors, build both lists, post.
            ldesc, rdesc = _merged_descs(layout, kvl, local), _merged_descs(layout, rkvl, remote)
            handle = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs(ldesc, "DRAM"),
                agent.get_xfer_descs(rdesc, "DRAM"), peer.agent_name,
                backends=transport.backends)
            return [_raw_xfer(transport, handle, peer, layout.request_bytes, len(ldesc))]

        def prep_prepped(regs: list[int], local: list[int] = local,
                         remote: list[int] = remote) -> list:
            # What NixlTransport.write does before posting: index math over the
            # descriptor lists prepared once at registration, then one handle.
            out = []
            for group in regs:
                reg = np.asarray(group, dtype=np.int64)[:, None]
                li = (reg * kvl.num_blocks + np.asarray(local)[None, :]).reshape(-1)
                ri = (reg * rkvl.num_blocks + np.asarray(remote)[None, :]).reshape(-1)
                out.append(agent.make_prepped_xfer(
                    "WRITE", transport._local_dlist, li.astype(np.int32), peer.dlist,
                    ri.astype(np.int32), b"", backends=transport.backends))
            return out

        def prep_dynamic(local: list[int] = local, remote: list[int] = remote) -> list:
            ldesc, rdesc = _merged_descs(layout, kvl, local), _merged_descs(layout, rkvl, remote)
            return [agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs(ldesc, "DRAM"),
                agent.get_xfer_descs(rdesc, "DRAM"), peer.agent_name,
                backends=transport.backends)]

        run_method("kvpush-layerwise", run, layerwise, verify,
                   lambda: prep_prepped([[r] for r in all_regions]))
        run_method("kvpush-one-post", run, one_post, verify,
                   lambda: prep_prepped([all_regions]))
        run_method("dynamic-dlist", run, dynamic, verify, prep_dynamic)

    # Raw contiguous WRITE: one descriptor of the whole request's bytes.
    lc = agent.get_xfer_descs(np.array([[contig.ctypes.data, contig.nbytes, 0]], np.int64),
                              "DRAM")
    rc = agent.get_xfer_descs(np.array([[r_contig_addr, contig.nbytes, 0]], np.int64), "DRAM")

    def raw() -> list:
        handle = agent.initialize_xfer("WRITE", lc, rc, peer.agent_name,
                                       backends=transport.backends)
        return [_raw_xfer(transport, handle, peer, contig.nbytes, 1)]

    run_method("raw-contiguous", layout.request_blocks, raw, ([], [], True))

    # Local copies of the same bytes: the ceiling for moving memory on this box.
    src_t = torch.from_numpy(contig)
    dst_t = torch.empty_like(src_t)
    post_s, total_s = [], []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        dst_t.copy_(src_t)
        total_s.append(time.perf_counter() - t0)
        post_s.append(0.0)
    out.append(_stats(layout, "memcpy-contiguous", layout.request_blocks, contig.nbytes, 0, 0,
                      post_s[1:], total_s[1:]))
    local, remote = block_ids(layout.request_blocks, 1, layout.pool_blocks)
    lt, rt = np.asarray(local), np.asarray(remote)
    srcs = [r.reshape(layout.pool_blocks, layout.block_len) for r in regions]
    dsts = [np.empty_like(s) for s in srcs]
    post_s, total_s = [], []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        # numpy fancy indexing: a block gather-scatter (torch's uint8 row gather is far slower)
        for s, d in zip(srcs, dsts, strict=True):
            d[rt] = s[lt]
        total_s.append(time.perf_counter() - t0)
        post_s.append(0.0)
    out.append(_stats(layout, "memcpy-gather", 1, layout.request_bytes, 0, 0,
                      post_s[1:], total_s[1:]))

    # Idle: no transfer in flight, nothing polling; the parent reads both CPU clocks.
    if idle_s > 0:
        conn.send(("idle", idle_s + 0.5))
        results.put(("idle", os.getpid(), idle_s))
        time.sleep(idle_s + 0.5)
        if not conn.poll(idle_s + 60):
            raise TransferBenchError("receiver did not come back from idle")
        conn.recv()
    _ask(conn, "stop")
    transport.close()
    return [asdict(r) for r in out]


def _merged_descs(layout: BlockLayout, kvl: Any, ids: list[int]) -> np.ndarray:
    """(addr, len, dev) rows, one per contiguous run of ``ids`` per region."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    rows = [(base + start * layout.block_len, n * layout.block_len, 0)
            for base in kvl.base_addrs for start, n in runs]
    return np.array(rows, dtype=np.int64)


def _raw_xfer(transport: Any, handle: Any, peer: Any, nbytes: int, descs: int) -> Any:
    from kvpush.connector.transport import Xfer, XferState

    xfer = Xfer(handle, peer, nbytes, descs, time.monotonic_ns())
    status = transport.agent.transfer(handle)
    if status == "ERR":
        transport._finish(xfer, XferState.FAILED, "post failed")
    elif status == "DONE":
        transport._finish(xfer, XferState.DONE)
    return xfer


# -- idle CPU of an agent with NIXL's own progress thread (contrast) ------------------------

def progthread_agent(ready: Any, stop: Any) -> None:
    """An agent as NIXL configures it by default: UCX backend, progress thread on."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"prog-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(1 << 20, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    ready.set()
    stop.wait(120)


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def measure_idle(pids: dict[str, int], idle_s: float) -> dict[str, dict[str, float]]:
    before = {k: _cpu_seconds(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    time.sleep(idle_s)
    wall = time.perf_counter() - t0
    out = {}
    for k, p in pids.items():
        cpu = _cpu_seconds(p) - before[k]
        out[k] = {"cpu_s": round(cpu, 4), "wall_s": round(wall, 3),
                  "cpu_pct": round(100 * cpu / wall, 2)}
    return out


# -- orchestration ---------------------------------------------------------------------------
