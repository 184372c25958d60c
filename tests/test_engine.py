"""Engine launcher: command and env per connector, heartbeat contents, no orphans after SIGKILL."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.prefix_hashes import prefix_hashes
from kvpush.common.settings import EngineSettings
from kvpush.common.wire import EngineStatus, decode
from kvpush.services.engine.cpus import omp_bind, parse_cpus
from kvpush.services.engine.launcher import EngineError, EngineSpec
from kvpush.services.engine.status import (
    EngineLoad,
    MetricsUnavailable,
    StatusPublisher,
    engine_load,
    parse_metrics,
    publish_status,
    remove_status,
)
from tests.polling import alive, until


def _kv_config(cmd: list[str]) -> dict | None:
    if "--kv-transfer-config" not in cmd:
        return None
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_nixl_pull_command():
    spec = EngineSpec(role="prefill", connector="nixl-pull", port=8100, engine_id="p0", cpus="0")
    cmd = spec.command("/models/tiny")
    assert cmd[:3] == ["taskset", "-c", "0"]
    assert cmd[cmd.index("--port") + 1] == "8100"
    assert "--enforce-eager" in cmd and "--enable-prefix-caching" in cmd
    assert _kv_config(cmd) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "engine_id": "p0",
    }
    env = spec.env({"VLLM_CPU_KVCACHE_SPACE": "40"})
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "8101"
    # Without TP the model runs in the engine-core process, bound like vLLM's worker.
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"], env["OMP_PROC_BIND"]) == ("1", "{0}", "true")
    # The legacy knob must not override the explicit --kv-cache-memory-bytes.
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)


def test_nixl_push_command_has_fixed_engine_id_and_own_side_channel():
    d = EngineSpec(role="decode", connector="nixl-push", port=8200, side_channel_port=5700)
    kv = _kv_config(d.command("/m"))
    assert kv["kv_connector"] == "NixlPushConnector"
    assert kv["kv_role"] == "kv_consumer"
    assert kv["engine_id"] == d.resolved_engine_id
    assert d.env({})["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    assert "taskset" not in d.command("/m")


def test_kvpush_command_passes_config_through():
    spec = EngineSpec(
        role="decode",
        connector="kvpush",
        port=8200,
        engine_id="d0",
        redis_url="redis://127.0.0.1:6390/0",
        extra_config={"push_deadline_ms": 5000},
    )
    kv = _kv_config(spec.command("/m", generation=42))
    assert kv["kv_connector"] == "KVPushConnector"
    assert kv["kv_connector_module_path"] == "kvpush.connector.push_connector"
    assert kv["kv_role"] == "kv_consumer"
    extra = kv["kv_connector_extra_config"]
    assert extra["redis_url"] == "redis://127.0.0.1:6390/0"
    assert extra["engine_id"] == "d0"
    assert extra["generation"] == 42
    assert extra["push_deadline_ms"] == 5000
    # vLLM's processes import the installed connector; no checkout path is slipped in.
    assert spec.env({"PYTHONPATH": "/elsewhere"})["PYTHONPATH"] == "/elsewhere"
    assert importlib.util.find_spec(kv["kv_connector_module_path"]) is not None


def test_the_quarantine_bound_and_a_connector_subclass_reach_the_kvpush_connector_only(
        monkeypatch):
    """``KVPUSH_ENGINE_QUARANTINE_MAX_S`` goes into the kvpush connector's extra config,
    never into a stock connector's; a fault harness names a subclass to load."""
    monkeypatch.setenv("KVPUSH_ENGINE_QUARANTINE_MAX_S", "12.5")
    spec = EngineSpec.from_settings(EngineSettings(), role="decode", connector="kvpush",
                                    connector_class="pkg.mod.Sub")
    kv = _kv_config(spec.command("/m"))
    assert kv["kv_connector_extra_config"]["quarantine_max_s"] == 12.5
    assert (kv["kv_connector_module_path"], kv["kv_connector"]) == ("pkg.mod", "Sub")
    stock = EngineSpec.from_settings(EngineSettings(), role="decode", connector="nixl-pull")
    assert "quarantine_max_s" not in _kv_config(stock.command("/m")).get(
        "kv_connector_extra_config", {})


def test_no_connector_means_no_kv_config():
    spec = EngineSpec(role="both", connector="none", block_size=16, dtype="bfloat16")
    cmd = spec.command("/m")
    assert _kv_config(cmd) is None
    assert cmd[cmd.index("--block-size") + 1] == "16"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_invalid_specs_are_named_errors():
    with pytest.raises(EngineError):
        EngineSpec(role="router")
    with pytest.raises(EngineError):
        EngineSpec(connector="magic")
    with pytest.raises(EngineError):
        EngineSpec(role="prefill", connector="none")
    with pytest.raises(EngineError):
        EngineSpec(cpus=",")
    assert parse_cpus("0,2-4") == [0, 2, 3, 4]


def test_spec_from_settings(monkeypatch):
    monkeypatch.setenv("KVPUSH_ENGINE_PORT", "9100")
    monkeypatch.setenv("KVPUSH_ENGINE_CPUS", "1")
    spec = EngineSpec.from_settings(EngineSettings(), role="decode", connector="nixl-pull")
    assert (spec.port, spec.cpus, spec.role) == (9100, "1", "decode")
    # No explicit side-channel port: each engine derives its own from its HTTP port.
    assert spec.resolved_side_channel_port == 9101
    monkeypatch.setenv("KVPUSH_ENGINE_SIDE_CHANNEL_PORT", "5999")
    assert EngineSpec.from_settings(EngineSettings()).resolved_side_channel_port == 5999


METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="4096"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
"""


def test_engine_load_from_metrics():
    load = engine_load(parse_metrics(METRICS))
    assert load == EngineLoad(block_size=128, total_blocks=4096, free_blocks=3072, running=3,
                              waiting=2)
    with pytest.raises(MetricsUnavailable):
        engine_load(parse_metrics("# TYPE x gauge\nx 1\n"))


def test_status_in_redis_matches_contract(redis_client):
    keys = RedisKeys()
    pub = StatusPublisher(redis_client, engine_id="d0", role="decode", url="http://h:1",
                          model="tiny", connector="kvpush", generation=7, ttl_s=5.0)
    status = pub.status(engine_load(parse_metrics(METRICS)))
    publish_status(redis_client, keys, status, ttl_s=5.0)
    h = redis_client.hgetall(keys.engine("d0"))
    assert h[b"role"] == b"decode" and h[b"url"] == b"http://h:1"
    assert int(h[b"free_blocks"]) == 3072 and int(h[b"total_blocks"]) == 4096
    assert int(h[b"block_size"]) == 128 and int(h[b"generation"]) == 7
    assert h[b"connector"] == b"kvpush" and h[b"model"] == b"tiny"
    assert decode(h[b"m"], EngineStatus) == status
    assert 0 < redis_client.pttl(keys.engine("d0")) <= 5000
    assert redis_client.zscore(keys.engines(), "d0") == status.updated_ms
    remove_status(redis_client, keys, "d0")
    assert not redis_client.exists(keys.engine("d0"))
    assert redis_client.zscore(keys.engines(), "d0") is None


@pytest.mark.slow
def test_sigkilled_launcher_leaves_no_orphans(tmp_path, redis_url):
    """SIGKILL `kvpush engine`: the vLLM server and its engine-core children die with it.
    Before that, on the same engine (its KV cache a few prompts small): its KV events reach
    Redis, a prompt's prefix chunks are held there and leave once vLLM evicts them; after
    it, what it held expires with its status."""
    from tests.e2e_util import free_port_pair

    port = free_port_pair()
    env = {
        # As a host runs it by default: no shared zygotes, so no zygote at all (a forked
        # engine's launcher dying: test_engine_zygote.py).
        **{k: v for k, v in os.environ.items() if k != "KVPUSH_ENGINE_ZYGOTE_DIR"},
        "KVPUSH_REDIS_URL": redis_url,
        "KVPUSH_ENGINE_STATUS_TTL_S": "3",
        "KVPUSH_ENGINE_KV_CACHE_GIB": "0.006",  # about 3,100 tokens
    }
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kvpush.services.cli", "engine", "--connector", "none",
         "--port", str(port), "--engine-id", "orphan-test", "--log", str(tmp_path / "e.log")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys()
    try:
        # The launcher prints one line once the engine answers /health.
        for line in launcher.stdout:  # type: ignore[union-attr]
            if line.startswith("kvpush engine"):
                break
        else:
            pytest.fail(f"launcher exited ({launcher.wait()}): see {tmp_path / 'e.log'}")
        server = psutil.Process(launcher.pid).children()[0]
        tree = [server.pid, *(c.pid for c in server.children(recursive=True))]
        assert len(tree) >= 2, "expected vLLM's API server and its engine-core process"

        # While it runs, its status is in Redis as the contract says.
        h = client.hgetall(keys.engine("orphan-test"))
        assert h[b"role"] == b"both" and int(h[b"total_blocks"]) > 0
        assert int(h[b"generation"]) > 0
        assert client.zscore(keys.engines(), "orphan-test") is not None
        assert h[b"kv_events"] == b"1"

        prompt = list(range(100, 612))  # 8 chunks
        want = set(prefix_hashes(prompt, ""))
        held = lambda: {int(x) for x in client.smembers(keys.kv_chunks("orphan-test"))}  # noqa: E731
        _complete(port, prompt)
        until(lambda: want <= held(), "the prompt's chunks relayed", 30, step_s=0.2)
        for i in range(3):  # 1,500 tokens each: the first prompt's blocks are evicted
            _complete(port, [1000 + 1500 * i + j for j in range(1500)])
        until(lambda: not want & held(), "the evicted chunks removed", 30, step_s=0.2)
        assert held(), "the newest prompt's chunks are held"

        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        until(lambda: not alive(tree), "every engine process to exit after the launcher died", 60,
              step_s=0.5)

        # Nobody removed the status, so it must vanish by its TTL.
        until(lambda: not client.exists(keys.engine("orphan-test")), "the status expired", 30,
              step_s=0.5)
        until(lambda: not client.exists(keys.kv_chunks("orphan-test")), "the view expired", 30,
              step_s=0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in alive(locals().get("tree", [])):
            os.kill(pid, signal.SIGKILL)
        client.close()


def _complete(port: int, prompt: list[int]) -> None:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_engine_token_reaches_vllm_only_through_its_environment(monkeypatch):
    monkeypatch.setenv("KVPUSH_ENGINE_API_KEY", "s3cret-token")
    monkeypatch.setenv("VLLM_API_KEY", "inherited")
    spec = EngineSpec.from_settings(EngineSettings(), role="decode", connector="kvpush",
                                    block_size=16, dtype="bfloat16")
    env = spec.env()
    assert env["VLLM_API_KEY"] == "s3cret-token" and "KVPUSH_ENGINE_API_KEY" not in env
    assert "s3cret-token" not in " ".join(spec.command("/m")) and "s3cret" not in repr(spec)
    monkeypatch.delenv("KVPUSH_ENGINE_API_KEY")
    plain = EngineSpec.from_settings(EngineSettings(), role="both", connector="none")
    assert "VLLM_API_KEY" not in plain.env()  # no token asked for: none inherited either


def test_a_tp_engine_binds_each_rank_to_its_share_of_the_cpus() -> None:
    """vLLM's CPU TP runs one worker per rank: each gets its own core list, ``|``-separated
    (``auto`` needs a NUMA node per rank, which a one-node host lacks)."""
    assert omp_bind("0-3", 2) == "0,1|2,3"
    assert omp_bind("0,1", 2) == "0|1"
    assert omp_bind("1", 2) == "1|1"  # fewer cores than ranks: they share
    assert omp_bind("2-3", 1) == "2-3"
    spec = EngineSpec(role="prefill", connector="kvpush", cpus="0-1", tp=2,
                      redis_url="redis://127.0.0.1:1")
    assert spec.command("/m")[spec.command("/m").index("--tensor-parallel-size") + 1] == "2"
    env = spec.env({})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env  # TP needs vLLM's worker processes
    assert "--distributed-executor-backend" not in spec.command("/m")
    assert "--tensor-parallel-size" not in EngineSpec(role="both").command("/m")
    # An operator may keep vLLM's own CPU default: a worker process without TP too.
    mp = EngineSpec(role="both", cpus="2-3", worker_in_core=False)
    assert "--distributed-executor-backend" not in mp.command("/m")
    assert mp.env({})["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    with pytest.raises(EngineError, match="tp"):
        EngineSpec(tp=0)
