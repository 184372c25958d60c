"""GPU check (issue #48): layer-wise NIXL push of vLLM-layout KV caches is byte-exact and
stream-ordered.

A decode and a prefill agent, two spawned processes on one device (``cuda:0``, or DRAM with
``--device cpu``), exchange NIXL metadata and ``KVLayout`` over a pipe. Per vLLM
``KVCacheLayout`` both view one flat buffer per layer as vLLM does (FlashAttention's fused
``[K | V]`` cells); prefill's synthetic forward pass writes each layer's KV on a side
stream and posts the layer's WRITEs only once its event completed; decode checks every byte
of its buffer against prefill's pages and its own sentinel, and CRCs per (layer, block).
Needs only torch, numpy, msgspec and NIXL; the repo is imported as ``kvpush`` without
installing it. Exit 0: every layout passed; 1: a failure or the deadline; 2: bad arguments
or environment.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_conns
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# vLLM's CUDA backends: FlashAttention's default, then what FlashInfer and the packed
# allocators resolve to.
DEFAULT_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC")
DTYPES = {"bf16": ("bfloat16", "int16"), "fp8": ("float8_e4m3fn", "uint8")}
FULL = {"layers": 32, "blocks": 32, "block_size": 16, "heads": 8, "head_size": 128}
QUICK = {"layers": 4, "blocks": 3, "block_size": 16, "heads": 2, "head_size": 32}
STALE = 0x5A  # prefill's bytes before its kernels ran: a WRITE that read early carries them
SENTINEL_PERIOD = 251  # prime, so the sentinel never lines up with pages or cells
# torch.cuda._sleep cycles: ~1-2 ms per layer (well past a WRITE of one layer), and a
# much longer kernel for the negative control so a queue-time post surely reads early.
LAYER_SLEEP = 2_000_000
CONTROL_SLEEP = 200_000_000
BACKENDS = ["UCX"]
# Tests only: prefill misbehaves so the check must fail ("misplace": the last layer's WRITE
# lands next to its target blocks; "freeze": prefill stops before its notification).
FAULT = os.environ.get("KVPUSH_GPU_CHECK_FAULT", "")


# -- environment --------------------------------------------------------------------------
def use_repo() -> None:
    """Make this repo importable as ``kvpush`` (connector/ and common/ only) without
    installing it: a temp dir holding ``kvpush/{common,connector}`` symlinks, first on
    ``sys.path`` (spawned children inherit the path)."""
    for entry in sys.path:
        if (Path(entry) / "kvpush" / "connector").resolve() == REPO / "connector":
            return
    shim = Path(tempfile.mkdtemp(prefix="kvpush-gpu-check-"))
    atexit.register(shutil.rmtree, shim, True)
    (shim / "kvpush").mkdir()
    for name in ("common", "connector"):
        (shim / "kvpush" / name).symlink_to(REPO / name, target_is_directory=True)
    sys.path.insert(0, str(shim))


def load_nixl() -> str:
    """The module NIXL's API comes from, found as the connector finds it (the ``nixl``
    meta package, or ``nixl_cu13`` alone on a CUDA 13 box)."""
    use_repo()
    from kvpush.connector.nixl_transport import nixl_api
    from kvpush.connector.transport import TransportError

    try:
        return nixl_api()[0].__module__
    except TransportError as exc:
        raise ImportError(str(exc)) from exc


def layout_strides(order: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """Byte strides of the logical ``[L, B, H, N, C]`` axes (C in bytes) laid out in
    physical ``order``: vLLM's ``compute_layout_strides`` for unpadded pages, one group."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


@dataclass(frozen=True)
class Config:
    device: str
    layouts: tuple[str, ...]
    dtype: str
    layers: int
    blocks: int
    block_size: int
    heads: int
    head_size: int
    timeout: float

    @property
    def last_tokens(self) -> int:
        """Prompt tokens in the last (partial) block."""
        return max(1, self.block_size // 2 - 1)

    def tokens(self, i: int) -> int:
        return self.last_tokens if i == self.blocks - 1 else self.block_size

    @property
    def src(self) -> list[int]:
        """Prefill's blocks of the request: every other one (odd ids)."""
        return [2 * i + 1 for i in range(self.blocks)]

    @property
    def dst(self) -> list[int]:
        """Decode's blocks: even ids, descending, so none equals its source id."""
        return [2 * (self.blocks + 2 - i) for i in range(self.blocks)]

    @property
    def pools(self) -> tuple[int, int]:
        """Blocks per layer of (prefill, decode): room around the request's blocks."""
        return 2 * self.blocks + 2, 2 * self.blocks + 6


def parse_args(argv: Sequence[str] | None) -> tuple[Config, bool]:
    from kvpush.connector.page_layout import UnsupportedPage, layout_name

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
        return value

    def layouts(text: str) -> tuple[str, ...]:
        try:
            names = tuple(layout_name(n.strip().upper()) for n in text.split(",") if n.strip())
        except UnsupportedPage as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        if not names:
            raise argparse.ArgumentTypeError("no layout named")
        return tuple(dict.fromkeys(names))

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layouts", type=layouts, default=DEFAULT_LAYOUTS,
                   help="comma-separated KVCacheLayout names (default "
                   f"{','.join(DEFAULT_LAYOUTS)})")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    for name in FULL:
        p.add_argument(f"--{name.replace('_', '-')}", type=positive, default=None,
                       help=f"default {FULL[name]} ({QUICK[name]} with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a CPU run < 30 s)")
    p.add_argument("--timeout", type=float, default=240.0, help="overall deadline, seconds")
    p.add_argument("--check-args", action="store_true",
                   help="validate arguments and environment, print the plan, exit")
    a = p.parse_args(argv)
    sizes = {n: getattr(a, n) or (QUICK if a.quick else FULL)[n] for n in FULL}
    if sizes["block_size"] < 2:
        p.error("--block-size must be at least 2 (the last block must be partial)")
    if not 10 <= a.timeout <= 3600:
        p.error("--timeout must be between 10 and 3600 seconds")
    return Config(a.device, a.layouts, a.dtype, timeout=a.timeout, **sizes), a.check_args


def check_env(cfg: Config) -> tuple[list[str], list[str]]:
    """(facts, problems) about what the run needs; one line each."""
    facts, problems = [], []
    try:
        import torch

        facts.append(f"torch {torch.__version__}")
        if cfg.device == "cuda" and torch.cuda.is_available():
            facts.append(f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
        elif cfg.device == "cuda":
            problems.append("--device cuda: torch.cuda.is_available() is False "
                            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    except ImportError as exc:
        problems.append(f"torch is not importable: {exc}")
    try:
        facts.append(f"NIXL {load_nixl()}")
    except ImportError as exc:
        problems.append(f"{exc} (install the wheel: scripts/gpu-check.sh --wheels DIR)")
    try:
        importlib.import_module("kvpush.connector.nixl_transport")
        facts.append(f"kvpush from {REPO}")
    except ImportError as exc:
        problems.append(f"the repo's connector does not import: {exc}")
    return facts, problems


# -- caches -------------------------------------------------------------------------------
def build_cache(torch: Any, cfg: Config, layout: str, num_blocks: int, dev: Any
                ) -> tuple[Any, list[Any]]:
    """One flat byte buffer viewed per layer as vLLM's ``create_kv_cache_views`` does."""
    from kvpush.connector.page_layout import LAYOUTS

    dtype = getattr(torch, DTYPES[cfg.dtype][0])
    cell = 2 * cfg.head_size * torch.empty((), dtype=dtype).element_size()
    shape = (cfg.layers, num_blocks, cfg.heads, cfg.block_size, cell)
    raw = torch.empty(math.prod(shape), dtype=torch.uint8, device=dev)
    view5 = torch.as_strided(raw, shape, layout_strides(LAYOUTS[layout], shape))
    return raw, [view5[i].view(dtype) for i in range(cfg.layers)]


def describe(cfg: Config, layout: str, raw: Any, views: list[Any]) -> tuple[Any, Any]:
    """The ``KVLayout`` a connector would publish for these views, and their page."""
    from kvpush.common.wire import KVLayout
    from kvpush.connector.page_layout import geometry
    from kvpush.connector.transport import geometry_of

    v = views[0]
    item = v.element_size()
    g = geometry(layout, "fused", v.shape, v.stride(), item, cfg.head_size)
    span = item + sum((n - 1) * s * item for n, s in zip(v.shape, v.stride(), strict=True))
    cuda = raw.device.type == "cuda"
    kv = KVLayout(
        layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(cfg.layers)],
        base_addrs=[t.data_ptr() for t in views], region_len=span, block_len=g.page_bytes,
        num_blocks=v.shape[0], block_size=cfg.block_size, dtype=str(v.dtype).split(".")[-1],
        kv_splits=1, tp_rank=0, tp_size=1, memory="VRAM" if cuda else "DRAM",
        device_id=(raw.device.index or 0) if cuda else 0, block_stride=v.stride(0) * item,
        kv_heads=cfg.heads, total_kv_heads=cfg.heads, cache_layout=layout, content="fused",
        parts=g.parts, part_bytes=g.part_bytes, head_stride=g.head_stride,
        part_stride=g.part_stride, token_stride=g.token_stride)
    if geometry_of(kv) != g:  # what a peer reads back must be the page we address
        raise RuntimeError(f"{layout}: KVLayout round trip {geometry_of(kv)} != {g}")
    return kv, g


def sentinel(n: int) -> np.ndarray:
    return np.resize((np.arange(SENTINEL_PERIOD, dtype=np.uint8) * 7) ^ 0xA5, n)


def pattern(torch: Any, layer: int, first: int, count: int, heads: int, tokens: int,
            cell: int, int_dtype: Any, dev: Any) -> Any:
    """The KV a layer's kernel writes for request blocks ``first..first+count`` (their
    first ``tokens`` tokens): distinct per (layer, block, head, token, element of
    [K | V]), as raw bit patterns so no float rounding can blur a comparison."""
    def ax(n: int, at: int, start: int = 0) -> Any:
        shape = [1, 1, 1, 1]
        shape[at] = n
        return torch.arange(start, start + n, device=dev, dtype=torch.int64).view(shape)

    m = 1 << 31
    key = (layer * 4093 + ax(count, 0, first)) % m
    key = (key * 257 + ax(heads, 1)) % m
    key = (key * 1031 + ax(tokens, 2)) % m
    key = (key * 4099 + ax(cell, 3)) % m
    mixed = (key * 2654435761) % (1 << 32)
    if int_dtype == torch.int16:
        return ((mixed >> 16) - 32768).to(torch.int16)
    return (mixed >> 24).to(torch.uint8)


def layer_bases(raw: Any, views: list[Any]) -> list[int]:
    return [t.data_ptr() - raw.data_ptr() for t in views]


def source_pages(cfg: Config, host: np.ndarray, g: Any, bases: list[int], stride: int,
                 blocks: Sequence[int], layers: Sequence[int]) -> tuple[list, list]:
    """Per layer: the pages of ``blocks`` in canonical byte order, and per block the CRC
    of its prompt tokens."""
    from kvpush.connector.page_layout import byte_index

    whole = byte_index(g)
    pages, crcs = [], []
    for layer in layers:
        origins = [bases[layer] + b * stride for b in blocks]
        pages.append(np.stack([host[o + whole] for o in origins]))
        crcs.append([zlib.crc32(host[o + byte_index(g, tokens=(0, cfg.tokens(i)))].tobytes())
                     for i, o in enumerate(origins)])
    return pages, crcs


def verify_bytes(cfg: Config, got: np.ndarray, expect_rest: np.ndarray, g: Any,
                 bases: list[int], stride: int, dst: Sequence[int], pages: list,
                 crcs: list) -> tuple[list[str], int]:
    """Problems found in decode's buffer ``got`` (modified: each target page is reset to
    ``expect_rest``, after which the whole buffer must equal it), and CRCs that matched."""
    from kvpush.connector.page_layout import byte_index

    problems: list[str] = []
    whole = byte_index(g)
    crc_ok = 0
    for layer, base in enumerate(bases):
        for i, b in enumerate(dst):
            pos = base + b * stride + whole
            mine = zlib.crc32(got[base + b * stride + byte_index(
                g, tokens=(0, cfg.tokens(i)))].tobytes())
            if mine == crcs[layer][i]:
                crc_ok += 1
            else:
                problems.append(f"layer {layer} block {i} (decode {b}): CRC {mine:08x} != "
                                f"prefill's {crcs[layer][i]:08x}")
            bad = int(np.count_nonzero(got[pos] != pages[layer][i]))
            if bad:
                problems.append(f"layer {layer} block {i} (decode {b}): {bad} of "
                                f"{pos.size} bytes differ from prefill's source page")
            got[pos] = expect_rest[pos]
    outside = np.flatnonzero(got != expect_rest)
    if outside.size:
        problems.append(f"{outside.size} bytes outside the target pages changed (first at "
                        f"buffer offset {outside[0]})")
    return problems, crc_ok


# -- the two agents -----------------------------------------------------------------------
class Deadline:
    def __init__(self, at: float) -> None:
        self.at = at

    def left(self) -> float:
        return self.at - time.time()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise TimeoutError(f"deadline passed {what}")

    def recv(self, conn: Connection, what: str) -> Any:
        if not conn.poll(max(self.left(), 0)):
            raise TimeoutError(f"no {what} before the deadline")
        return conn.recv()


class Agent:
    """What both processes share: the device, its streams and one NIXL agent per layout."""

    def __init__(self, role: str, cfg: Config, deadline: Deadline) -> None:
        use_repo()
        load_nixl()
        import torch

        from kvpush.connector import device as kv_device

        self.torch, self.role, self.cfg, self.deadline = torch, role, cfg, deadline
        self.dev = torch.device("cuda:0" if cfg.device == "cuda" else "cpu")
        self.cuda = cfg.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(0)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.device_of = kv_device.device_of
        self.int_dtype = getattr(torch, DTYPES[cfg.dtype][1])
        self.transports: list[Any] = []  # kept alive: torn down with the process

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def open(self, layout: str, num_blocks: int, fill: Any) -> tuple[Any, list, Any, Any, Any]:
        from kvpush.connector.nixl_transport import NixlTransport

        raw, views = build_cache(self.torch, self.cfg, layout, num_blocks, self.dev)
        fill(raw)
        self.sync()
        kv, g = describe(self.cfg, layout, raw, views)
        transport = NixlTransport(f"{self.role}-{layout}", BACKENDS)
        transport.register(kv, [(raw.data_ptr(), raw.numel())])
        self.transports.append(transport)
        return raw, views, kv, g, transport

    def kernel(self, views: list, layer: int, full: Any, last: int, sleep: int) -> None:
        """One layer's KV write into blocks ``full`` (a device index) and the partial
        block ``last``, queued on the current stream. Nothing here may wait for the device
        (a host-to-device copy would), or the CPU could not run ahead of the kernels."""
        torch, cfg = self.torch, self.cfg
        if self.cuda and sleep:
            torch.cuda._sleep(sleep)
        cache = views[layer].view(self.int_dtype)
        cell = cache.shape[-1]
        if cfg.blocks > 1:
            cache.index_copy_(0, full, pattern(torch, layer, 0, cfg.blocks - 1, cfg.heads,
                                               cfg.block_size, cell, self.int_dtype, self.dev))
        cache[last:last + 1, :, :cfg.last_tokens].copy_(pattern(
            torch, layer, cfg.blocks - 1, 1, cfg.heads, cfg.last_tokens, cell,
            self.int_dtype, self.dev))

    def on_stream(self) -> Any:
        return self.torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()


def prefill_layout(a: Agent, conn: Connection, layout: str, control: bool) -> dict:
    from kvpush.common.wire import AgentInfo, decode
    from kvpush.connector.page_layout import pair
    from kvpush.connector.transport import XferState, geometry_of

    cfg, torch = a.cfg, a.torch
    raw, views, kv, g, transport = a.open(layout, cfg.pools[0], lambda r: r.fill_(STALE))
    _tag, _name, blob = a.deadline.recv(conn, f"{layout} agent metadata from decode")
    info = decode(blob, AgentInfo)
    local, remote = pair(g, geometry_of(info.layout))
    peer = transport.peer(info, local, remote)
    transport.notify(peer, b"warmup")  # connection setup stays out of the timings
    device = a.device_of(raw)
    deadline_ns = int(a.deadline.at * 1e9 - time.time() * 1e9 + time.monotonic_ns())
    full = torch.tensor(cfg.src[:-1], dtype=torch.int64, device=a.dev)
    a.sync()
    pending: deque = deque()
    xfers: list = []
    waited = 0
    t0 = time.monotonic_ns()
    last_compute = 0

    def post(layer: int) -> None:
        dst = cfg.dst
        if FAULT == "misplace" and layer == cfg.layers - 1:
            dst = [b + 1 for b in dst]  # next to the targets: outside them
        xfers.append(transport.write(peer, [layer], cfg.src, dst))

    def pump() -> None:
        nonlocal last_compute, waited
        while pending and pending[0][1].ready():
            layer = pending.popleft()[0]
            if layer == cfg.layers - 1:
                last_compute = time.monotonic_ns()
            post(layer)
        if pending and not pending[0][2]:
            pending[0][2] = True  # counted once: its event was still running when polled
            waited += 1
        for x in xfers:
            if transport.poll(x) is XferState.FAILED:
                raise RuntimeError(f"{layout}: WRITE failed: {x.error}")

    for layer in range(cfg.layers):
        with a.on_stream():
            a.kernel(views, layer, full, cfg.src[-1], LAYER_SLEEP)
            pending.append([layer, device.record(), False])
        pump()
    while pending or any(x.state is XferState.IN_PROGRESS for x in xfers):
        a.deadline.check(f"with {len(pending)} layers unposted on {layout}")
        if time.monotonic_ns() > deadline_ns:
            raise TimeoutError(f"{layout}: WRITEs still in flight at the deadline")
        pump()
        time.sleep(20e-6)  # short: completion times are only as fine as this polling
    if FAULT == "freeze":
        time.sleep(3600)  # a peer that stops answering: decode's deadline must end it
    transport.notify(peer, f"done {layout}".encode())
    a.sync()
    bases, stride = layer_bases(raw, views), kv.block_stride
    pages, crcs = source_pages(cfg, raw.cpu().numpy(), g, bases, stride, cfg.src,
                               range(cfg.layers))
    conn.send(("source", layout, pages, crcs))
    spans = sorted((x.posted_ns, x.done_ns) for x in xfers)
    busy = before = 0
    end = 0
    for s, e in spans:  # union of in-flight intervals, and its part before compute ended
        s = max(s, end)
        if e > s:
            busy += e - s
            before += max(0, min(e, last_compute) - s)
            end = e
    stats = {"bytes": sum(x.nbytes for x in xfers), "writes": len(xfers), "busy_ns": busy,
             "before_ns": before, "waited": waited, "first_post_ms": (spans[0][0] - t0) / 1e6,
             "last_compute_ms": (last_compute - t0) / 1e6,
             "last_done_ms": (max(e for _s, e in spans) - t0) / 1e6}
    if control:
        a.deadline.recv(conn, "decode's go for the negative control")
        raw.fill_(STALE)
        a.sync()
        with a.on_stream():
            a.kernel(views, 0, full, cfg.src[-1], CONTROL_SLEEP)
        # Posted at queue time, ignoring the event: what the ordering prevents.
        transport.wait([transport.write(peer, [0], cfg.src, cfg.dst)], deadline_ns)
        a.sync()
        transport.notify(peer, f"control {layout}".encode())
        pages, _ = source_pages(cfg, raw.cpu().numpy(), g, bases, stride, cfg.src, [0])
        conn.send(("control-source", layout, pages[0]))
    return stats


def await_notif(a: Agent, transport: Any, want: bytes) -> None:
    pause = 50e-6
    while True:
        if any(msg == want for _agent, msg in transport.notifications()):
            return
        a.deadline.check(f"waiting for notification {want.decode()!r}")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


def decode_layout(a: Agent, conn: Connection, layout: str, control: bool) -> dict:
    from kvpush.common.wire import AgentInfo, encode

    cfg, torch = a.cfg, a.torch
    held: dict = {}

    def fill(r: Any) -> None:
        held["rest"] = sentinel(r.numel())
        r.copy_(torch.from_numpy(held["rest"]).to(r.device))

    raw, views, kv, g, transport = a.open(layout, cfg.pools[1], fill)
    rest = held["rest"]
    info = AgentInfo(engine_id="decode", rank=0, agent_name=transport.name,
                     agent_metadata=transport.metadata(), backends=BACKENDS, generation=1,
                     layout=kv)
    conn.send(("agent", layout, encode(info)))
    await_notif(a, transport, f"done {layout}".encode())
    a.device_of(raw).make_visible()
    got = raw.to("cpu", copy=True).numpy()  # a copy: verification overwrites it
    _tag, _name, pages, crcs = a.deadline.recv(conn, f"{layout} source pages from prefill")
    bases, stride = layer_bases(raw, views), kv.block_stride
    problems, crc_ok = verify_bytes(cfg, got, rest, g, bases, stride, cfg.dst, pages, crcs)
    # Prefill's pages could be its stale fill on both sides: the prompt tokens must hold
    # exactly what the kernel computed.
    wrong = 0
    for layer in range(cfg.layers):
        cache = views[layer].view(a.int_dtype)
        for i, b in enumerate(cfg.dst):
            n = cfg.tokens(i)
            want = pattern(torch, layer, i, 1, cfg.heads, n, cache.shape[-1], a.int_dtype,
                           a.dev)
            wrong += int((cache[b:b + 1, :, :n] != want).sum())
    if wrong:
        problems.append(f"{wrong} K/V elements of prompt tokens differ from the kernel's")
    out = {"problems": problems, "crc_ok": crc_ok, "crcs": cfg.layers * cfg.blocks}
    if control:
        conn.send(("go",))
        await_notif(a, transport, f"control {layout}".encode())
        a.sync()
        _tag, _name, src = a.deadline.recv(conn, "negative control source from prefill")
        got, _ = source_pages(cfg, raw.cpu().numpy(), g, bases, stride, cfg.dst, [0])
        out["control"] = (int(np.count_nonzero(got[0] != src)), int(src.size))
    return out


def child(role: str, cfg_fields: dict, peer: Connection, parent: Connection,
          deadline_at: float) -> None:
    """Entry of a spawned agent: reports to the parent, never raises."""
    cfg = Config(**cfg_fields)
    try:
        a = Agent(role, cfg, Deadline(deadline_at))
        if role == "decode":
            name = a.torch.cuda.get_device_name(0) if a.cuda else "host DRAM"
            parent.send(("hello", f"{a.dev} ({name}), torch {a.torch.__version__}, "
                                  f"{sys.modules['nixl._api'].__name__}"))
        for n, layout in enumerate(cfg.layouts):
            control = a.cuda and n == 0
            if role == "decode":
                parent.send(("verdict", layout, decode_layout(a, peer, layout, control)))
            else:
                parent.send(("stats", layout, prefill_layout(a, peer, layout, control)))
        if role == "decode":
            peer.send(("bye",))
        else:  # stay until decode has read everything (an exiting peer drops its UCX link)
            a.deadline.recv(peer, "decode's bye")
        parent.send(("finished", role))
    except TimeoutError as exc:  # a peer went quiet: where it stopped is the whole story
        with contextlib.suppress(Exception):
            parent.send(("error", role, f"{exc}"))
    except BaseException:
        with contextlib.suppress(Exception):
            parent.send(("error", role, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # NIXL/UCX teardown can wait on a peer that is already gone: nothing left to keep.
        os._exit(0)


# -- orchestration ------------------------------------------------------------------------
def report(cfg: Config, layout: str, stats: dict, verdict: dict) -> bool:
    problems = list(verdict["problems"])
    if cfg.device == "cuda" and not stats["waited"]:
        problems.append("no layer's event was still running when first polled: the CPU "
                        "never ran ahead of the kernels, so the ordering was not exercised")
    ok = not problems
    busy = stats["busy_ns"] or 1
    size = stats["bytes"]
    size_text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    print(f"{layout:6} {'ok' if ok else 'FAIL'}  {size_text} in "
          f"{stats['writes']} WRITEs, {size / busy:.3g} GB/s, overlap "
          f"{100 * stats['before_ns'] / busy:.0f}% (first post {stats['first_post_ms']:.1f} "
          f"ms, last compute {stats['last_compute_ms']:.1f} ms, last done "
          f"{stats['last_done_ms']:.1f} ms; {stats['waited']}/{cfg.layers} layers waited "
          f"for their event); CRCs {verdict['crc_ok']}/{verdict['crcs']}", flush=True)
    for problem in problems[:8]:
        print(f"       {problem}")
    if len(problems) > 8:
        print(f"       ... {len(problems) - 8} more problems")
    if "control" in verdict:
        stale, total = verdict["control"]
        print("       negative control (layer 0 posted at queue time, slow kernel): "
              + (f"{stale} of {total} bytes stale: the event is what prevents this"
                 if stale else f"no stale bytes in {total} (the copy waited anyway)"))
    return ok


def run(cfg: Config) -> int:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    peers = ctx.Pipe()
    conns, procs = {}, []
    start = time.time()
    for role, peer in zip(("decode", "prefill"), peers, strict=True):
        mine, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=child, name=f"gpu-check-{role}", daemon=True,
                                 args=(role, asdict(cfg), peer, theirs,
                                       start + cfg.timeout - 5)))
        procs[-1].start()
        theirs.close()
        conns[mine] = role
    got: dict = {"stats": {}, "verdict": {}}
    finished: set = set()
    failures: list[str] = []
    passed = 0
    try:
        while len(finished) < 2 and not failures:
            left = start + cfg.timeout - time.time()
            if left <= 0:
                failures.append(f"timed out after {cfg.timeout:.0f} s")
            for conn in wait_conns(list(conns), timeout=max(left, 0)):
                try:
                    kind, *msg = conn.recv()
                except EOFError:
                    failures.append(f"the {conns.pop(conn)} process died")
                    continue
                if kind == "hello":
                    print(f"gpu-check: {msg[0]}; {cfg.dtype}, {cfg.layers} layers, "
                          f"{cfg.blocks} blocks of {cfg.block_size} (the last holding "
                          f"{cfg.last_tokens}), {cfg.heads} KV heads x {cfg.head_size}")
                elif kind == "error":
                    text = msg[1].rstrip()
                    sep = "\n" if "\n" in text else " "
                    failures.append(f"{msg[0]} failed:{sep}{text}")
                elif kind == "finished":
                    finished.add(msg[0])
                else:
                    got[kind][msg[0]] = msg[1]
                    if all(msg[0] in got[k] for k in got):
                        passed += report(cfg, msg[0], got["stats"][msg[0]],
                                         got["verdict"][msg[0]])
    finally:
        for proc in procs:
            proc.join(2 if failures else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    for failure in failures:
        print(f"gpu-check: {failure}")
    what = "byte-exact and stream-ordered" if cfg.device == "cuda" else "byte-exact"
    verdict = "PASS" if passed == len(cfg.layouts) and not failures else "FAIL"
    print(f"gpu-check: {verdict}: {passed}/{len(cfg.layouts)} layouts {what} on "
          f"{cfg.device} ({','.join(cfg.layouts)}; {cfg.dtype}) in {time.time() - start:.1f} s")
    return 0 if verdict == "PASS" else 1


def main(argv: Sequence[str] | None = None) -> int:
    use_repo()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows per layout, piped or not
    # NIXL logs every agent and backend at INFO on stdout; spawned children inherit this.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    cfg, check_only = parse_args(argv)
    facts, problems = check_env(cfg)
    for problem in problems:
        print(f"gpu-check: {problem}", file=sys.stderr)
    if problems:
        return 2
    plan = (f"would run on {cfg.device}: layouts {','.join(cfg.layouts)}, {cfg.dtype}, "
            f"{cfg.layers} layers x {cfg.blocks} blocks of {cfg.block_size} tokens, "
            f"{cfg.heads} heads x {cfg.head_size}, timeout {cfg.timeout:.0f} s")
    if check_only:
        print(f"gpu-check: {'; '.join(facts)}")
        print(f"gpu-check: {plan}")
        return 0
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
