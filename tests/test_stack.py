"""Local stack: proxy request shapes, connector choice, `kvpush status`, a real one-engine stack."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import EngineStatus
from kvpush.services.engine.status import publish_status
from kvpush.services.local import stack as stack_mod
from kvpush.services.local.pd_proxy import (
    Backend,
    PDProxy,
    PrefillFailed,
    ProxyConfigError,
    prefill_body,
    pull_decode_body,
    push_decode_body,
)
from kvpush.services.local.stack import (
    LocalStack,
    engine_rows,
    engine_settings,
    print_status,
    stack_settings,
)


def test_prefill_leg_is_one_token_without_streaming():
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    req = prefill_body(body)
    assert req["max_tokens"] == 1 and req["stream"] is False
    assert "stream_options" not in req
    assert req["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50, "the client's body must not be mutated"


def test_pull_decode_leg_carries_prefill_params():
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "p"}
    req = pull_decode_body({"prompt": "x", "stream": True}, {"kv_transfer_params": params})
    assert req["kv_transfer_params"] == params and req["stream"] is True
    with pytest.raises(PrefillFailed):
        pull_decode_body({"prompt": "x"}, {"choices": []})


def test_push_decode_leg_names_prefill_side_channel():
    p = Backend(url="http://p", engine_id="prefill-1", side_channel_port=5601)
    params = push_decode_body({"prompt": "x"}, p, "cmpl-1")["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert (params["remote_engine_id"], params["remote_port"]) == ("prefill-1", 5601)
    assert params["remote_request_id"] == "cmpl-1"
    assert params["tp_size"] == 1 and params["pp_size"] == 1


def test_proxy_config_errors():
    d = Backend(url="http://d", engine_id="d")
    with pytest.raises(ProxyConfigError):
        PDProxy("nixl-pull", None, d)
    with pytest.raises(ProxyConfigError):
        PDProxy("nixl-push", Backend(url="http://p", engine_id="p"), d)
    with pytest.raises(ProxyConfigError):
        PDProxy("teleport", None, d)


def test_kvpush_falls_back_to_pull_only_when_missing(monkeypatch):
    monkeypatch.setattr(stack_mod, "kvpush_available", lambda: False)
    assert stack_mod.resolve_connector("kvpush") == "nixl-pull"
    monkeypatch.setattr(stack_mod, "kvpush_available", lambda: True)
    assert stack_mod.resolve_connector("kvpush") == "kvpush"
    assert stack_mod.resolve_connector("nixl-push") == "nixl-push"
    with pytest.raises(stack_mod.StackError):
        stack_mod.resolve_connector("carrier-pigeon")


def test_stack_settings_overrides(monkeypatch):
    monkeypatch.setenv("KVPUSH_STACK_PORT", "9000")
    monkeypatch.delenv("KVPUSH_STACK_MODEL", raising=False)
    s = stack_settings(connector="nixl-push", model=None)
    # The real model by default (the suite's stacks set tiny, tests/conftest.py).
    assert (s.stack_connector, s.stack_port, s.stack_model) == ("nixl-push", 9000,
                                                                "smollm2-135m")


def _own_model_dir(tmp_path):
    """A model directory of one's own: its base name is no local model's."""
    path = tmp_path / "my-own-llm"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def _up(argv, monkeypatch):
    """``kvpush up ARGV``'s stack, its engines planned (not started), kvpush available."""
    from kvpush.services.cli.main import build_parser, up_settings

    monkeypatch.setattr(stack_mod, "kvpush_available", lambda: True)
    settings, engines = up_settings(build_parser().parse_args(["up", *argv]))
    stack = LocalStack(settings, engine_settings=engines)
    stack.plan_engines()
    return stack


def test_up_flags_reach_every_engine_and_the_gateway(tmp_path, monkeypatch):
    from kvpush.services.local.push_front import stack_gateway_settings

    own = _own_model_dir(tmp_path)
    stack = _up(["--connector", "kvpush", "--prefill", "2", "--decode", "2",
                 "--model", str(own), "--max-model-len", "4096", "--kv-cache-gib", "0.5",
                 "--block-size", "32"], monkeypatch)
    specs = [e.spec for e in stack.engines]
    assert [s.role for s in specs] == ["prefill", "prefill", "decode", "decode"]
    assert {(s.model, s.max_model_len, s.kv_cache_gib, s.block_size) for s in specs} == {
        (str(own), 4096, 0.5, 32)}
    cmd = specs[0].command(own)
    assert cmd[cmd.index("--max-model-len") + 1] == "4096"
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 29)
    # The directory is used as is, and clients name the model by its base name.
    for engine in stack.engines:
        engine.model_path, _ = engine.resolve(engine.spec)
        assert engine.model_path == own
    gs = stack_gateway_settings(stack.context())
    assert (gs.gateway_model, gs.gateway_tokenizer, gs.gateway_max_model_len) == (
        "my-own-llm", str(own), 4096)


def test_up_takes_the_engine_settings_from_the_environment(tmp_path, monkeypatch):
    from kvpush.services.local.push_front import stack_gateway_settings

    own = _own_model_dir(tmp_path)
    monkeypatch.setenv("KVPUSH_STACK_MODEL", str(own))
    monkeypatch.setenv("KVPUSH_ENGINE_MAX_MODEL_LEN", "3072")
    monkeypatch.setenv("KVPUSH_ENGINE_KV_CACHE_GIB", "0.75")
    monkeypatch.setenv("KVPUSH_ENGINE_BLOCK_SIZE", "64")
    stack = _up(["--connector", "nixl-pull"], monkeypatch)
    assert {(e.spec.model, e.spec.max_model_len, e.spec.kv_cache_gib, e.spec.block_size)
            for e in stack.engines} == {(str(own), 3072, 0.75, 64)}
    # A flag wins over its variable.
    stack = _up(["--connector", "none", "--max-model-len", "5000", "--model", "tiny"],
                monkeypatch)
    assert [(e.spec.model, e.spec.max_model_len, e.spec.block_size)
            for e in stack.engines] == [("tiny", 5000, 64)]
    # The gateway's own variables win over what it learns from the engines.
    stack = _up(["--connector", "kvpush"], monkeypatch)
    for engine in stack.engines:
        engine.model_path, _ = engine.resolve(engine.spec)
    monkeypatch.setenv("KVPUSH_GATEWAY_TOKENIZER", str(tmp_path / "tok"))
    monkeypatch.setenv("KVPUSH_GATEWAY_MAX_MODEL_LEN", "1000")
    gs = stack_gateway_settings(stack.context())
    assert (gs.gateway_model, gs.gateway_tokenizer, gs.gateway_max_model_len) == (
        "my-own-llm", str(tmp_path / "tok"), 1000)


def test_stack_engine_settings_defaults_and_overrides(monkeypatch):
    monkeypatch.setattr(stack_mod, "kvpush_available", lambda: True)
    stack = LocalStack(stack_settings(connector="kvpush"))
    stack.plan_engines()
    assert {(e.spec.model, e.spec.max_model_len, e.spec.kv_cache_gib, e.spec.block_size)
            for e in stack.engines} == {("tiny", 2048, 1.0, None)}
    # The benchmarks' explicit KV size and spec overrides win over the engine settings.
    stack = LocalStack(stack_settings(connector="kvpush"), kv_cache_gib=0.25,
                       engine_settings=engine_settings(kv_cache_gib=2.0, block_size=16),
                       engine_overrides={"block_size": 32})
    stack.plan_engines()
    assert {(e.spec.kv_cache_gib, e.spec.block_size) for e in stack.engines} == {(0.25, 32)}


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "neither a local model"),
    (["--max-model-len", "0"], "engine_max_model_len"),
    (["--kv-cache-gib", "0"], "engine_kv_cache_gib"),
    (["--block-size", "-1"], "engine_block_size"),
])
def test_up_refuses_a_bad_model_or_engine_setting(argv, message):
    from kvpush.services.cli.main import CLIError, build_parser, up_settings

    with pytest.raises(CLIError, match=message):
        up_settings(build_parser().parse_args(["up", *argv]))


def test_ports_handed_out_in_a_row_never_overlap(monkeypatch):
    """Two engines asked for before either binds its port: the kernel may offer the same
    port to consecutive binds to port 0 (CI once booted prefill and decode on one port),
    so the helpers skip what this process handed out already."""
    from kvpush.services.local import ports

    taken: list[int] = []
    for _ in range(50):
        p = ports.free_port_pair()
        r = ports.free_port_range(3)
        taken += [p, p + 1, r, r + 1, r + 2, ports.free_port()]
    assert len(taken) == len(set(taken))

    offered = iter([taken[0], taken[0] + 1, 61234, 61234])
    monkeypatch.setattr(ports, "_unbound_port", lambda: next(offered))
    # The kernel offers ports handed out already, then a new one twice in a row.
    assert ports.free_port() == 61234
    with pytest.raises(StopIteration):
        ports.free_port()


def test_front_holds_its_port_from_construction_and_serves_it():
    import socket

    from kvpush.services.local.ports import free_port
    from kvpush.services.local.stack import UvicornThread

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    front = UvicornThread(app, "127.0.0.1", port)
    try:
        # Nothing else can take the port between construction and start (engines boot
        # in that gap), not even a socket that asks for SO_REUSEADDR.
        with socket.socket() as other, pytest.raises(OSError):
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            other.bind(("127.0.0.1", port))
        front.start()
        assert httpx.get(front.url).text == "ok"
    finally:
        front.stop()


def test_stack_with_a_taken_port_fails_before_booting_engines(tmp_path, redis_url, monkeypatch):
    import socket

    from kvpush.services.local.ports import free_port

    started: list[object] = []
    monkeypatch.setattr(stack_mod.EngineProcess, "start", lambda self: started.append(self))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        settings = stack_settings(connector="none", port=taken.getsockname()[1]).model_copy(
            update={"redis_url": redis_url, "run_dir": tmp_path})
        with pytest.raises(OSError):
            LocalStack(settings).start()
    assert started == []


def test_status_lists_engines(redis_url, capsys, monkeypatch):
    import redis

    client = redis.Redis.from_url(redis_url)
    status = EngineStatus(engine_id="decode-1", role="decode", url="http://d:1", model="tiny",
                          block_size=128, total_blocks=100, free_blocks=40, generation=99,
                          connector="nixl-pull", updated_ms=1)
    publish_status(client, RedisKeys(), status, ttl_s=10)
    # An index entry whose hash expired is skipped, not shown as a ghost.
    client.zadd(RedisKeys().engines(), {"gone": 1})
    rows = engine_rows(redis_url)
    assert [r["engine_id"] for r in rows] == ["decode-1"]
    assert rows[0]["free_blocks"] == 40 and rows[0]["generation"] == 99

    monkeypatch.setenv("KVPUSH_REDIS_URL", redis_url)
    assert print_status(as_json=True) == 0
    assert json.loads(capsys.readouterr().out)[0]["role"] == "decode"
    assert print_status() == 0
    out = capsys.readouterr().out
    assert "decode-1" in out and "40/100" in out
    client.close()


@pytest.mark.slow
def test_one_engine_stack_serves_openai_and_stops_clean(tmp_path, redis_url):
    from tests.e2e_util import free_port_pair

    settings = stack_settings(connector="none", port=free_port_pair(),
                              decode_port=free_port_pair()).model_copy(
        update={"redis_url": redis_url, "run_dir": tmp_path})
    engines = engine_settings(max_model_len=2304, block_size=32)
    with LocalStack(settings, kv_cache_gib=0.25, engine_settings=engines) as stack:
        pids = [stack.decode.pid, *(c.pid for c in psutil.Process(stack.decode.pid).children(
            recursive=True))]
        assert httpx.get(f"{stack.url}/health").json()["ok"] is True
        card = httpx.get(f"{stack.url}/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("tiny", 2304)
        chat = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5, "temperature": 0})
        assert chat.status_code == 200
        assert chat.json()["usage"]["completion_tokens"] == 5
        assert [(r["role"], r["block_size"]) for r in engine_rows(redis_url)] == [("both", 32)]
        assert (tmp_path / "logs").is_dir()
    assert engine_rows(redis_url) == []
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids)


@pytest.mark.slow
def test_a_model_directory_of_ones_own_serves_through_the_gateway(tmp_path, redis_url):
    """Boots its own engine (one, colocated behind the push gateway): the gateway must count
    prompt tokens with the tokenizer of a directory whose base name is no known model (it
    looked that name up on the hub and answered 503), and the stack's max model length
    must reach the engine and the gateway's context limit alike."""
    import shutil

    from transformers import AutoTokenizer

    from kvpush.services.local.models import ensure_model
    from tests.e2e_util import free_port_pair

    own = tmp_path / "my-own-llm"
    shutil.copytree(ensure_model("tiny"), own)
    settings = stack_settings(connector="kvpush", model=str(own), port=free_port_pair(),
                              decode_port=free_port_pair()).model_copy(
        update={"redis_url": redis_url, "run_dir": tmp_path / "run"})
    engines = engine_settings(max_model_len=3072, kv_cache_gib=0.25)
    tokenizer = AutoTokenizer.from_pretrained(own)

    def prompt_of(tokens: int) -> tuple[str, int]:
        text = " ".join(f"w{i % 97}" for i in range(tokens))
        return text, len(tokenizer(text)["input_ids"])

    with LocalStack(settings, engine_settings=engines, data_parallel=1) as stack:
        assert stack.decode.spec.model == str(own) and stack.decode.model_path == own
        assert httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"] == "my-own-llm"
        # Longer than the 2,048 tokens the stack used to be stuck with.
        text, n = prompt_of(1000)
        assert 2048 < n < 3000
        resp = httpx.post(f"{stack.url}/v1/completions", timeout=120, json={
            "model": "my-own-llm", "prompt": text, "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        usage = resp.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n, 4)
        # The gateway counted the prompt itself and refused it against the engines' length.
        text, n = prompt_of(1400)
        assert n > 3072
        resp = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
            "model": "my-own-llm", "prompt": text, "max_tokens": 4})
        assert resp.status_code == 400, resp.text
        assert f"the prompt is {n} tokens; the model's context is 3072" in resp.text
