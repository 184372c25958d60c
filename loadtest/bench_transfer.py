"""Transfer microbenchmark: kvpush's NIXL push path vs raw NIXL WRITE vs memcpy, two processes.

The serving benchmark (``loadtest/bench.py``) says how the whole system behaves; this one
isolates the data path. On the KV block layouts of the local models it measures, between two
NIXL agents in separate processes (UCX):

* ``kvpush-layerwise``: ``connector.nixl_transport.NixlTransport.write`` exactly as the
  connector's ``save_kv_layer`` calls it, one post per layer region over prepared descriptor
  lists, block ids as given (contiguous or fragmented);
* ``kvpush-one-post``: the same transport, every region in one post (the connector's
  catch-up path);
* ``dynamic-dlist``: an emulation of a per-request descriptor build (merge contiguous runs,
  ``get_xfer_descs`` + ``initialize_xfer`` every request), the shape of cost the anchors
  report for upstream when KV memory fragments;
* ``raw-contiguous``: one NIXL WRITE of one contiguous region of the same byte count;
* ``memcpy-contiguous`` / ``memcpy-gather``: a local torch copy of the same bytes, flat or
  block-gathered.

Every NIXL method is checked byte for byte on the receiver once per (layout, pattern). The
last part measures the CPU an idle agent burns: kvpush's (progress thread off) and, for
contrast, one with NIXL's default progress thread.

Run: ``python -m loadtest.bench_transfer --out out/transfer`` or ``kvpush bench transfer``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
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

def _receiver(layout: BlockLayout, conn: Any, sender_seed: int, ucx_tls: str | None) -> None:
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


def _sender(layout: BlockLayout, conn: Any, results: Any, runs: list[int], iters: int,
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

def _progthread_agent(ready: Any, stop: Any) -> None:
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


def _measure_idle(pids: dict[str, int], idle_s: float) -> dict[str, dict[str, float]]:
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

@dataclass
class TransferReport:
    """Everything one microbenchmark run produced."""

    meta: dict[str, Any]
    results: list[dict[str, Any]] = field(default_factory=list)
    idle: dict[str, dict[str, float]] = field(default_factory=dict)


def default_runs(layout: BlockLayout) -> list[int]:
    """Contiguous, runs of 8 and 2 blocks, fully scattered."""
    n = layout.request_blocks
    return sorted({n, min(8, n), min(2, n), 1}, reverse=True)


def run_layout(layout: BlockLayout, iters: int | None = None, runs: list[int] | None = None,
               idle_s: float = 0.0, seed: int = 7, ucx_tls: str | None = None,
               timeout_s: float = 600.0) -> tuple[list[dict[str, Any]], dict]:
    """Benchmark one layout in a fresh receiver/sender pair; returns (results, idle CPU)."""
    ctx = mp.get_context("spawn")
    if iters is None:
        # About 256 MiB moved per method, at least 5 and at most 200 repetitions.
        iters = max(5, min(200, (256 << 20) // max(1, layout.request_bytes)))
    runs = runs or default_runs(layout)
    a, b = ctx.Pipe()
    results = ctx.Queue()
    recv = ctx.Process(target=_receiver, args=(layout, a, seed, ucx_tls), daemon=True)
    send = ctx.Process(target=_sender,
                       args=(layout, b, results, runs, iters, seed, idle_s, ucx_tls),
                       daemon=True)
    recv.start()
    send.start()
    idle: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferBenchError(f"{layout.name}: no result in {timeout_s}s")
            try:
                kind, *payload = results.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: check the processes are still alive
                if not send.is_alive():
                    raise TransferBenchError(
                        f"{layout.name}: sender exited with {send.exitcode}") from None
                continue
            if kind == "idle":
                pid, secs = payload
                idle = _measure_idle({"kvpush-sender": pid, "kvpush-receiver": recv.pid}, secs)
            elif kind == "error":
                raise TransferBenchError(f"{layout.name}: {payload[0]}")
            else:
                return payload[0], idle
    finally:
        for p in (send, recv):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def progthread_idle(idle_s: float) -> dict[str, float]:
    """Idle CPU of an agent with NIXL's default progress thread (UCX, memory registered)."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_progthread_agent, args=(ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(120):
            raise TransferBenchError("progress-thread agent did not start")
        time.sleep(0.5)
        return _measure_idle({"nixl-default": proc.pid}, idle_s)["nixl-default"]
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def run_transfer_bench(layouts: list[BlockLayout], out_dir: Path | None = None,
                       iters: int | None = None, idle_s: float = 3.0,
                       progthread_contrast: bool = True, ucx_tls: str | None = None,
                       ) -> TransferReport:
    """Run every layout (idle CPU measured after the first), write reports to ``out_dir``."""
    report = TransferReport(meta={
        "layouts": [asdict(layout) | {"block_len": layout.block_len,
                                      "request_blocks": layout.request_blocks,
                                      "request_bytes": layout.request_bytes}
                    for layout in layouts],
        "iters": iters, "idle_s": idle_s, "ucx_tls": ucx_tls or os.environ.get("UCX_TLS"),
        "cpus": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })
    for i, layout in enumerate(layouts):
        logger.info("transfer bench: layout %s (%s bytes per request, %s blocks)",
                    layout.name, layout.request_bytes, layout.request_blocks)
        res, idle = run_layout(layout, iters=iters, idle_s=idle_s if i == 0 else 0.0,
                               ucx_tls=ucx_tls)
        report.results.extend(res)
        report.idle.update(idle)
    if progthread_contrast and idle_s > 0:
        report.idle["nixl-default-progress-thread"] = progthread_idle(idle_s)
    bad = [r for r in report.results if r.get("wrong_bytes")]
    if out_dir is not None:
        write_transfer_report(report, out_dir)
    if bad:
        raise BytesMismatch(f"{len(bad)} method(s) left wrong bytes on the receiver: "
                            + ", ".join(f"{r['layout']}/{r['method']}/run{r['run']}"
                                        for r in bad))
    return report


def markdown(report: TransferReport) -> str:
    """Tables: every method per layout and pattern, then idle CPU."""
    lines = [
        "| layout | method | run | descs/req | posts/req | prep µs p50 | post µs p50 "
        "| post µs p90 | total ms p50 | GB/s | verified bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        run = "contig" if r["run"] >= r["blocks"] else str(r["run"])
        ver = "—" if r["verified_bytes"] is None else (
            f"{r['verified_bytes']} ok" if not r["wrong_bytes"]
            else f"{r['wrong_bytes']} WRONG of {r['verified_bytes']}")
        lines.append(
            f"| {r['layout']} | {r['method']} | {run} | {r['descriptors']} | {r['posts']} "
            f"| {'—' if r['prep_us_p50'] is None else format(r['prep_us_p50'], '.1f')} "
            f"| {r['post_us_p50']:.1f} | {r['post_us_p90']:.1f} | {r['total_ms_p50']:.3f} "
            f"| {r['gbps']:.2f} | {ver} |")
    lines += ["", "| idle process | CPU s | wall s | CPU % of one core |", "|---|---|---|---|"]
    for name, v in report.idle.items():
        lines.append(f"| {name} | {v['cpu_s']:.4f} | {v['wall_s']:.2f} | {v['cpu_pct']:.2f} |")
    return "\n".join(lines) + "\n"


def write_transfer_report(report: TransferReport, out_dir: Path) -> list[Path]:
    """``transfer.json``, ``transfer.md`` and two PNGs (post cost vs run, GB/s)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "transfer.json", out_dir / "transfer.md"]
    paths[0].write_text(json.dumps(asdict(report), indent=2))
    paths[1].write_text("# kvpush transfer microbenchmark\n\n```\n"
                        + json.dumps(report.meta, indent=2) + "\n```\n\n" + markdown(report))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in report.results})
    fig, axes = plt.subplots(1, max(1, len(layouts)), figsize=(5 * max(1, len(layouts)), 4),
                             squeeze=False)
    for ax, name in zip(axes[0], layouts, strict=False):
        for method in ("kvpush-layerwise", "kvpush-one-post", "dynamic-dlist"):
            rows = sorted((r for r in report.results
                           if r["layout"] == name and r["method"] == method),
                          key=lambda r: -r["run"])
            if rows:
                xs = [merged_runs(block_ids(r["blocks"], r["run"], 2 * r["blocks"])[0])
                      for r in rows]
                line = ax.plot(xs, [r["prep_us_p50"] or 0 for r in rows], marker="o",
                               label=f"{method} prep")[0]
                ax.plot(xs, [r["post_us_p50"] for r in rows], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{method} post")
        ax.set_title(f"{name}: per-request cost vs fragmentation")
        ax.set_xlabel("contiguous runs per request (1 = contiguous)")
        ax.set_ylabel("µs per request (p50)")
        ax.set_xscale("log")
        ax.set_yscale("log")  # prep is µs, post (which moves the data) is ms
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "transfer_post_cost.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "transfer_post_cost.png")

    rows = [r for r in report.results if r["run"] >= r["blocks"] or r["method"] == "memcpy-gather"]
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["gbps"] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{r['layout']}\n{r['method']}" for r in rows],
                  fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("GB/s (p50, contiguous ids)")
    fig.tight_layout()
    fig.savefig(out_dir / "transfer_gbps.png", dpi=90)
    plt.close(fig)
    paths.append(out_dir / "transfer_gbps.png")
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the transfer microbenchmark (shared with ``kvpush bench transfer``)."""
    g = p.add_argument_group("transfer microbenchmark")
    g.add_argument("--layouts", default="tiny-b16,tiny-b32,kv-heavy-b16,kv-heavy-b32",
                   help="<model>-b<block size>, comma separated")
    g.add_argument("--request-tokens", type=int, default=512, help="tokens per request")
    g.add_argument("--iters", type=int, default=None,
                   help="repetitions per method (default: about 256 MiB moved)")
    g.add_argument("--idle-s", type=float, default=3.0,
                   help="seconds of idle CPU measurement (0: skip)")
    g.add_argument("--no-progthread-contrast", action="store_true",
                   help="skip the idle agent with NIXL's default progress thread")
    g.add_argument("--ucx-tls", default=None, help="UCX_TLS for both agents (default: UCX's)")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush bench transfer`` and ``python -m loadtest.bench_transfer``."""
    layouts = parse_layouts(args.layouts, args.request_tokens)
    out = Path(args.out) if args.out else None
    report = run_transfer_bench(layouts, out, iters=args.iters, idle_s=args.idle_s,
                                progthread_contrast=not args.no_progthread_contrast,
                                ucx_tls=args.ucx_tls)
    print(markdown(report))
    if out is not None:
        print(f"report written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/transfer", help="report directory ('' for none)")
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
