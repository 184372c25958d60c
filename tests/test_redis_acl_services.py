"""Each service kind's Redis ACL user on a real Redis: it does its real job through the real
code paths (heartbeat, connector, drain; the scheduler's loop; the gateway serving a request
with auth and quotas) and gets NOPERM on everything else."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from redis.exceptions import NoPermissionError

from kvpush.common.acl import AclUser, ServiceKind, apply_user, describe_markdown, service_user
from kvpush.common.keys import RedisKeys
from kvpush.common.quotas import SyncQuotaLimiter, usage
from kvpush.common.redis_client import sync_redis
from kvpush.common.reservations import Reservations
from kvpush.common.runtime import run
from kvpush.common.settings import CommonSettings
from kvpush.common.tenancy import Quotas, create_tenant, get_tenant, hash_api_key
from kvpush.common.wire import AgentInfo, KVLayout, StoredResponse, now_ms
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.registry import AgentRegistry
from kvpush.connector.scheduler_side import SchedulerSide
from kvpush.services.engine.drain import mark_draining, read_activity
from kvpush.services.engine.status import publish_status, remove_status
from kvpush.services.gateway.response_store import StoreResult
from kvpush.services.scheduler.prefix_affinity import WINDOW_S
from tests import sched_util
from tests.polling import until
from tests.test_gateway import PROMPT, pd, stack, tokenizer_dir  # noqa: F401 (fixture)

K = RedisKeys()
TENANCY_PAGE = Path(__file__).resolve().parents[1] / "docs" / "tenancy.md"


def _pw(name: str) -> str:
    return f"pw-{name}-7f3a9c"


@pytest.fixture
def made_users(redis_client: redis.Redis) -> Iterator[Callable[..., AclUser]]:
    """``make(kind, **ids)`` applies that user (password ``_pw(name)``); all deleted after."""
    made: list[str] = []
    redis_client.acl_log_reset()

    def make(kind: ServiceKind, **ids: str) -> AclUser:
        user = service_user(kind, **ids)
        apply_user(redis_client, user.name, user.rules(_pw(user.name)))
        made.append(user.name)
        return user

    yield make
    for name in made:
        redis_client.acl_deluser(name)


def _as(redis_url: str, user: AclUser) -> redis.Redis:
    """A client from the real factory with the user in KVPUSH_REDIS_USERNAME/_PASSWORD."""
    settings = CommonSettings(redis_url=redis_url, redis_username=user.name,
                              redis_password=_pw(user.name))
    client = sync_redis(settings)
    assert isinstance(client, redis.Redis)
    return client


def _url_as(redis_url: str, user: AclUser) -> str:
    return redis_url.replace("redis://", f"redis://{user.name}:{_pw(user.name)}@")


def _refused(admin: redis.Redis) -> list[str]:
    """What Redis refused so far (ACL LOG), but CLIENT SETINFO: redis-py sends it on connect
    and carries on when a Redis older than 7.2 does not know it or a rule leaves it out."""
    return [f"{e['username']}: {e['reason']} {e['object']}" for e in admin.acl_log()
            if e["object"] != "client|setinfo"]


def _denied(*calls: Callable[[], Any]) -> None:
    for call in calls:
        try:
            call()
        except NoPermissionError:
            continue
        raise AssertionError(f"not refused: {inspect.getsource(call).strip()}")


def _no_server_admin(c: redis.Redis) -> None:
    """Nothing server-wide: flushing, configuration, users, key enumeration, scripts."""
    for cmd in (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "*"), ("ACL", "LIST"),
                ("ACL", "SETUSER", "x", "on", "+@all"), ("KEYS", "*"), ("SCAN", "0"),
                ("RANDOMKEY",), ("DBSIZE",), ("INFO",), ("SCRIPT", "FLUSH"),
                ("FUNCTION", "FLUSH"), ("CLIENT", "LIST"), ("MONITOR",),
                ("PUBLISH", "ch", "x"), ("SAVE",), ("SWAPDB", "0", "1")):
        with pytest.raises(NoPermissionError):
            c.execute_command(*cmd)


def _no_tenant_writes(c: redis.Redis, tenant: str = "acme") -> None:
    """No write to tenant records, API keys or quota counters (also not through the quota
    script), and no read of the key index."""
    _denied(
        lambda: c.hset(K.tenant(tenant), "requests_per_second", "1000000"),
        lambda: c.sadd(K.tenants(), "evil"),
        lambda: c.sadd(K.tenant_api_keys(tenant), "h"),
        lambda: c.hset(K.api_key("h" * 64), "tenant", tenant),
        lambda: c.hgetall(K.api_key("h" * 64)),
        lambda: c.delete(K.tenant_quota(tenant, "leases")),
        lambda: c.set(K.tenant_quota(tenant, "tokens.sum"), "0"),
    )


# -- engine ---------------------------------------------------------------------------------


def _layout() -> KVLayout:
    return KVLayout(layer_names=["l0"], base_addrs=[4096], region_len=1024, block_len=256,
                    num_blocks=4, block_size=16, dtype="float32", kv_splits=1, tp_rank=0,
                    tp_size=1, memory="DRAM")


class _Req:
    """The fields of vLLM's ``Request`` the connector's scheduler side reads."""

    def __init__(self, request_id: str, params: dict[str, Any], n: int) -> None:
        from vllm.v1.request import RequestStatus

        self.request_id, self.kv_transfer_params, self.num_prompt_tokens = request_id, params, n
        self.num_computed_tokens = 0
        self.status = RequestStatus.FINISHED_STOPPED


def test_engine_user_heartbeat_connector_and_drain(
    redis_url: str, redis_client: redis.Redis, made_users: Callable[..., AclUser],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = made_users(ServiceKind.ENGINE)
    create_tenant(redis_client, "acme", tenant_id="acme", quotas=Quotas(requests_per_second=5))
    eng = _as(redis_url, engine)
    # Heartbeats of a decode and a prefill engine (MULTI HSET PEXPIRE, then the index).
    publish_status(eng, K, sched_util.engine_status("D", total=100), ttl_s=60)
    publish_status(eng, K, sched_util.engine_status("P", role="prefill"), ttl_s=60)
    assert redis_client.hget(K.engine("D"), "total_blocks") == b"100"
    assert redis_client.zscore(K.engines(), "P") is not None

    # A scheduler reserved on D; the connectors run as the engine user (env credentials).
    resv = Reservations(redis_client).reserve("D", "rid-1", 3, 60_000).reservation
    assert resv is not None
    monkeypatch.setenv("KVPUSH_REDIS_USERNAME", engine.name)
    monkeypatch.setenv("KVPUSH_REDIS_PASSWORD", _pw(engine.name))

    def side(engine_id: str, role: str) -> SchedulerSide:
        return SchedulerSide(ConnectorConfig(redis_url=redis_url, engine_id=engine_id),
                             block_size=16, generation=7, kv_role=role,
                             block_ids_of=lambda _rid: [[1, 2, 3]])

    prefill, decode = side("P", "kv_producer"), side("D", "kv_consumer")
    try:
        deadline = now_ms() + 30_000
        dreq = _Req("vd", {"kvpush": "decode", "request_id": "rid-1", "prefill_engine": "P",
                           "deadline_ms": deadline, "reservation_id": "rid-1",
                           "fencing_token": resv.fencing_token}, 40)
        preq = _Req("vp", {"kvpush": "prefill", "request_id": "rid-1", "decode_engine": "D",
                           "deadline_ms": deadline}, 40)
        prefill.update_state_after_alloc(preq, [], 0)
        assert decode.get_num_new_matched_tokens(dreq, 0) == (40, True)
        decode.update_state_after_alloc(dreq, [[7, 8, 9]], 40)  # XADD to P's target stream
        meta = until(lambda: (m := prefill.build_connector_meta([])).targets and m,
                     "prefill to read the target", 10, step_s=0.02)  # XREAD on its own stream
        assert meta.targets["vp"].block_ids == [[7, 8, 9]]
        # The push completed; the request ended: decode releases its reservation.
        decode.update_connector_output(None, {"vd"}, None)
        decode.request_finished(dreq, [7, 8, 9])  # type: ignore[arg-type]
        until(lambda: Reservations(redis_client).count("D") == 0, "the release", 10, step_s=0.02)
    finally:
        prefill.shutdown()
        decode.shutdown()

    # NIXL agent metadata: publish own, read a peer's, withdraw.
    registry = AgentRegistry(eng, K, ttl_s=30, heartbeat_s=10)
    registry.publish(AgentInfo(engine_id="D", rank=0, agent_name="d-r0", agent_metadata=b"m",
                               backends=["UCX"], generation=7, layout=_layout()))
    assert AgentRegistry(eng, K).fetch("D", 0, 7).agent_name == "d-r0"
    registry.close()
    assert not redis_client.exists(K.agent("D", 0))

    # Draining itself: the mark (EVAL) and the activity poll (snapshot script).
    assert mark_draining(eng, K, "D") == 1
    act = read_activity(eng, K, "D")
    assert act is not None and act.draining and act.reservations == 0
    remove_status(eng, K, "D")
    assert not redis_client.exists(K.engine("D")) and redis_client.zscore(K.engines(), "D") is None
    assert _refused(redis_client) == []  # nothing on the way was refused and swallowed

    # Nothing of tenants, quotas, the request flow or the scheduler's own keys.
    tenant = get_tenant(redis_client, "acme")
    _no_tenant_writes(eng)
    _denied(
        lambda: SyncQuotaLimiter(eng).admit(tenant, 1, 1),
        lambda: eng.hgetall(K.tenant("acme")),
        lambda: eng.xadd(K.requests(), {"m": b"x"}),
        lambda: eng.xadd(K.assignments("gw1"), {"m": b"x"}),
        lambda: eng.xadd(K.dead_letters(), {"m": b"x"}),
        lambda: eng.set(K.request_once("rid-1"), "x"),
        lambda: eng.incr(K.fence("P")),
        lambda: Reservations(eng).reserve("P", "rid-2", 1, 1000),  # the fence is not its
        # The target streams take XADD only: no overwriting, trimming or deleting them.
        lambda: eng.set(K.targets("P"), "x"),
        lambda: eng.delete(K.targets("P")),
        lambda: eng.xtrim(K.targets("P"), maxlen=0),
        lambda: eng.set(K.engine("P"), "x"),
    )
    _no_server_admin(eng)
    eng.close()


def test_narrowed_engine_user_writes_only_its_own_keys(
    redis_url: str, redis_client: redis.Redis, made_users: Callable[..., AclUser],
) -> None:
    user = made_users(ServiceKind.ENGINE, engine_id="D1")
    assert user.name == "kvpush-engine-D1"
    redis_client.set(K.agent("D2", 0), b"peer")
    eng = _as(redis_url, user)
    publish_status(eng, K, sched_util.engine_status("D1"), ttl_s=60)
    eng.set(K.agent("D1", 0), b"own", px=10_000)
    assert eng.get(K.agent("D2", 0)) == b"peer"
    eng.xadd(K.targets("P"), {"m": b"x"})  # decode pushes to any prefill engine
    assert eng.xrevrange(K.targets("D1"), count=1) == []
    _denied(
        lambda: publish_status(eng, K, sched_util.engine_status("D2"), ttl_s=60),
        lambda: eng.set(K.agent("D2", 0), b"forged"),
        lambda: eng.xrevrange(K.targets("P"), count=1),
        lambda: mark_draining(eng, K, "D2"),
        lambda: Reservations(eng).release("D2", "r", 1),
    )
    eng.close()


# -- scheduler ------------------------------------------------------------------------------


def test_scheduler_user_runs_the_real_loop(
    redis_url: str, redis_client: redis.Redis, made_users: Callable[..., AclUser],
) -> None:
    sched_user = made_users(ServiceKind.SCHEDULER)
    gw = _as(redis_url, made_users(ServiceKind.GATEWAY))
    eng = _as(redis_url, made_users(ServiceKind.ENGINE))
    create_tenant(redis_client, "acme", tenant_id="acme", weight=3.0)
    publish_status(eng, K, sched_util.engine_status("D1", total=100), ttl_s=60)
    publish_status(eng, K, sched_util.engine_status("P1", role="prefill"), ttl_s=60)
    # An engine whose heartbeat lapsed: the sweep forgets it (ZREM on the index).
    redis_client.zadd(K.engines(), {"gone": now_ms()})

    async def main() -> None:
        # Sweeps and trims run in the loop itself; any refusal would end the task.
        s = sched_util.settings(_url_as(redis_url, sched_user), scheduler_sweep_s=0.05)
        async with sched_util.running(s) as sched:
            # With prefix hashes: the affinity lookup and record run as this user too.
            sched_util.enqueue(gw, msgspec.structs.replace(
                sched_util.request(rid="cmpl-good", tenant="acme"), prefix_hashes=[1, 2, 3]))
            gw.xadd(K.requests(), {b"m": b"\xc1 not msgpack"})  # poison
            await sched_util.wait_for(
                lambda: (len(sched_util.assignments(redis_client)) == 1
                         and len(sched_util.dead_letters(redis_client)) == 1
                         and redis_client.zscore(K.engines(), "gone") is None),
                "an assignment, a dead letter and a sweep", 30)
            await sched.load_weights(["acme"])
            assert sched.weight("acme") == 3.0
            await sched.trim()
        (a,) = sched_util.assignments(redis_client)
        assert a.ok and (a.decode_engine, a.prefill_engine) == ("D1", "P1")
        assert int(redis_client.get(K.fence("D1")) or 0) == a.fencing_token > 0
        # The marker names the engine and, once answered, the token it was answered with.
        assert (redis_client.get(K.request_once("cmpl-good")) or b"").endswith(
            f"|D1|{a.fencing_token}".encode())
        assert redis_client.xpending(K.requests(), "schedulers")["pending"] == 0
        window = now_ms() // (WINDOW_S * 1000)
        assert redis_client.hget(K.prefix_affinity(window), "3") == b"D1|P1"
        # The gateway releases at the end of the request.
        sched_util.release_all(gw, [a])
        assert Reservations(redis_client).count("D1") == 0
        assert _refused(redis_client) == []

    run(main())

    sc = _as(redis_url, sched_user)
    before = redis_client.hget(K.engine("D1"), "total_blocks")
    # The reserve script declares the status hash, yet no write to it gets through:
    # not directly, not through a script of its own.
    sha = sc.script_load("return redis.call('HSET', KEYS[1], 'total_blocks', '999999')")
    with pytest.raises(redis.ResponseError):
        sc.evalsha(sha, 1, K.engine("D1"))
    assert redis_client.hget(K.engine("D1"), "total_blocks") == before
    tenant = get_tenant(redis_client, "acme")
    _no_tenant_writes(sc)
    _denied(
        lambda: sc.hset(K.engine("D1"), "total_blocks", "999999"),
        lambda: sc.eval("return 1", 0),
        lambda: SyncQuotaLimiter(sc).admit(tenant, 1, 1),
        lambda: sc.xadd(K.requests(), {"m": b"x"}),  # it consumes the stream, never feeds it
        lambda: sc.delete(K.requests()),
        lambda: sc.xread({K.assignments("gw1"): "0"}),
        lambda: sc.set(K.agent("D1", 0), b"x"),
        lambda: sc.xadd(K.targets("P1"), {"m": b"x"}),
        lambda: sc.zadd(K.engines(), {"forged": now_ms()}),
    )
    _no_server_admin(sc)
    for c in (sc, gw, eng):
        c.close()


# -- gateway --------------------------------------------------------------------------------


def test_gateway_user_serves_a_request_with_auth_and_quotas(
    redis_url: str, redis_client: redis.Redis, made_users: Callable[..., AclUser],
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    gw_user = made_users(ServiceKind.GATEWAY)
    sched_user = made_users(ServiceKind.SCHEDULER)
    _, key = create_tenant(redis_client, "acme", tenant_id="acme",
                           quotas=Quotas(requests_per_second=100, concurrent_requests=4,
                                         tokens_per_minute=100_000))
    p, d = pd()
    gw_settings = {"gateway_auth": True, "redis_username": gw_user.name,
                   "redis_password": _pw(gw_user.name)}

    async def main() -> None:
        # The scheduler connects as its user (URL); the gateway as its own (settings).
        async with stack(_url_as(redis_url, sched_user), redis_client, tokenizer_dir, p, d,
                         gw=gw_settings) as s:
            r = await s.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
                                    headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
            await sched_util.wait_for(
                lambda: (Reservations(redis_client).count("d1") == 0
                         and usage(redis_client, "acme")["concurrent_leases"] == 0),
                "reservation and quota lease released", 30)
            assert usage(redis_client, "acme")["tokens_in_window"] > 0
            assert await s.gateway.engine_models() == ["tiny"]
            # The breaker marks an engine suspect in its status hash.
            assert await s.gateway.breaker.mark_suspect("d1", "test") > 0
            assert int(redis_client.hget(K.engine("d1"), "suspect_until") or 0) > now_ms()
            # Stored responses: kept, read and deleted through their scripts.
            store = s.gateway.responses
            kept = StoredResponse(id="resp_acl", created_ms=now_ms(), history=["hi"],
                                  response={"id": "resp_acl", "output": []})
            assert await store.put("acme", kept) is StoreResult.STORED
            assert await store.get("acme", "resp_acl") == kept
            assert await store.delete("acme", "resp_acl")
            assert _refused(redis_client) == []

    run(main())

    g = _as(redis_url, gw_user)
    tenant = get_tenant(redis_client, "acme")
    SyncQuotaLimiter(g).admit(tenant, 1, 1).release(1)  # the quota script, as the gateway
    # A long stream renews its reservation, then releases it.
    held = Reservations(redis_client).reserve("d1", "rid-long", 1, 60_000).reservation
    assert held is not None
    assert Reservations(g).renew("d1", "rid-long", held.fencing_token, 60_000) > 0
    assert Reservations(g).release("d1", "rid-long", held.fencing_token).name == "RELEASED"
    assert _refused(redis_client) == []
    _denied(
        lambda: g.hset(K.tenant("acme"), "requests_per_second", "1000000"),
        lambda: g.sadd(K.tenants(), "evil"),
        lambda: g.hset(K.api_key(hash_api_key(key)), "tenant", "other"),
        lambda: g.delete(K.api_key(hash_api_key(key))),
        lambda: g.smembers(K.tenant_api_keys("acme")),
        # Reservations come from the scheduler: no fencing token, no reserve, no marker.
        lambda: g.incr(K.fence("d1")),
        lambda: Reservations(g).reserve("d1", "rid-x", 1, 1000),
        lambda: g.hset(K.reservations("d1"), "rid-x", "1:1"),
        lambda: g.set(K.request_once("rid-x"), "x"),
        # It feeds the request stream, it does not consume, trim or delete it.
        lambda: g.xreadgroup("schedulers", "c", {K.requests(): ">"}),
        lambda: g.xtrim(K.requests(), maxlen=0),
        lambda: g.delete(K.requests()),
        # No forged assignments, dead letters or agent metadata. A push target stream it
        # may append to (the cancel of an early prefill), never read, trim or delete.
        lambda: g.xadd(K.assignments("gwtest"), {"m": b"x"}),
        lambda: g.xadd(K.dead_letters(), {"m": b"x"}),
        lambda: g.xread({K.targets("p1"): "0"}),
        lambda: g.xtrim(K.targets("p1"), maxlen=0),
        lambda: g.delete(K.targets("p1")),
        lambda: g.set(K.agent("d1", 0), b"x"),
        lambda: g.zadd(K.engines(), {"forged": now_ms()}),
        lambda: g.delete(K.engine("d1")),
    )
    _no_server_admin(g)
    g.close()


def test_narrowed_gateway_user_reads_only_its_own_assignments(
    redis_url: str, redis_client: redis.Redis, made_users: Callable[..., AclUser],
) -> None:
    user = made_users(ServiceKind.GATEWAY, gateway_id="gw1")
    g = _as(redis_url, user)
    redis_client.xadd(K.assignments("gw2"), {"m": b"x"})
    assert g.xread({K.assignments("gw1"): "0"}) == []
    _denied(lambda: g.xread({K.assignments("gw2"): "0"}),
            lambda: g.xtrim(K.assignments("gw2"), maxlen=0))
    g.close()


# -- tenant ---------------------------------------------------------------------------------


def test_tenant_user_reads_its_own_record_and_usage_only(
    redis_url: str, redis_client: redis.Redis, made_users: Callable[..., AclUser],
) -> None:
    quotas = Quotas(requests_per_second=10, concurrent_requests=2, tokens_per_minute=1000)
    ta, _ = create_tenant(redis_client, "acme", tenant_id="acme", quotas=quotas)
    tb, _ = create_tenant(redis_client, "other", tenant_id="other", quotas=quotas)
    SyncQuotaLimiter(redis_client).admit(ta, 5, 5)
    SyncQuotaLimiter(redis_client).admit(tb, 5, 5)
    t = _as(redis_url, made_users(ServiceKind.TENANT, tenant_id="acme"))
    assert get_tenant(t, "acme").quotas == quotas
    assert usage(t, "acme") == {"requests_in_window": 1, "concurrent_leases": 1,
                                "tokens_in_window": 10}
    assert _refused(redis_client) == []
    _denied(
        # Its own quota counters: neither through the quota script nor directly.
        lambda: SyncQuotaLimiter(t).admit(ta, 1, 1),
        lambda: t.delete(K.tenant_quota("acme", "leases")),
        lambda: t.set(K.tenant_quota("acme", "tokens.sum"), "0"),
        lambda: t.zrem(K.tenant_quota("acme", "leases"), "x"),
        lambda: t.hset(K.tenant("acme"), "requests_per_second", "1000000"),
        # Nothing of other tenants, of the key index or of the request flow.
        lambda: get_tenant(t, "other"),
        lambda: usage(t, "other"),
        lambda: t.smembers(K.tenant_api_keys("acme")),
        lambda: t.smembers(K.tenants()),
        lambda: t.hgetall(K.api_key("h" * 64)),
        lambda: t.xadd(K.requests(), {"m": b"x"}),
        lambda: t.zrange(K.engines(), 0, -1),
    )
    _no_server_admin(t)
    t.close()
    assert usage(redis_client, "acme")["concurrent_leases"] == 1


# -- the command and the docs page ----------------------------------------------------------


def test_kvpush_acl_users_apply_with_a_password_file(
    redis_url: str, redis_client: redis.Redis, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvpush.services.cli.main import main

    create_tenant(redis_client, "acme", tenant_id="acme")
    monkeypatch.setenv("KVPUSH_REDIS_URL", redis_url)
    secrets_file = tmp_path / "passwords"
    secrets_file.write_text("# one line per user\nengine=pw-engine-1\nscheduler=pw-sched-1\n"
                            "kvpush-gateway=pw-gw-1\nkvpush-tenant-acme=pw-acme-1\n")
    names = ["kvpush-engine", "kvpush-scheduler", "kvpush-gateway", "kvpush-tenant-acme"]
    try:
        assert main(["acl", "users", "--tenant", "acme", "--password-file", str(secrets_file),
                     "--apply"]) == 0
        out, err = capsys.readouterr()
        lines = out.splitlines()
        assert [line.split()[2] for line in lines] == names
        assert all(line.startswith("ACL SETUSER ") for line in lines)
        assert "pw-" not in out + err  # hashed only, never echoed
        for name, pw in zip(names, ["pw-engine-1", "pw-sched-1", "pw-gw-1", "pw-acme-1"],
                            strict=True):
            with redis.Redis.from_url(redis_url, username=name, password=pw) as c:
                assert c.ping()
        # Generated passwords: printed once, on stderr; the ACL file format on stdout.
        assert main(["acl", "users", "--kind", "scheduler", "--format", "aclfile",
                     "--apply"]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("user kvpush-scheduler reset on #")
        (pw,) = re.findall(r"password of kvpush-scheduler \(not shown again\): (\S+)", err)
        assert pw not in out
        with redis.Redis.from_url(redis_url, username="kvpush-scheduler", password=pw) as c:
            assert c.ping()
        # A password file that lacks a user is refused before anything is printed.
        secrets_file.write_text("engine=pw-engine-1\n")
        assert main(["acl", "users", "--password-file", str(secrets_file)]) == 1
        out, err = capsys.readouterr()
        assert out == "" and "no line for kvpush-scheduler" in err
        # `kvpush tenants acl` makes the same read-only tenant user.
        assert main(["tenants", "acl", "acme", "--apply"]) == 0
        out, err = capsys.readouterr()
        (pw,) = re.findall(r"\(not shown again\): (\S+)", err)
        with redis.Redis.from_url(redis_url, username="kvpush-tenant-acme", password=pw) as c:
            assert c.hget(K.tenant("acme"), "name") == b"acme"
            with pytest.raises(NoPermissionError):
                SyncQuotaLimiter(c).admit(get_tenant(redis_client, "acme"), 1, 1)
    finally:
        for name in names:
            redis_client.acl_deluser(name)


def test_docs_page_lists_the_users_as_the_rules_grant() -> None:
    """docs/tenancy.md's "Redis users" table is what the rules grant."""
    text = TENANCY_PAGE.read_text()
    begin, end = "<!-- acl:begin -->\n", "<!-- acl:end -->"
    section = text[text.index(begin) + len(begin):text.index(end)].strip()
    assert section == describe_markdown(), "regenerate with `kvpush acl describe`"


def test_rules_carry_no_plaintext_password() -> None:
    for kind in ServiceKind:
        user = service_user(kind, tenant_id="acme")
        rules = user.rules("s3cret-pw")
        assert "s3cret-pw" not in " ".join(rules)
        assert rules[:3] == ["reset", "on", rules[2]] and rules[2].startswith("#")
        # Every key pattern sits in a selector with its commands; none at the root.
        assert not [r for r in rules if r.startswith(("~", "%", "+@", "allkeys", "allcommands"))]
