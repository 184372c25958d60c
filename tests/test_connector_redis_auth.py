"""The connector's Redis clients take ``KVPUSH_REDIS_*`` credentials from the environment.

A second real ``redis-server`` with a default-user password and the engine kind's ACL user
(``kvpush acl users --kind engine``):
the target stream and the agent registry work with credentials from the environment, and
an engine started without them (or with wrong ones) refuses with an error that says what
to set and never shows the password.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from kvpush.common.acl import ServiceKind, apply_user, service_user
from kvpush.common.keys import RedisKeys
from kvpush.common.wire import AgentInfo, KVLayout, now_ms
from kvpush.connector.config import ConnectorConfig, RedisAccessError, connector_redis
from kvpush.connector.registry import AgentRegistry
from kvpush.connector.scheduler_side import SchedulerSide
from kvpush.services.local.local_redis import LocalRedis, free_port
from tests.polling import until

ADMIN_PW = "admin-secret-1"
USER, USER_PW = "kvpush-engine", "engine-secret-2"
BS = 16


@dataclass
class Req:
    """The fields of vLLM's ``Request`` the scheduler side reads."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A Redis whose default user needs a password, plus the engines' ACL user."""
    server = LocalRedis(Path(tmp_path_factory.mktemp("redis-auth"))).start()
    admin = redis.Redis(port=server.port)
    engine = service_user(ServiceKind.ENGINE)
    assert engine.name == USER
    apply_user(admin, engine.name, engine.rules(USER_PW))
    admin.config_set("requirepass", ADMIN_PW)
    yield server
    server.stop()


@pytest.fixture
def creds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPUSH_REDIS_USERNAME", USER)
    monkeypatch.setenv("KVPUSH_REDIS_PASSWORD", USER_PW)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVPUSH_REDIS_URL", "KVPUSH_REDIS_USERNAME", "KVPUSH_REDIS_PASSWORD"):
        monkeypatch.delenv(name, raising=False)


def _side(url: str | None, engine: str, role: str) -> SchedulerSide:
    cfg = ConnectorConfig(redis_url=url, engine_id=engine)
    return SchedulerSide(cfg, block_size=BS, generation=5, kv_role=role,
                         block_ids_of=lambda _rid: [[1, 2, 3]])


def _layout() -> KVLayout:
    return KVLayout(layer_names=["l0"], base_addrs=[4096], region_len=1024, block_len=256,
                    num_blocks=4, block_size=BS, dtype="float32", kv_splits=1, tp_rank=0,
                    tp_size=1, memory="DRAM")


@pytest.mark.usefixtures("creds")
def test_targets_and_registry_work_with_env_credentials(auth_redis: LocalRedis) -> None:
    prefill = _side(auth_redis.url, "P", "kv_producer")
    decode = _side(auth_redis.url, "D", "kv_consumer")
    try:
        dreq = Req("vd", {"kvpush": "decode", "request_id": "rid-a", "prefill_engine": "P",
                          "deadline_ms": now_ms() + 30_000}, num_prompt_tokens=40)
        preq = Req("vp", {"kvpush": "prefill", "request_id": "rid-a", "decode_engine": "D",
                          "deadline_ms": now_ms() + 30_000}, num_prompt_tokens=40)
        prefill.update_state_after_alloc(preq, [], 0)
        assert decode.get_num_new_matched_tokens(dreq, 0) == (40, True)
        decode.update_state_after_alloc(dreq, [[7, 8, 9]], 40)
        decode.build_connector_meta([])
        # Published by decode's client, read by prefill's blocking reader: both authenticated.
        meta = until(lambda: (m := prefill.build_connector_meta([])).targets and m,
                     "prefill to read the target", 10, step_s=0.02)
        assert meta.targets["vp"].block_ids == [[7, 8, 9]]
    finally:
        prefill.shutdown()
        decode.shutdown()

    cfg = ConnectorConfig(redis_url=auth_redis.url, engine_id="D")
    registry = AgentRegistry(connector_redis(cfg), RedisKeys(), ttl_s=30, heartbeat_s=10)
    registry.publish(AgentInfo(engine_id="D", rank=0, agent_name="d-r0", agent_metadata=b"m",
                               backends=["UCX"], generation=3, layout=_layout()))
    try:
        peer = AgentRegistry(connector_redis(cfg), RedisKeys()).fetch("D", 0, 3)
        assert peer.agent_name == "d-r0"
    finally:
        registry.close()


def test_without_credentials_the_connector_refuses_to_start(auth_redis: LocalRedis) -> None:
    with pytest.raises(RedisAccessError) as err:
        _side(auth_redis.url, "D", "kv_consumer")
    msg = str(err.value)
    assert "KVPUSH_REDIS_PASSWORD" in msg and "default user" in msg


def test_wrong_password_is_named_and_not_shown(auth_redis: LocalRedis,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPUSH_REDIS_USERNAME", USER)
    monkeypatch.setenv("KVPUSH_REDIS_PASSWORD", "not-the-password")
    with pytest.raises(RedisAccessError) as err:
        _side(auth_redis.url, "P", "kv_producer")
    assert repr(USER) in str(err.value) and "not-the-password" not in str(err.value)
    # A password inside the URL is redacted from the message as well.
    monkeypatch.delenv("KVPUSH_REDIS_USERNAME")
    monkeypatch.delenv("KVPUSH_REDIS_PASSWORD")
    url = auth_redis.url.replace("redis://", f"redis://{USER}:wrong-in-url@")
    with pytest.raises(RedisAccessError) as err:
        connector_redis(ConnectorConfig(redis_url=url, engine_id="P"))
    assert "wrong-in-url" not in str(err.value) and "***" in str(err.value)


@pytest.mark.usefixtures("creds")
def test_extra_config_url_overrides_the_env_url(auth_redis: LocalRedis,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    # Unset in the extra config: the engine's KVPUSH_REDIS_URL is used.
    monkeypatch.setenv("KVPUSH_REDIS_URL", auth_redis.url)
    assert connector_redis(ConnectorConfig(engine_id="D")).ping()
    # Set in the extra config: it wins over the environment.
    monkeypatch.setenv("KVPUSH_REDIS_URL", dead)
    assert connector_redis(ConnectorConfig(redis_url=auth_redis.url, engine_id="D")).ping()
    with pytest.raises(RedisAccessError, match="cannot use Redis"):
        connector_redis(ConnectorConfig(engine_id="D"))
    monkeypatch.delenv("KVPUSH_REDIS_URL")
    with pytest.raises(RedisAccessError, match="KVPUSH_REDIS_URL"):
        connector_redis(ConnectorConfig(engine_id="D"))
