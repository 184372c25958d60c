"""Real NIXL agents in separate processes: block-exact WRITEs via the Redis registry, deadlines."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import AgentInfo, KVLayout, PushDone, decode, encode

# Shape of one layer of vLLM's CPU KV cache: [num_blocks, kv_heads, block_size, 2 * head].
LAYERS, HEADS, BLOCK, HEAD2 = 3, 2, 16, 64
DEC_BLOCKS, PRE_BLOCKS = 40, 24
BLOCK_LEN = HEADS * BLOCK * HEAD2 * 4  # float32


def _kv(num_blocks: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((num_blocks, HEADS, BLOCK, HEAD2), dtype=np.float32)
            for _ in range(LAYERS)]


def _layout(kv: list[np.ndarray], rank: int = 0) -> KVLayout:
    return KVLayout(
        layer_names=[f"layers.{i}" for i in range(len(kv))],
        base_addrs=[a.ctypes.data for a in kv],
        region_len=kv[0].nbytes,
        block_len=kv[0][0].nbytes,
        num_blocks=kv[0].shape[0],
        block_size=BLOCK,
        dtype="float32",
        kv_splits=1,
        tp_rank=rank,
        tp_size=1,
        memory="DRAM",
    )


def _setup(name: str, engine: str, kv: list[np.ndarray], redis_url: str,
           generation: int) -> tuple[Any, Any]:
    from kvpush.connector.nixl_transport import NixlTransport
    from kvpush.connector.registry import AgentRegistry

    transport = NixlTransport(name, ["UCX"])
    layout = _layout(kv)
    transport.register(layout, [(a.ctypes.data, a.nbytes) for a in kv])
    registry = AgentRegistry(redis.Redis.from_url(redis_url), RedisKeys(), ttl_s=30)
    registry.publish(AgentInfo(engine_id=engine, rank=0, agent_name=name,
                               agent_metadata=transport.metadata(), backends=["UCX"],
                               generation=generation, layout=layout))
    return transport, registry


def decode_proc(redis_url: str, ready: Any, result: Any, ucx_tls: str | None) -> None:
    """Receiver: register a paged KV buffer, publish it, wait for PushDone, return it."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    kv = _kv(DEC_BLOCKS, seed=1)
    transport, registry = _setup("dec-r0", "dec", kv, redis_url, generation=7)
    ready.set()
    deadline = time.monotonic() + 60
    done: PushDone | None = None
    while done is None and time.monotonic() < deadline:
        for _agent, msg in transport.notifications():
            done = decode(msg, PushDone)
        time.sleep(0.001)
    result.put((done.request_id if done else None, [a.tobytes() for a in kv]))
    registry.close()


def prefill_proc(redis_url: str, src: list[int], dst: list[int], result: Any,
                 ucx_tls: str | None) -> None:
    """Sender: fetch decode's agent from Redis, WRITE chosen blocks, notify."""
    if ucx_tls:
        os.environ["UCX_TLS"] = ucx_tls
    from kvpush.connector.transport import XferState

    kv = _kv(PRE_BLOCKS, seed=2)
    transport, registry = _setup("pre-r0", "pre", kv, redis_url, generation=3)
    peer = transport.peer(registry.fetch("dec", 0, generation=7))
    # Layer-wise, as the connector does: every layer but the last without notification,
    # the last one carrying PushDone.
    xfers = [transport.write(peer, [layer], src, dst) for layer in range(LAYERS - 1)]
    transport.wait(xfers, time.monotonic_ns() + 30_000_000_000)
    note = encode(PushDone(request_id="rid-1", num_tokens=len(src) * BLOCK))
    last = transport.write(peer, [LAYERS - 1], src, dst, notif=note)
    transport.wait([last], time.monotonic_ns() + 30_000_000_000)
    result.put((all(x.state is XferState.DONE for x in [*xfers, last]),
                sum(x.nbytes for x in [*xfers, last])))
    registry.close()


def stalled_prefill_proc(redis_url: str, result: Any, go: Any) -> None:
    """Sender whose peer gets SIGSTOPped after a first successful write."""
    os.environ["UCX_TLS"] = "tcp"
    from kvpush.connector.transport import TransferFailed, TransferTimeout

    kv = _kv(PRE_BLOCKS, seed=2)
    transport, registry = _setup("pre-r0", "pre", kv, redis_url, generation=3)
    peer = transport.peer(registry.fetch("dec", 0))
    transport.wait([transport.write(peer, [0], [0], [0])], time.monotonic_ns() + 30_000_000_000)
    result.put("warm")
    go.wait(30)
    # Far more than the socket buffers hold, so the frozen peer must stall it.
    big = list(range(PRE_BLOCKS))
    xfers = [transport.write(peer, list(range(LAYERS)), big, big) for _ in range(40)]
    started = time.monotonic()
    try:
        transport.wait(xfers, time.monotonic_ns() + 2_000_000_000)
        result.put(("finished", time.monotonic() - started))
    except TransferTimeout as exc:
        result.put(("timeout", time.monotonic() - started, str(exc)))
    except TransferFailed as exc:
        # UCX may also notice the stalled endpoint itself: a named error all the same.
        result.put(("failed", time.monotonic() - started, str(exc)))
    except Exception as exc:
        result.put(("unexpected", time.monotonic() - started, repr(exc)))
    registry.close()
    os._exit(0)  # the frozen peer would make a graceful UCX teardown hang


def _ctx() -> Any:
    return mp.get_context("spawn")


def _join(*procs: Any) -> None:
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()


@pytest.mark.parametrize("ucx_tls", [None, "tcp"], ids=["ucx-default", "ucx-tcp"])
def test_fragmented_write_lands_in_exactly_the_target_blocks(redis_url: str,
                                                             ucx_tls: str | None) -> None:
    ctx = _ctx()
    ready, dres, pres = ctx.Event(), ctx.Queue(), ctx.Queue()
    src = [1, 4, 5, 9, 20, 21, 22, 3]  # fragmented, partly contiguous (merge path)
    dst = [30, 2, 3, 17, 0, 1, 39, 11]
    dp = ctx.Process(target=decode_proc, args=(redis_url, ready, dres, ucx_tls))
    dp.start()
    assert ready.wait(60)
    pp = ctx.Process(target=prefill_proc, args=(redis_url, src, dst, pres, ucx_tls))
    pp.start()
    ok, nbytes = pres.get(timeout=90)
    rid, raw = dres.get(timeout=90)
    _join(pp, dp)
    assert ok and rid == "rid-1"
    assert nbytes == LAYERS * len(src) * BLOCK_LEN
    before, sender = _kv(DEC_BLOCKS, seed=1), _kv(PRE_BLOCKS, seed=2)
    for layer in range(LAYERS):
        got = np.frombuffer(raw[layer], dtype=np.float32).reshape(before[layer].shape)
        want = before[layer].copy()
        want[dst] = sender[layer][src]
        assert np.array_equal(got, want), f"layer {layer} differs"
        untouched = [b for b in range(DEC_BLOCKS) if b not in dst]
        assert np.array_equal(got[untouched], before[layer][untouched])


def test_frozen_peer_makes_the_wait_raise_a_timeout(redis_url: str) -> None:
    ctx = _ctx()
    ready, dres, pres, go = ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Event()
    dp = ctx.Process(target=decode_proc, args=(redis_url, ready, dres, "tcp"))
    dp.start()
    assert ready.wait(60)
    pp = ctx.Process(target=stalled_prefill_proc, args=(redis_url, pres, go))
    pp.start()
    try:
        assert pres.get(timeout=90) == "warm"
        os.kill(dp.pid, signal.SIGSTOP)
        go.set()
        # Generous: posting 40 large WRITEs on a loaded 2-core box can take a while.
        outcome = pres.get(timeout=240)
    finally:
        os.kill(dp.pid, signal.SIGKILL)
        _join(pp, dp)
    assert outcome[0] in ("timeout", "failed"), outcome
    if outcome[0] == "timeout":
        assert outcome[1] >= 2.0  # raised at its 2 s deadline, not before
        assert "still in progress" in outcome[2]


def test_registry_refetches_a_restarted_peer(redis_url: str) -> None:
    from kvpush.connector.registry import AgentNotFound, AgentRegistry, StaleAgent

    keys = RedisKeys()
    client = redis.Redis.from_url(redis_url)
    pub = AgentRegistry(client, keys, ttl_s=5, heartbeat_s=0.1)
    kv = _kv(2, seed=0)
    info = AgentInfo(engine_id="e1", rank=0, agent_name="a", agent_metadata=b"m1",
                     backends=["UCX"], generation=1, layout=_layout(kv))
    reader = AgentRegistry(client, keys)
    with pytest.raises(AgentNotFound):
        reader.fetch("e1", 0)
    pub.publish(info)
    assert reader.fetch("e1", 0).agent_metadata == b"m1"
    # The heartbeat keeps the TTL fresh.
    time.sleep(0.3)
    assert 0 < client.pttl(keys.agent("e1", 0)) <= 5000
    # A restart publishes a new generation; a target naming it forces one refetch.
    info2 = AgentInfo(engine_id="e1", rank=0, agent_name="a2", agent_metadata=b"m2",
                      backends=["UCX"], generation=2, layout=_layout(kv))
    pub.publish(info2)
    assert reader.fetch("e1", 0).agent_metadata == b"m1"  # cached, no generation asked
    assert reader.fetch("e1", 0, generation=2).agent_metadata == b"m2"
    with pytest.raises(StaleAgent):
        reader.fetch("e1", 0, generation=5)
    pub.close()
    assert client.get(keys.agent("e1", 0)) is None


def test_backend_selection_is_validated_with_clear_errors() -> None:
    from kvpush.connector.config import ConnectorConfig, ConnectorConfigError
    from kvpush.connector.nixl_transport import NixlTransport
    from kvpush.connector.transport import BackendUnavailable

    cfg = ConnectorConfig.from_extra({"redis_url": "redis://x", "backends": ["LIBFABRIC"]},
                                     engine_id="e")
    assert cfg.backends == ["LIBFABRIC"] and cfg.engine_id == "e"
    with pytest.raises(ConnectorConfigError, match="unsupported NIXL backend"):
        ConnectorConfig.from_extra({"redis_url": "redis://x", "engine_id": "e",
                                    "backends": ["POSIX"]})
    with pytest.raises(ConnectorConfigError, match="engine_id"):
        ConnectorConfig.from_extra({"redis_url": "redis://x"})
    # No redis_url: the engine's KVPUSH_REDIS_URL applies (tests/test_connector_redis_auth).
    assert ConnectorConfig.from_extra({"engine_id": "e"}).redis_url is None
    # EFA's backend is selectable; on a host without libfabric >= 1.21 it fails by name.
    try:
        NixlTransport("lf-probe", ["LIBFABRIC"])
    except BackendUnavailable as exc:
        assert "LIBFABRIC" in str(exc)


def test_incompatible_peer_layout_is_refused() -> None:
    from kvpush.connector.transport import LayoutMismatch, check_compatible

    a = _layout(_kv(4, seed=0))
    b = _layout(_kv(4, seed=0))
    check_compatible(a, b)
    # Another TP size is fine while every head keeps its bytes (half the heads per page).
    b.tp_size, b.kv_heads, b.total_kv_heads = 2, 1, 2
    a.kv_heads, a.total_kv_heads = 2, 2
    b.block_len = a.block_len // 2
    check_compatible(a, b)
    b.block_size = BLOCK * 2
    b.block_len = a.block_len  # twice the bytes per head
    with pytest.raises(LayoutMismatch, match=r"block_size.*bytes per head"):
        check_compatible(a, b)
