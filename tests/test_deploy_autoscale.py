"""The autoscaling manifests under docker/k8s/autoscale, checked without a cluster: KEDA's
ScaledObjects against KEDA's own CRD schema (strict: no unknown field), the fallback HPAs
against Kubernetes' autoscaling/v2 schema, and both against the Deployments and metrics
they name (tests/schemas/README.md says where the schemas come from)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvpush.services.scheduler.planner_task import PlannerMetrics

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "docker" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "schemas"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _strict(schema: Any) -> Any:
    """``additionalProperties: false`` wherever an object lists its properties."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out \
                and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validator(name: str, strict: bool) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    return jsonschema.Draft7Validator(_strict(schema) if strict else schema)


def _deployments() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _docs(K8S / "engines.yaml")
            if d["kind"] == "Deployment"}


def _errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def test_keda_scaled_objects_match_kedas_schema_and_target_the_engines() -> None:
    validator = _validator("keda-scaledobject-v1alpha1.json", strict=True)
    docs = _docs(K8S / "autoscale" / "keda" / "scaledobjects.yaml")
    deployments = _deployments()
    assert {d["spec"]["scaleTargetRef"]["name"] for d in docs} == {"kvpush-prefill",
                                                                   "kvpush-decode"}
    for doc in docs:
        assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
        assert _errors(validator, doc) == [], doc["metadata"]["name"]
        target = deployments[doc["spec"]["scaleTargetRef"]["name"]]
        role = target["metadata"]["labels"]["app.kubernetes.io/component"]
        (trigger,) = doc["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        # AverageValue with threshold 1: the HPA asks for exactly the planner's count.
        assert trigger["metadata"]["threshold"] == "1"
        assert trigger["metadata"]["query"] == \
            f'max(kvpush_planner_desired_replicas{{role="{role}"}})'
        # KEDA's fallback applies only to AverageValue triggers, and holds a count.
        assert doc["spec"]["fallback"]["replicas"] >= doc["spec"]["minReplicaCount"] >= 1


def test_a_misspelt_field_fails_the_strict_schema() -> None:
    validator = _validator("keda-scaledobject-v1alpha1.json", strict=True)
    doc = _docs(K8S / "autoscale" / "keda" / "scaledobjects.yaml")[0]
    doc["spec"]["minReplicas"] = 1  # an HPA's field name, not KEDA's
    assert any("minReplicas" in e for e in _errors(validator, doc))


def test_fallback_hpas_match_the_autoscaling_v2_schema() -> None:
    validator = _validator("hpa-autoscaling-v2.json", strict=False)  # strict already
    docs = _docs(K8S / "autoscale" / "hpa" / "hpa.yaml")
    deployments = _deployments()
    assert len(docs) == 2
    for doc in docs:
        assert _errors(validator, doc) == [], doc["metadata"]["name"]
        ref = doc["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
        role = deployments[ref["name"]]["metadata"]["labels"]["app.kubernetes.io/component"]
        (metric,) = doc["spec"]["metrics"]
        assert metric["external"]["metric"]["name"] == "kvpush_planner_desired_replicas"
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": role}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


@pytest.mark.parametrize("overlay", ["keda", "hpa"])
def test_overlays_build_on_the_base(overlay: str) -> None:
    kust = yaml.safe_load((K8S / "autoscale" / overlay / "kustomization.yaml").read_text())
    assert kust["resources"][0] == "../.."
    for res in kust["resources"][1:]:
        assert (K8S / "autoscale" / overlay / res).is_file()


def test_the_scaled_metric_is_what_the_scheduler_serves_and_prometheus_scrapes() -> None:
    served = {m.name for m in PlannerMetrics().registry.collect()}
    assert "kvpush_planner_desired_replicas" in served
    sched = next(d for d in _docs(K8S / "scheduler.yaml") if d["kind"] == "Deployment")
    pod = sched["spec"]["template"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    port = env["KVPUSH_SCHEDULER_METRICS_PORT"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == port
    assert {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]} == {int(port)}
    # The engines drain on SIGTERM within the grace period, so a scale-down cuts nothing.
    config = {d["metadata"]["name"]: d for d in _docs(K8S / "configmap.yaml")}
    drain = float(next(iter(config.values()))["data"].get("KVPUSH_ENGINE_DRAIN_TIMEOUT_S",
                                                          60))
    for dep in _deployments().values():
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain + 10, dep["metadata"]["name"]
    assert re.fullmatch(r"\d+", port)
