"""deploy/kubernetes, checked without a cluster: every object against its schema (kubernetes-validate,
strict, for built-in kinds; the InferencePool and HTTPRoute schemas in deploy/kubernetes/schemas
for the Gateway API kinds), then against vt itself: flags `vt serve` knows, probes on /health,
a grace period longer than the drain, non-root, the model folder as a read-only volume, and
selectors and ports that meet; an image a node already holds is used; the Job that fills the model
volume writes where the replicas read; the kustomization applies the serving objects."""

from __future__ import annotations

import copy
import json
import re
import shlex
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


KUSTOMIZATION = "kustomization.yaml"  # kustomize's input, not an object of the cluster


def manifest_paths() -> list[Path]:
    return [p for p in sorted(DEPLOY.glob("*.yaml")) if p.name != KUSTOMIZATION]


def load_objects() -> list[dict[str, Any]]:
    objs = []
    for path in manifest_paths():
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
    assert sorted(o["kind"] for o in objs) == ["Deployment", "HTTPRoute", "InferencePool", "Job",
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
    ("Job", ("spec", "backoffLimit"), "four"),
    ("Job", ("spec", "template", "spec", "containers", 0, "volumeMount"), []),       # misspelt field
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
    from vt.config import parse_kv_events_config

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


def test_a_locally_loaded_image_is_used(objs: list[dict[str, Any]]) -> None:
    # unset, a :latest tag means Always: a node would never run an image loaded into it (kind load)
    [c] = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c.get("imagePullPolicy") in ("IfNotPresent", "Never"), c.get("imagePullPolicy")


def test_the_job_fills_the_volume_the_replicas_read(objs: list[dict[str, Any]]) -> None:
    dep, job, pvc = one(objs, "Deployment"), one(objs, "Job"), one(objs, "PersistentVolumeClaim")
    pod, job_pod = dep["spec"]["template"]["spec"], job["spec"]["template"]["spec"]
    [c], [j] = pod["containers"], job_pod["containers"]
    args = build_parser().parse_args(["serve", *c["args"]])
    # the Job mounts the same claim, writable, and writes the checkpoint at the top of the folder
    # the replicas serve
    job_mount = next(m for m in j["volumeMounts"]
                     if next(v for v in job_pod["volumes"] if v["name"] == m["name"])
                     .get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"])
    assert not job_mount.get("readOnly", False)
    assert not next(v for v in job_pod["volumes"] if v["name"] == job_mount["name"])[
        "persistentVolumeClaim"].get("readOnly", False)
    script = " ".join(j.get("command", []) + j.get("args", []))
    assert f'local_dir="{job_mount["mountPath"]}"' in script
    dep_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == args.model)
    assert dep_mount["readOnly"] is True
    # one writer, replicas on many nodes
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # the files it writes belong to the image's user, who reads them in the replicas
    assert job_pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsUser"]
    assert job_pod["restartPolicy"] in ("OnFailure", "Never")
    assert {e["name"] for e in j["env"]} >= {"MODEL_ID", "HF_TOKEN"}
    token = next(e for e in j["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["optional"] is True  # public checkpoints need none


def test_the_image_runs_as_the_pods_user(objs: list[dict[str, Any]]) -> None:
    dockerfile = (DEPLOY.parents[1] / "Dockerfile").read_text()
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", dockerfile).group(1))
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == uid


def test_kustomization_applies_the_serving_objects(objs: list[dict[str, Any]]) -> None:
    kust = yaml.safe_load((DEPLOY / KUSTOMIZATION).read_text())
    assert kust["kind"] == "Kustomization"
    resources = kust["resources"]
    assert all((DEPLOY / r).is_file() for r in resources), resources
    jobs = {p.name for p in manifest_paths() if any(d and d["kind"] == "Job"
                                                    for d in yaml.safe_load_all(p.read_text()))}
    # every manifest but the Job, which runs once before the replicas (and a Job's template is immutable)
    assert sorted(resources) == sorted(p.name for p in manifest_paths() if p.name not in jobs)
    [c] = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [i["name"] for i in kust["images"]] == [c["image"].split(":")[0]]


def test_readme_names_the_files() -> None:
    readme = (DEPLOY.parents[1] / "README.md").read_text()
    for path in sorted(DEPLOY.glob("*.yaml")):
        assert f"deploy/kubernetes/{path.name}" in readme, path.name
    assert "vt replicas --model" in readme  # the launcher command


def test_readme_steps_push_install_crds_and_fill_the_volume() -> None:
    readme = (DEPLOY.parents[1] / "README.md").read_text()
    block = readme[readme.index("On Kubernetes"):]
    block = block[block.index("```bash") + 7:]
    script = block[:block.index("```")].replace("\\\n", " ")  # continuation lines joined
    commands: list[list[str]] = []
    for line in script.splitlines():  # one command per list, split at && and |
        current: list[str] = []
        for word in shlex.split(line.replace("(", " ").replace(")", " "), comments=True) + ["&&"]:
            if word in ("&&", "|"):
                commands += [current] if current else []
                current = []
            else:
                current.append(word)
    words = [" ".join(c[:2]) for c in commands]
    assert "docker push" in words
    assert any("gateway-api" in " ".join(c) and "standard-install" in " ".join(c) for c in commands)
    assert any("gateway-api-inference-extension/config/crd" in " ".join(c) for c in commands)
    applied = [c for c in commands if c[:2] == ["kubectl", "apply"]]
    assert any("deploy/kubernetes/model-download.yaml" in c for c in applied)
    assert any(c[2:4] == ["-k", "deploy/kubernetes/"] for c in applied)
    waits = [i for i, c in enumerate(commands) if c[:2] == ["kubectl", "wait"]]
    final = next(i for i, c in enumerate(commands) if c[2:3] == ["-k"])
    assert waits and waits[0] < final  # the volume is full before the replicas start
