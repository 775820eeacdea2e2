"""deploy/kubernetes, checked without a cluster: every object against its schema (kubernetes-validate,
strict, for built-in kinds; the InferencePool and HTTPRoute schemas in deploy/kubernetes/schemas
for the Gateway API kinds), then against vt itself: flags `vt serve` knows, probes on /health,
a grace period longer than the drain, non-root, the model folder as a read-only volume, and
selectors and ports that meet."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from vt.launch.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}
K8S_VERSION = "1.33.0"  # the oldest release these manifests are meant for (preStop sleep is GA)


def load_objects() -> list[dict[str, Any]]:
    objs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        objs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return objs


def validate(obj: dict[str, Any]) -> None:
    """Raise unless obj matches its kind's schema; an object of an unknown kind is an error too."""
    schema_file = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if schema_file is not None:
        schema = json.loads((DEPLOY / "schemas" / schema_file).read_text())
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [obj] = [o for o in objs if o["kind"] == kind]
    return obj


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return load_objects()


def test_every_object_matches_its_schema(objs: list[dict[str, Any]]) -> None:
    assert sorted(o["kind"] for o in objs) == ["Deployment", "HTTPRoute", "InferencePool",
                                               "PersistentVolumeClaim", "Service"]
    for obj in objs:
        validate(obj)


@pytest.mark.parametrize("kind, path, bad", [
    ("Deployment", ("spec", "replicas"), "two"),
    ("Deployment", ("spec", "template", "spec", "terminationGracePeriod"), 60),   # misspelt field
    ("Service", ("spec", "ports", 0, "port"), "http"),
    ("InferencePool", ("spec", "targetPorts", 0, "number"), 70000),
    ("InferencePool", ("spec", "endpointPickerRef", "failureMode"), "Sometimes"),
    ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "weigth"), 1),              # misspelt field
])
def test_the_validators_reject_broken_objects(objs: list[dict[str, Any]], kind: str, path: tuple,
                                              bad: object) -> None:
    obj = copy.deepcopy(one(objs, kind))
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj)


def test_deployment_fits_vt(objs: list[dict[str, Any]]) -> None:
    dep = one(objs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    # the image's entrypoint is `vt serve --host 0.0.0.0 --port 8000`: args are more serve flags
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "8000", *c["args"]])
    assert args.model == "/models"
    from vt.sched.kv_publisher import parse_kv_events_config

    assert parse_kv_events_config(args.kv_events_config).enabled
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert port == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
        assert c[probe]["httpGet"]["port"] in ("http", port), probe
    assert c["readinessProbe"]["failureThreshold"] == 1  # a draining pod leaves at the first 503
    # termination: preStop sleep, then the drain; the grace period must outlast both
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + args.shutdown_timeout + 5
    # non-root, as the image's user
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # the model folder is a read-only volume at /models, from the claim deploy/ defines
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/models")
    assert mount["readOnly"] is True
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert vol["persistentVolumeClaim"]["claimName"] == one(objs, "PersistentVolumeClaim")["metadata"]["name"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert args.device == "cuda"


def test_service_pool_and_route_reach_the_pods(objs: list[dict[str, Any]]) -> None:
    dep, svc = one(objs, "Deployment"), one(objs, "Service")
    pool, route = one(objs, "InferencePool"), one(objs, "HTTPRoute")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    [c] = dep["spec"]["template"]["spec"]["containers"]
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] in ("http", port)
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    [ref] = route["spec"]["rules"][0]["backendRefs"]
    assert (ref["group"], ref["kind"], ref["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                        pool["metadata"]["name"])


def test_readme_names_the_files() -> None:
    readme = (DEPLOY.parents[1] / "README.md").read_text()
    for path in sorted(DEPLOY.glob("*.yaml")):
        assert f"deploy/kubernetes/{path.name}" in readme, path.name
    assert "vt replicas --model" in readme  # the launcher command
