"""cluster.yaml against the Ray cluster launcher's own schema (ray/autoscaler/ray-schema.json in the ray wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from tests.conftest import ROOT


def test_cluster_yaml_validates_against_the_launcher_schema():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    nodes = config["available_node_types"]
    assert nodes[config["head_node_type"]]["resources"].get("GPU", 0) == 0, "a CPU head"
    gpu_types = [n for n in nodes.values() if n["resources"].get("GPU", 0) >= 8]
    assert gpu_types and all(0 <= n["min_workers"] <= n["max_workers"] for n in gpu_types)
    assert any("pip install" in c and ".[gpu]" in c for c in config["setup_commands"])


def test_a_broken_cluster_yaml_is_caught_by_the_same_check():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["available_node_types"]["head"]["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'"):
        jsonschema.validate(config, schema)


# Field names of KubeRay's ray.io/v1 CRDs (RayCluster, RayJob) for the parts our manifests use: a misspelt or
# made-up field fails here rather than being silently pruned by the API server.
RAY_CLUSTER_SPEC = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
                    "suspend", "managedBy"}
AUTOSCALER_OPTIONS = {"idleTimeoutSeconds", "upscalingMode", "resources", "image", "imagePullPolicy", "env"}
HEAD_GROUP = {"serviceType", "rayStartParams", "template", "enableIngress"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template", "numOfHosts",
                "suspend"}
RAY_JOB_SPEC = {"entrypoint", "runtimeEnvYAML", "submissionMode", "shutdownAfterJobFinishes",
                "ttlSecondsAfterFinished", "backoffLimit", "rayClusterSpec", "clusterSelector", "activeDeadlineSeconds",
                "suspend"}


def _check_cluster_spec(spec: dict, where: str) -> None:
    assert set(spec) <= RAY_CLUSTER_SPEC, (where, set(spec) - RAY_CLUSTER_SPEC)
    assert set(spec.get("autoscalerOptions", {})) <= AUTOSCALER_OPTIONS, where
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP and head["template"]["spec"]["containers"], where
    groups = spec["workerGroupSpecs"]
    assert groups, where
    for group in groups:
        assert set(group) <= WORKER_GROUP, (where, set(group) - WORKER_GROUP)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], (where, group["groupName"])
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8", where
    for params in [head["rayStartParams"], *(g["rayStartParams"] for g in groups)]:
        assert all(isinstance(v, str) for v in params.values()), f"{where}: rayStartParams values are strings"
    assert spec["enableInTreeAutoscaling"] is True and spec["rayVersion"] == ray.__version__


def test_kuberay_manifests_use_crd_fields_and_autoscale_between_min_and_max():
    cluster = yaml.safe_load((ROOT / "deploy" / "kuberay" / "raycluster.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    _check_cluster_spec(cluster["spec"], "raycluster.yaml")
    job = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert set(job["spec"]) <= RAY_JOB_SPEC, set(job["spec"]) - RAY_JOB_SPEC
    assert job["spec"]["submissionMode"] in {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
    assert job["spec"]["entrypoint"].startswith("python -m jobs.pipeline ")
    assert isinstance(yaml.safe_load(job["spec"]["runtimeEnvYAML"]), dict)
    _check_cluster_spec(job["spec"]["rayClusterSpec"], "rayjob.yaml")
