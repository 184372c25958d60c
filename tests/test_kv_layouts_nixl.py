"""Every vLLM 0.32 KV cache layout pushed byte-exact through real NIXL agents (issue #48).

What this file proves, with real NIXL agents (UCX, DRAM) in separate processes, a real
Redis registry and vLLM's own cache views (``compute_layout_strides``, ``KVCacheTensor``,
``create_kv_cache_views``, as a vLLM worker allocates them):

- every ``KVCacheLayout`` member (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC) with fused
  K/V content (FlashAttention's, FlashInfer's, ROCm's cell) in bf16 and fp8
  (``float8_e4m3fn``); LBHNC and BLHNC with split content (vLLM's CPU attention); an MLA
  latent (head size 576, ``MLAAttentionSpec``) in LBNHC and BLHNC, bf16 and fp8; and
  prefill LBNHC into decode LBHNC (a cross-layout pairing, more descriptors);
- under TP 1->1, 2->1 (two prefill ranks write head slices into one decode rank) and
  1->2 (one prefill rank writes into two decode ranks), the decode ranks and byte runs
  picked by ``peers_for`` exactly as the Sender picks them, one ``write()`` per layer;
- a full prompt and a partial last block, prefill block ids mapped to other decode ids:
  after every wave of writes (one layer, then the rest; or one prefill rank, then the
  other) decode's whole backing buffer equals prefill's bytes exactly where the push owns
  them and the sentinel everywhere else. The owned bytes come from vLLM's views, not from
  ``connector/page_layout.py``: a uint8 mask buffer viewed as vLLM views the cache, set
  to 1 at ``mask[layer][block, heads]`` (so a packed block-outermost block owns only the
  written layers' parts);
- ``integrity.checksums`` of prefill (its blocks, its head slice, sent in PushDone) equal
  decode's (its blocks, the matching head slice), and ``first_mismatch`` finds one byte
  flipped in K, in V, in the partial last block's last prompt token and in one prefill
  rank's head slice under TP 2->1, but not a flip past the prompt's last token;
- pairings that cannot be mapped are refused naming both layouts: an MLA latent against
  per-head K/V, different block sizes, and a cross-layout pairing that needs more than
  ``page_layout.MAX_RUNS_PER_BLOCK`` descriptors per block.

It boots its own agent hosts (``tests/layout_agents.py``) once for the module, and runs
every case through them over pipes: three processes (one spawned, which imports torch,
vLLM and the connector once and then forks the other two), each playing whichever engine
rank a case needs with a fresh agent per case. It cannot share an engine stack: it needs
no vLLM engine, only agents over vLLM's view of each layout, which no stack runs (a stack
has one layout). About 15 s here (the hosts' start is 5 to 7 s of it), so not ``slow``.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tests.layout_agents import SENTINEL, CacheSpec, build_cache, byte_views, fill_pattern

# vLLM 0.32's KVCacheLayout members (test_layouts_are_vllms checks the list).
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
BF16, FP8 = "bfloat16", "float8_e4m3fn"  # fp8: one byte per element
SHORT = {BF16: "bf16", FP8: "fp8"}
PRE_BLOCKS, DEC_BLOCKS = 8, 10
HOSTS = 3
DEADLINE_S = 30.0
ANSWER_S = 60.0
TP = {"tp1-1": (1, 1), "tp2-1": (2, 1), "tp1-2": (1, 2)}


@dataclass(frozen=True)
class Request:
    """One pushed prompt: prefill's block ids, decode's, and its tokens past whole
    blocks (0: a full prompt)."""

    name: str
    pblocks: tuple[int, ...]
    dblocks: tuple[int, ...]
    tail: int

    def tokens(self, block_size: int) -> int:
        return (len(self.pblocks) - (1 if self.tail else 0)) * block_size + self.tail


# Decode block 0 is vLLM's null block: never a target. Blocks 0, 1, 3, 6, 8 stay untouched.
FULL = Request("full", (3, 6), (7, 2), 0)
PARTIAL = Request("partial", (1, 5, 4), (9, 4, 5), 3)
REQUESTS = (FULL, PARTIAL)


@dataclass(frozen=True)
class Case:
    id: str
    prefill: CacheSpec
    decode: CacheSpec


def _cases() -> list[Case]:
    out = [Case(f"fused-{lay}-{SHORT[dt]}", *[CacheSpec(lay, "fused", dt)] * 2)
           for lay in LAYOUTS for dt in (BF16, FP8)]
    out += [Case(f"split-{lay}-{SHORT[dt]}", *[CacheSpec(lay, "split", dt)] * 2)
            for lay in ("LBHNC", "BLHNC") for dt in (BF16, FP8)]
    out += [Case(f"mla-{lay}-{SHORT[dt]}",
                 *[CacheSpec(lay, "latent", dt, total_heads=1, head_size=576)] * 2)
            for lay in ("LBNHC", "BLHNC") for dt in (BF16, FP8)]
    out.append(Case("cross-LBNHC-into-LBHNC", CacheSpec("LBNHC", "fused", BF16),
                    CacheSpec("LBHNC", "fused", BF16)))
    return out


CASES = _cases()
_generations = itertools.count(1)


# -- the agent hosts -------------------------------------------------------------------------
class HostError(AssertionError):
    """An agent host answered a command with an exception."""


class Pool:
    """Agent host processes, each answering commands over its own pipe: one spawned
    process that imports torch, vLLM and the connector, then forks the others."""

    def __init__(self) -> None:
        from tests.layout_agents import host_main

        ctx = mp.get_context("spawn")
        env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        pipes = [ctx.Pipe() for _ in range(HOSTS)]
        self.conns = [parent for parent, _child in pipes]
        self.proc = ctx.Process(target=host_main,
                                args=([child for _parent, child in pipes], env), daemon=True)
        self.proc.start()
        for _parent, child in pipes:
            child.close()
        self.broken: str | None = None
        self.pending: list[list[str]] = [["start"] for _ in range(HOSTS)]
        # Meanwhile, on the other core: what the checks here need.
        import vllm.v1.kv_cache_interface  # noqa: F401

        import kvpush.connector.integrity
        import kvpush.connector.worker_side  # noqa: F401

        self.pids = [self.recv(i, "start", 120) for i in range(HOSTS)]

    def send(self, host: int, cmd: str, **kwargs: Any) -> None:
        if self.broken:
            pytest.fail(f"agent hosts unusable: {self.broken}")
        self.conns[host].send((cmd, kwargs))
        self.pending[host].append(cmd)

    def recv(self, host: int, cmd: str, timeout: float = ANSWER_S) -> Any:
        """The answer to the oldest command ``host`` has not answered (``cmd``)."""
        assert self.pending[host] and self.pending[host][0] == cmd, (host, cmd, self.pending)
        conn = self.conns[host]
        if not conn.poll(timeout):
            self.broken = f"host {host} did not answer {cmd} within {timeout} s"
            pytest.fail(self.broken)
        self.pending[host].pop(0)
        reply = conn.recv()
        if reply[0] == "err":
            raise HostError(f"host {host} {cmd}: {reply[1]}\n{reply[2]}")
        return reply[1]

    def settle_one(self, host: int) -> None:
        """Take the answer to a command a failed check left unread (a collect still
        waiting gives up as soon as the next command arrives)."""
        with contextlib.suppress(HostError):
            self.recv(host, self.pending[host][0])

    def call(self, host: int, cmd: str, timeout: float = ANSWER_S, **kwargs: Any) -> Any:
        self.send(host, cmd, **kwargs)
        return self.recv(host, cmd, timeout)

    def close(self) -> None:
        # The forked hosts first: the spawned one reaps them as it exits.
        for conn in reversed(self.conns):
            with contextlib.suppress(OSError):
                conn.send(("exit", {}))
        self.proc.join(20)
        if self.proc.is_alive():
            for pid in getattr(self, "pids", [])[1:]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def pool() -> Any:
    hosts = Pool()
    yield hosts
    hosts.close()


# -- one push, checked -----------------------------------------------------------------------
@dataclass
class Side:
    """One engine of a case: its spec, TP size, blocks and ranks' hosts."""

    engine: str
    spec: CacheSpec
    tp: int
    hosts: list[int]
    num_blocks: int
    layouts: list[Any] = field(default_factory=list)  # published, by rank
    agents: list[str] = field(default_factory=list)  # NIXL agent names, by rank
    crcs: list[int] = field(default_factory=list)  # of each rank's buffer after setup

    def heads(self) -> int:
        """KV heads in one rank's page."""
        return 1 if self.spec.latent else self.spec.total_heads // self.tp


def _writer(dec: Side, pre: Side, d: int, h: int) -> tuple[int, int]:
    """(prefill rank, its local head) whose bytes decode rank ``d``'s head ``h`` holds:
    heads are the model's, split evenly over each engine's ranks; an MLA latent is the
    same on every rank and each decode rank takes it from prefill rank ``d % P``."""
    if dec.spec.latent:
        return d % pre.tp, 0
    g = d * dec.heads() + h
    return g // pre.heads(), g % pre.heads()


def _setup(pool: Pool, redis_url: str, pre: Side, dec: Side, generation: int) -> None:
    sends = [(host, "decode", dec, r) for r, host in enumerate(dec.hosts)]
    sends += [(host, "prefill", pre, r) for r, host in enumerate(pre.hosts)]
    for host, role, side, r in sends:
        pool.send(host, "setup", role=role, engine=side.engine, rank=r, tp_size=side.tp,
                  spec=side.spec, num_blocks=side.num_blocks, generation=generation,
                  redis_url=redis_url)
    from kvpush.common.wire import KVLayout, decode

    for host, _role, side, _r in sends:
        out = pool.recv(host, "setup")
        side.layouts.append(decode(out["layout"], KVLayout))
        side.agents.append(out["agent"])
        side.crcs.append(out["crc"])


def _teardown(pool: Pool, pre: Side, dec: Side) -> None:
    # Prefill first: it drops its peers before decode's agents go away.
    for hosts in (pre.hosts, [h for h in dec.hosts if h not in pre.hosts]):
        for host in hosts:
            pool.send(host, "teardown")
        for host in hosts:
            while pool.pending[host][0] != "teardown":
                pool.settle_one(host)
            pool.recv(host, "teardown")


def _views(side: Side, rank: int, data: bytes | None = None) -> tuple[Any, list[Any]]:
    """(int8 buffer, vLLM's views) of one rank's cache over a copy of ``data``."""
    import torch

    raw = None if data is None else torch.frombuffer(bytearray(data), dtype=torch.int8)
    return build_cache(side.spec, side.tp, side.num_blocks, raw)


def _prefill_bytes(pre: Side) -> list[list[Any]]:
    """Each prefill rank's byte views, rebuilt here (checked against the host's CRC)."""
    from tests.layout_agents import crc_of

    out = []
    for p in range(pre.tp):
        raw, views = _views(pre, p)
        fill_pattern(views, pre.spec, p)
        assert crc_of(raw) == pre.crcs[p], f"prefill rank {p}'s pattern differs"
        out.append(byte_views(views))
    return out


def _expected(pre: Side, dec: Side, d: int, pre_bytes: list[list[Any]],
              writes: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(decode rank ``d``'s whole buffer as it must be after ``writes``: (prefill ranks,
    layers) that pushed, the mask of owned bytes, the owned byte count), all from vLLM's
    views of both caches."""
    raw_exp, views_exp = _views(dec, d)
    raw_exp.fill_(SENTINEL - 256)
    raw_mask, views_mask = _views(dec, d)
    raw_mask.zero_()
    exp, mask = byte_views(views_exp), byte_views(views_mask)
    owned = 0
    for ranks, layers in writes:
        for req in REQUESTS:
            for pb, db in zip(req.pblocks, req.dblocks, strict=True):
                for layer in layers:
                    for h in range(dec.heads()):
                        p, ph = _writer(dec, pre, d, h)
                        if p not in ranks:
                            continue
                        exp[layer][db, h].copy_(pre_bytes[p][layer][pb, ph])
                        mask[layer][db, h] = 1
                        owned += mask[layer][db, h].numel()
    return (raw_exp.numpy().view(np.uint8).copy(),
            raw_mask.numpy().view(np.uint8).astype(bool), owned)


def _check_bytes(what: str, got: bytes, want: np.ndarray, mask: np.ndarray, owned: int
                 ) -> None:
    arr = np.frombuffer(got, dtype=np.uint8)
    assert arr.shape == want.shape
    assert int(mask.sum()) == owned, f"{what}: mask covers {mask.sum()} bytes, {owned} owned"
    inside = np.flatnonzero((arr != want) & mask)
    outside = np.flatnonzero((arr != SENTINEL) & ~mask)
    assert not len(inside), (f"{what}: {len(inside)} of {owned} owned bytes differ from "
                             f"prefill's, first at offset {inside[:8].tolist()}")
    assert not len(outside), (f"{what}: {len(outside)} bytes outside the push changed, "
                              f"first at offset {outside[:8].tolist()}")


def _run_waves(pool: Pool, pre: Side, dec: Side, gen: int, waves: list[tuple[list[int], list[int]]]
               ) -> tuple[dict[int, bytes], dict[int, dict[tuple[str, str], bytes]], list[Any]]:
    """Push ``waves`` (prefill ranks, layers) one after the other, checking decode's
    bytes after each; returns decode's final buffers, every PushDone each decode rank
    got (by request id and sender agent) and the pushes' replies."""
    from kvpush.connector import tp_mapping

    pre_bytes = _prefill_bytes(pre)
    mla = pre.spec.latent
    notes: dict[int, dict[tuple[str, str], bytes]] = {d: {} for d in range(dec.tp)}
    final: dict[int, bytes] = {}
    replies = []
    for w, (ranks, layers) in enumerate(waves):
        expect: dict[int, list[tuple[str, str]]] = {}
        for d in range(dec.tp):
            for p in ranks:
                if p in tp_mapping.writers_of(d, pre.tp, dec.tp, pre.spec.total_heads, mla):
                    expect.setdefault(d, []).extend(
                        (f"{req.name}-w{w}", pre.agents[p]) for req in REQUESTS)
        for d, pairs in expect.items():
            pool.send(dec.hosts[d], "collect", engine=dec.engine, rank=d, expect=pairs,
                      deadline_s=DEADLINE_S)
        for p in ranks:
            pool.send(pre.hosts[p], "push", engine=pre.engine, rank=p,
                      decode_engine=dec.engine, decode_generation=gen,
                      requests=[(f"{r.name}-w{w}", list(r.pblocks), list(r.dblocks),
                                 r.tokens(pre.spec.block_size)) for r in REQUESTS],
                      layers=layers, deadline_s=DEADLINE_S)
        for p in ranks:
            sent = pool.recv(pre.hosts[p], "push")
            replies.append((p, sent))
            # peers_for picked exactly the decode ranks that hold heads of this rank.
            want = sorted({d for d in range(dec.tp) for h in range(dec.heads())
                           if _writer(dec, pre, d, h)[0] == p})
            for per_request in sent:
                assert sorted(s["decode_rank"] for s in per_request) == want, (p, sent)
        for d in range(dec.tp):
            if d in expect:
                out = pool.recv(dec.hosts[d], "collect")
            else:  # nothing expected: the snapshot after every push returned
                out = pool.call(dec.hosts[d], "collect", engine=dec.engine, rank=d,
                                expect=[], deadline_s=DEADLINE_S)
            assert set(out["notes"]) == set(expect.get(d, [])), (d, sorted(out["notes"]))
            notes[d].update(out["notes"])
            want, mask, owned = _expected(pre, dec, d, pre_bytes, waves[:w + 1])
            _check_bytes(f"decode rank {d} after wave {w} (prefill ranks {ranks}, layers "
                         f"{layers})", out["raw"], want, mask, owned)
            final[d] = out["raw"]
    return final, notes, replies


def _flip(dec: Side, data: bytes, layer: int, block: int, head: int, token: int, part: int,
          last: bool = False) -> bytes:
    """``data`` with one byte flipped: of K (``part`` 0) or V (1) of ``token`` of
    ``head`` in ``block`` of ``layer`` (its first byte, or its last), located through
    vLLM's view and the backend's reading of a head's content (an MLA latent: the
    latent's first or last byte)."""
    import torch

    buf = bytearray(data)
    raw = torch.frombuffer(buf, dtype=torch.int8)
    _raw, views = build_cache(dec.spec, dec.tp, dec.num_blocks, raw)
    page = byte_views(views)[layer][block, head]  # [N, C bytes] of one head
    width = page.shape[-1]
    if dec.spec.latent:
        cell = page[token]
    elif dec.spec.content == "split":
        # CPU attention re-views one head's N x C bytes as [K/V][N][C / 2].
        flat = page.reshape(-1)
        assert flat.data_ptr() == page.data_ptr() and page.is_contiguous()
        cell = flat.view(2, page.shape[0], width // 2)[part, token]
    else:  # fused: each (head, token) cell is [K | V]
        k = dec.spec.head_size * views[0].element_size()
        cell = page[token, :k] if part == 0 else page[token, k:]
    byte = cell[-1] if last else cell[0]
    buf[byte.storage_offset()] ^= 0xFF
    return bytes(buf)


def _decode_sums(dec: Side, d: int, data: bytes, req: Request, heads: tuple[int, int]) -> Any:
    """Decode rank ``d``'s checksums of ``req`` over ``data`` (its whole buffer), of
    heads ``heads`` of its pages: what the Receiver computes on PushDone."""
    from kvpush.connector import integrity
    from kvpush.connector.transport import geometry_of

    _raw, views = _views(dec, d, data)
    return integrity.checksums(views, [0] * dec.spec.layers, [list(req.dblocks)], [0],
                               req.tokens(dec.spec.block_size), geometry_of(dec.layouts[d]),
                               heads)


Sent = dict[int, tuple[tuple[int, int], dict[str, Any]]]


def _sent_to(pre: Side, dec: Side, d: int, notes: dict[tuple[str, str], bytes],
             last_wave: dict[int, int]) -> Sent:
    """prefill rank -> (decode rank ``d``'s heads it wrote, {request: the checksums its
    last PushDone carried}), for every prefill rank that writes into ``d``."""
    from kvpush.common.wire import PushDone, decode
    from kvpush.connector import tp_mapping

    sent: Sent = {}
    for p in range(pre.tp):
        for w in tp_mapping.writes_of(p, pre.tp, dec.tp, pre.spec.total_heads,
                                      pre.spec.latent):
            if w.decode_rank != d:
                continue
            by_req = {}
            for req in REQUESTS:
                msg = decode(notes[(f"{req.name}-w{last_wave[p]}", pre.agents[p])], PushDone)
                assert msg.checksums is not None and msg.tp_size == pre.tp
                by_req[req.name] = msg.checksums
            sent[p] = ((w.remote.first, w.remote.count), by_req)
    return sent


def _found(dec: Side, d: int, sent: Sent, data: bytes, req: Request) -> dict[int, Any]:
    """What ``first_mismatch`` reports for each prefill rank writing into ``d``."""
    from kvpush.connector import integrity

    return {p: integrity.first_mismatch(by_req[req.name],
                                        _decode_sums(dec, d, data, req, heads))
            for p, (heads, by_req) in sent.items()}


def _check_checksums(pre: Side, dec: Side, d: int, data: bytes, sent: Sent) -> None:
    """Prefill's checksums (PushDone) equal decode rank ``d``'s over each head slice
    written, and one flipped byte is found where it matters and only there."""
    from kvpush.connector import integrity

    bs = pre.spec.block_size
    last_layer = dec.spec.layers - 1
    assert sent, f"no prefill rank writes decode rank {d}"
    for p, (heads, by_req) in sent.items():
        for req in REQUESTS:
            want = by_req[req.name]
            got = _decode_sums(dec, d, data, req, heads)
            assert [len(row) for row in want.crcs] == [len(req.dblocks)] * dec.spec.layers
            assert integrity.first_mismatch(want, got) is None, (d, p, req.name)
            assert want.crcs == got.crcs and want.num_tokens == req.tokens(bs)
    p0, (heads0, _) = min(sent.items())
    h = heads0[0]  # the first head the lowest writer wrote into this rank
    others = {p: None for p in sent if p != p0}
    tokens = PARTIAL.tokens(bs)
    last_block = len(PARTIAL.dblocks) - 1
    flips = [  # (what, request, layer, request block, token, part, last byte, found)
        ("K", PARTIAL, 1, 0, 1, 0, False, (1, 0)),
        ("V", PARTIAL, last_layer, 1, bs - 1, 1, True, (last_layer, 1)),
        ("last prompt token", PARTIAL, 0, last_block, (tokens - 1) % bs, 1, True,
         (0, last_block)),
        ("past the prompt, K", PARTIAL, 0, last_block, tokens % bs, 0, False, None),
        ("past the prompt, V", PARTIAL, last_layer, last_block, bs - 1, 1, True, None),
        ("full prompt's last token", FULL, last_layer, len(FULL.dblocks) - 1, bs - 1, 0,
         True, (last_layer, len(FULL.dblocks) - 1)),
    ]
    for what, req, layer, i, token, part, last, where in flips:
        flipped = _flip(dec, data, layer, req.dblocks[i], h, token, part, last)
        assert _found(dec, d, sent, flipped, req) == {p0: where, **others}, (what, d)
        # The other request's blocks are not this one's: it still verifies.
        other = PARTIAL if req is FULL else FULL
        assert set(_found(dec, d, sent, flipped, other).values()) == {None}, (what, d)
    if len(sent) > 1:
        # One byte in the other prefill rank's head slice: only its checksums report it.
        hl = dec.heads() - 1
        p1 = _writer(dec, pre, d, hl)[0]
        assert p1 != p0
        flipped = _flip(dec, data, 1, PARTIAL.dblocks[1], hl, 2, 1, False)
        assert _found(dec, d, sent, flipped, PARTIAL) == {p0: None, p1: (1, 1)}


def _waves(tp: tuple[int, int], layers: int) -> list[tuple[list[int], list[int]]]:
    """(prefill ranks, layers) pushed one after the other."""
    if tp[0] == 2:
        return [([0], list(range(layers))), ([1], list(range(layers)))]
    return [([0], [0]), ([0], list(range(1, layers)))]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("tp", list(TP), ids=list(TP))
def test_push_is_byte_exact_for_every_layout(pool: Pool, redis_url: str, tp: str,
                                             case: Case) -> None:
    prefill_tp, decode_tp = TP[tp]
    gen = next(_generations)
    # Hosts: prefill rank p on host p, decode rank 0 on host 2 and rank 1 on host 1.
    pre = Side(f"pre{gen}", case.prefill, prefill_tp, [0, 1][:prefill_tp], PRE_BLOCKS)
    dec = Side(f"dec{gen}", case.decode, decode_tp, [2, 1][:decode_tp], DEC_BLOCKS)
    try:
        _setup(pool, redis_url, pre, dec, gen)
        for side in (pre, dec):
            assert all((lay.cache_layout, lay.content) == (side.spec.layout, side.spec.content)
                       for lay in side.layouts), side.layouts
        waves = _waves(TP[tp], case.prefill.layers)
        final, notes, replies = _run_waves(pool, pre, dec, gen, waves)
        last_wave = {p: max(w for w, (ranks, _l) in enumerate(waves) if p in ranks)
                     for p in range(prefill_tp)}
        for d in range(decode_tp):
            _check_checksums(pre, dec, d, final[d],
                             _sent_to(pre, dec, d, notes[d], last_wave))
        if case.prefill.layout != case.decode.layout:
            # Token-major into head-major: one descriptor per (token, head) of a page.
            runs = {s["runs"] for _p, sent in replies for per in sent for s in per}
            assert runs and min(runs) > 1, runs
    finally:
        if not pool.broken:
            _teardown(pool, pre, dec)


# -- refusals ---------------------------------------------------------------------------------
REFUSALS = {
    "latent-vs-heads": (CacheSpec("LBNHC", "latent", BF16, total_heads=1, head_size=576),
                        CacheSpec("LBHNC", "fused", BF16), "page latent != heads"),
    "block-sizes": (CacheSpec("BLHNC", "fused", BF16, block_size=8),
                    CacheSpec("LBNHC", "fused", BF16, block_size=16), "block_size 8 != 16"),
    "too-many-runs": (CacheSpec("LBNHC", "fused", BF16, block_size=16, total_heads=8),
                      CacheSpec("LBHNC", "fused", BF16, block_size=16, total_heads=8),
                      "descriptors per block"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_unmappable_pairings_are_refused_naming_both_layouts(pool: Pool, redis_url: str,
                                                             name: str) -> None:
    from kvpush.connector import page_layout

    pspec, dspec, why = REFUSALS[name]
    if name == "too-many-runs":
        assert pspec.block_size * pspec.total_heads > page_layout.MAX_RUNS_PER_BLOCK
    gen = next(_generations)
    pre = Side(f"pre{gen}", pspec, 1, [0], PRE_BLOCKS)
    dec = Side(f"dec{gen}", dspec, 1, [2], DEC_BLOCKS)
    try:
        _setup(pool, redis_url, pre, dec, gen)
        tokens = 2 * dspec.block_size + 3
        out = pool.call(0, "refusals", engine=pre.engine, rank=0, decode_engine=dec.engine,
                        decode_generation=gen, num_tokens=tokens, dblocks=[9, 4, 5])
        names = (f"{pspec.layout}/{pspec.content}", f"{dspec.layout}/{dspec.content}")
        kind, msg = out["peers_for"] or ("accepted", "")
        assert kind == "LayoutMismatch", out
        assert names[0] in msg and names[1] in msg and why in msg, msg
        # The transport's own check, for a peer asked for whole pages.
        kind, msg = out["peer"] or ("accepted", "")
        assert kind == "LayoutMismatch" and all(n in msg for n in names), out
        # Nothing was written.
        snap = pool.call(2, "collect", engine=dec.engine, rank=0, expect=[],
                         deadline_s=DEADLINE_S)
        assert set(np.frombuffer(snap["raw"], dtype=np.uint8).tolist()) == {SENTINEL}
    finally:
        if not pool.broken:
            _teardown(pool, pre, dec)


def test_layouts_are_vllms_and_split_needs_head_major_pages() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvpush.connector.worker_side import UnsupportedLayout, describe_kv_caches
    from tests.layout_agents import layer_names

    assert tuple(m.name for m in KVCacheLayout) == LAYOUTS
    # CPU attention reads a head's tokens as one run: a token-major page cannot hold it.
    for lay in ("LBNHC", "BLNHC"):
        spec = CacheSpec(lay, "split", BF16)
        _raw, views = build_cache(spec, 1, 4)
        with pytest.raises(UnsupportedLayout, match=lay):
            describe_kv_caches(dict(zip(layer_names(spec), views, strict=True)),
                               num_blocks=4, block_size=spec.block_size, tp_rank=0,
                               tp_size=1, cache_layout=lay, content="split",
                               head_size=spec.head_size)
