"""How the launcher configures the push connector: NIXL backends and OTLP tracing."""

from __future__ import annotations

import json

import pytest

from kvpush.common.settings import EngineSettings
from kvpush.services.engine.launcher import EngineError, EngineSpec, vllm_otlp_endpoint


def _extra(spec: EngineSpec) -> dict:
    cmd = spec.command("/m", generation=7)
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def test_backends_default_to_ucx_and_come_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("KVPUSH_ENGINE_NIXL_BACKENDS", raising=False)
    spec = EngineSpec.from_settings(EngineSettings(), role="prefill", connector="kvpush")
    assert _extra(spec)["backends"] == ["UCX"]
    monkeypatch.setenv("KVPUSH_ENGINE_NIXL_BACKENDS", '["LIBFABRIC"]')
    spec = EngineSpec.from_settings(EngineSettings(), role="prefill", connector="kvpush")
    assert _extra(spec)["backends"] == ["LIBFABRIC"]
    # An explicit extra config still has the last word.
    spec = EngineSpec(role="decode", connector="kvpush", nixl_backends=["LIBFABRIC", "UCX"],
                      extra_config={"backends": ["UCX"]})
    assert _extra(spec)["backends"] == ["UCX"]


def test_unknown_backend_is_refused_before_launch() -> None:
    with pytest.raises(EngineError, match="POSIX"):
        EngineSpec(role="decode", connector="kvpush", nixl_backends=["POSIX"])
    with pytest.raises(EngineError):
        EngineSpec(role="decode", connector="kvpush", nixl_backends=[])
    # The stock connectors pick their backends themselves.
    EngineSpec(role="decode", connector="nixl-pull", nixl_backends=["POSIX"])


def test_otlp_endpoint_reaches_connector_and_vllm(monkeypatch) -> None:
    monkeypatch.setenv("KVPUSH_OTLP_ENDPOINT", "http://collector:4318")
    spec = EngineSpec.from_settings(EngineSettings(), role="decode", connector="kvpush",
                                    engine_id="d1")
    cmd = spec.command("/m")
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://collector:4318/v1/traces"
    env = spec.env({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"})
    assert env["KVPUSH_OTLP_ENDPOINT"] == "http://collector:4318"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"] == "kvpush-engine"
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == (
        "deployment.environment=test,kvpush.engine_id=d1,kvpush.role=decode")

    grpc = EngineSpec(role="prefill", connector="kvpush", otlp_endpoint="grpc://c:4317")
    cmd = grpc.command("/m")
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://c:4317"
    assert grpc.env({})["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"


def test_no_endpoint_no_tracing_flags() -> None:
    spec = EngineSpec(role="decode", connector="kvpush")
    assert "--otlp-traces-endpoint" not in spec.command("/m")
    env = spec.env({})
    assert "KVPUSH_OTLP_ENDPOINT" not in env and "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in env


def test_otlp_endpoint_forms() -> None:
    assert vllm_otlp_endpoint("https://c:4318/") == "https://c:4318/v1/traces"
    assert vllm_otlp_endpoint("http://c:4318/custom/traces") == "http://c:4318/custom/traces"
    with pytest.raises(EngineError):
        vllm_otlp_endpoint("c:4317")
    with pytest.raises(EngineError):
        EngineSpec(role="decode", connector="kvpush", otlp_endpoint="udp://c:1")
