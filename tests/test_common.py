"""Wire codec, key schema and settings: the contracts every service relies on."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from kvpush.common import wire
from kvpush.common.keys import InvalidKeyPart, RedisKeys
from kvpush.common.settings import (
    CommonSettings,
    EngineSettings,
    GatewaySettings,
    SchedulerSettings,
    StackSettings,
)


def test_roundtrip_every_message() -> None:
    layout = wire.KVLayout(
        layer_names=["l0"], base_addrs=[4096], region_len=8192, block_len=512, num_blocks=16,
        block_size=16, dtype="bfloat16", kv_splits=2, tp_rank=0, tp_size=1, memory="DRAM",
    )
    msgs = [
        wire.EngineStatus(engine_id="d0", role="decode", url="http://x", model="m",
                          block_size=16, total_blocks=10, free_blocks=5),
        layout,
        wire.AgentInfo(engine_id="d0", rank=0, agent_name="a", agent_metadata=b"\x00\xff",
                       backends=["UCX"], generation=3, layout=layout),
        wire.ScheduleRequest(request_id="r", gateway_id="g", prompt_tokens=5, max_tokens=3,
                             deadline_ms=wire.now_ms()),
        wire.Assignment(request_id="r", decode_engine="d0", fencing_token=7),
        wire.PushTarget(request_id="r", decode_engine="d0", decode_generation=1,
                        block_ids=[[3, 9, 1], [0, 4, 5]], skip_blocks=[0, 1], num_tokens=40),
        wire.PushDone(request_id="r", bytes_written=10),
    ]
    for msg in msgs:
        assert wire.decode(wire.encode(msg), type(msg)) == msg


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", msgspec.msgpack.encode({"request_id": 5}), msgspec.msgpack.encode([1, 2])],
)
def test_malformed_payload_is_wire_error(payload: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(payload, wire.ScheduleRequest)


def test_future_schema_version_is_refused() -> None:
    data = wire.encode(wire.PushDone(request_id="r", v=wire.SCHEMA_VERSION + 1))
    with pytest.raises(wire.WireError, match="schema version"):
        wire.decode(data, wire.PushDone)


def test_unknown_fields_from_newer_writers_are_tolerated() -> None:
    data = msgspec.msgpack.encode({"v": wire.SCHEMA_VERSION, "request_id": "r", "added_later": [1]})
    assert wire.decode(data, wire.PushDone).request_id == "r"


def test_kv_transfer_params_dict_leaves_defaults_out_and_parses_back() -> None:
    pre = wire.KVTransferParams(kvpush="prefill", request_id="cmpl-1", decode_engine="d0",
                                deadline_ms=123)
    assert pre.to_dict() == {"kvpush": "prefill", "request_id": "cmpl-1",
                             "decode_engine": "d0", "deadline_ms": 123}
    dec = wire.KVTransferParams(kvpush="decode", request_id="cmpl-1", prefill_engine="p0",
                                reservation_id="cmpl-1", fencing_token=7, deadline_ms=123,
                                traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
    for params in (pre, dec):
        assert wire.parse_kv_transfer_params(params.to_dict()) == params


def test_a_history_is_all_of_engine_request_and_tokens_on_a_prefill_leg_only() -> None:
    leg = {"kvpush": "prefill", "request_id": "r", "decode_engine": "d0",
           "history_engine": "d1", "history_request_id": "h", "history_tokens": 64,
           "history_push_key": "k", "history_digest": wire.history_digest(range(64))}
    assert wire.parse_kv_transfer_params(leg).history_tokens == 64
    for bad in ({**leg, "history_engine": None}, {**leg, "history_tokens": 0},
                {**leg, "history_tokens": -1}, {**leg, "history_request_id": ""},
                {**leg, "history_digest": None}, {**leg, "push_tokens": -1},
                {**leg, "history_engine": "a b"}, {**leg, "history_tokens": "64"},
                {**leg, "kvpush": "decode", "prefill_engine": "p0"}):
        with pytest.raises(wire.WireError):
            wire.parse_kv_transfer_params(bad)


def test_keys_share_hash_tag_for_lua_scripts() -> None:
    k = RedisKeys("kvpush")
    tag = "{d-1}"
    assert tag in k.engine("d-1") and tag in k.reservations("d-1") and tag in k.fence("d-1")
    assert k.tenant_scoped("acme", "rps").startswith("kvpush:t:{acme}:")
    assert k.tenant_pattern("acme") == "kvpush:t:{acme}:*"


@pytest.mark.parametrize("bad", ["", "a b", "x}y", "a:b", "a*", "x" * 200])
def test_key_parts_are_validated(bad: str) -> None:
    with pytest.raises(InvalidKeyPart):
        RedisKeys().engine(bad)


@pytest.mark.parametrize(
    "cls", [CommonSettings, EngineSettings, SchedulerSettings, GatewaySettings, StackSettings]
)
def test_every_setting_is_documented(cls: type[CommonSettings]) -> None:
    for name, field in cls.model_fields.items():
        assert field.description, f"{cls.__name__}.{name} has no docstring"


def test_settings_read_kvpush_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPUSH_REDIS_URL", "redis://h:1/0")
    monkeypatch.setenv("KVPUSH_SCHEDULER_LEASE_S", "2.5")
    s = SchedulerSettings()
    assert s.redis_url == "redis://h:1/0" and s.scheduler_lease_s == 2.5


def test_configure_page_settings_tables_match_the_settings_classes() -> None:
    """docs/configure.md, the docs site's settings reference, is what the classes say."""
    from pathlib import Path

    from kvpush.services.cli.main import SETTINGS_BEGIN, SETTINGS_END, settings_markdown

    page = (Path(__file__).parent.parent / "docs" / "configure.md").read_text()
    assert SETTINGS_BEGIN in page and SETTINGS_END in page, "settings markers missing"
    section = page.split(SETTINGS_BEGIN, 1)[1].split(SETTINGS_END, 1)[0]
    assert section.strip() == settings_markdown().strip(), (
        "docs/configure.md is stale: run `kvpush config --write docs/configure.md`")


def test_config_write_refreshes_only_the_tables(tmp_path) -> None:
    from kvpush.services.cli.main import SETTINGS_BEGIN, SETTINGS_END, main, settings_markdown

    page = tmp_path / "configure.md"
    assert main(["config", "--write", str(page)]) == 0  # a new page: intro and tables
    fresh = page.read_text()
    assert fresh.startswith("# Configure\n") and settings_markdown().strip() in fresh
    page.write_text(f"# Mine\n\nkept\n\n{SETTINGS_BEGIN}\nstale table\n{SETTINGS_END}\n\ntail\n")
    assert main(["config", "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Mine\n\nkept\n\n") and text.endswith(f"{SETTINGS_END}\n\ntail\n")
    assert "stale table" not in text and settings_markdown().strip() in text


def test_a_cancellation_a_library_swallowed_still_stops_the_loop() -> None:
    """What redis-py sometimes does to a cancel() (turns it into a timeout it retries):
    the loop's next round raises it again instead of running forever."""
    import asyncio
    import contextlib

    from kvpush.common.runtime import honour_cancellation, run

    rounds = 0

    async def loop_that_loses_a_cancel() -> None:
        nonlocal rounds
        while True:
            honour_cancellation()
            rounds += 1
            with contextlib.suppress(asyncio.CancelledError):  # the library bug
                await asyncio.sleep(0.01)

    async def main() -> None:
        task = asyncio.create_task(loop_that_loses_a_cancel())
        while rounds < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)

    run(main())
    assert rounds >= 3


@pytest.mark.parametrize("lost", [
    RuntimeError("unable to perform operation on <TCPTransport closed=True reading=False>; "
                 "the handler is closed"),
    ConnectionResetError(104, "Connection reset by peer"),
])
def test_a_lost_connection_past_the_budget_is_a_redis_error(lost: Exception) -> None:
    """What uvloop or the socket raises when Redis goes away mid-call reaches callers as a
    ``redis.ConnectionError`` once the outage budget is spent: they answer a Redis error
    (the gateway a 503), never an internal error (a 500 in the fault suite once)."""
    import asyncio

    import redis

    from kvpush.common.redis_client import ride_out

    calls = 0

    async def op() -> None:
        nonlocal calls
        calls += 1
        raise lost

    with pytest.raises(redis.ConnectionError) as exc:
        asyncio.run(ride_out(op, 0.0, "admitting"))
    assert calls == 1 and exc.value.__cause__ is lost

    async def broken() -> None:
        raise RuntimeError("a bug, not a lost connection")

    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(ride_out(broken, 5.0, "admitting"))


def test_push_keys_tie_a_target_to_its_request() -> None:
    from kvpush.common.push_key import PushKeys, target_allowed

    keys = PushKeys()
    k = keys.for_request("r1")
    assert k == keys.for_request("r1") and k != keys.for_request("r2")
    assert k != PushKeys().for_request("r1")  # another gateway process, another secret
    assert target_allowed(None, k, "D", k)  # early: no decode named, the key decides
    assert not target_allowed(None, k, "D", None)
    assert not target_allowed(None, k, "D", keys.for_request("r2"))
    assert not target_allowed("D", k, "X", k)  # assigned: the decode must match too
    assert target_allowed("D", None, "D", None)  # a hand-made request without a key
    assert not target_allowed("D", None, "X", None)
    assert target_allowed(None, None, "X", None)


def test_freezing_the_startup_heap_takes_it_out_of_the_collectors_scans() -> None:
    """In a process of its own: pytest's heap is not this test's to freeze."""
    code = ("import gc, kvpush.common.settings; "
            "from kvpush.common.runtime import freeze_startup_heap; "
            "assert gc.get_freeze_count() == 0; freeze_startup_heap(); "
            "assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
