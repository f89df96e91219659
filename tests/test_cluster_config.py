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


def test_device_auto_counts_the_gpu_nodes_the_autoscaler_may_start(monkeypatch, tmp_path):
    """cluster.yaml's GPU workers start at 0: a job on its head sees no GPU up, yet `device: auto` must train on the
    GPU nodes the autoscaler will start (the launcher leaves its config on the head), not on the head's CPUs."""
    from amalia_ray.cluster import local

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    monkeypatch.setattr(local, "LAUNCHER_CONFIG", tmp_path / "absent.yaml")
    assert not local.resolve_use_gpu("auto") and local.resolve_use_gpu("cuda"), "no GPU up, none to start"
    monkeypatch.setattr(local, "LAUNCHER_CONFIG", ROOT / "cluster.yaml")
    assert local.launcher_gpus(ROOT / "cluster.yaml") == 32 * 8 == local.cluster_gpus(), "what the preflight counts"
    assert local.resolve_use_gpu("auto") and not local.resolve_use_gpu("cpu")
    for broken in ("available_node_types: [", "available_node_types: {gpu: {resources: {GPU: 8}}}\nmax_workers: 0",
                   "[1, 2]", "available_node_types: {a: {resources: {GPU: x}, max_workers: 2}}"):
        (tmp_path / "launcher.yaml").write_text(broken)
        assert local.launcher_gpus(tmp_path / "launcher.yaml") == 0, broken
    (tmp_path / "launcher.yaml").write_text("max_workers: 3\nhead_node_type: head\navailable_node_types: "
                                            "{gpu: {resources: {GPU: 2}}, head: {resources: {GPU: 1}}}")
    assert local.launcher_gpus(tmp_path / "launcher.yaml") == 6, "a type without max_workers: the cluster's (the head: 0)"


def test_cluster_yaml_is_sized_for_the_9b_recipe_and_runs_ray_from_its_python_311_venv():
    import re
    import tomllib

    from packaging.specifiers import SpecifierSet

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    recipe = yaml.safe_load((ROOT / "recipes" / "amalia-9b.yaml").read_text())
    asked = max(max(s["num_workers"]) if isinstance(s["num_workers"], list) else s["num_workers"]
                for s in recipe["train"])
    gpu_nodes = [n for n in config["available_node_types"].values() if n["resources"].get("GPU")]
    assert sum(n["max_workers"] * n["resources"]["GPU"] for n in gpu_nodes) >= asked
    assert config["max_workers"] >= sum(n["max_workers"] for n in gpu_nodes)
    for node in gpu_nodes:  # EFA on every network card of the GPU nodes, for NCCL across nodes
        assert all(i["InterfaceType"] == "efa" for i in node["node_config"]["NetworkInterfaces"])
    commands = [c for key in ("setup_commands", "head_setup_commands", "worker_setup_commands",
                              "head_start_ray_commands", "worker_start_ray_commands") for c in config[key]]
    # the launcher's defaults would install boto3 into the system pip: the keys are set, so they are replaced
    assert "head_setup_commands" in config and "worker_setup_commands" in config
    for command in commands:
        for call in re.findall(r"(\S*\bray) (?:start|stop)", command):
            assert call == "~/venv/bin/ray", f"ray outside the venv: {command}"
        assert not re.search(r"(^|[;&|] *)(sudo )?pip3? install", command), f"system pip: {command}"
    (version,) = {v for c in commands for v in re.findall(r"--python (3\.\d+)", c)}
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert version in SpecifierSet(required)


def test_the_9b_recipe_reads_and_writes_where_every_cluster_file_mounts_the_shared_filesystem():
    """One path for the shared filesystem in every cluster file, and the 9B recipe's run folder, corpus and datasets
    under it: a path only one node has would leave checkpoints where the other nodes cannot read them."""
    recipe = yaml.safe_load((ROOT / "recipes" / "amalia-9b.yaml").read_text())
    paths = [recipe["run"]["output_dir"], *(p for s in recipe["data"]["sources"] for p in s["paths"]),
             *(s["dataset"] for s in recipe["train"] if isinstance(s.get("dataset"), str))]
    launcher = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    (mount, checked) = [c for c in launcher["setup_commands"] if "mountpoint -q" in c]
    target = mount.split()[-2].rstrip(";")  # `mount -t nfs4 … SERVER:/ TARGET; }`
    assert "nothing is mounted" in checked and target == checked.split("mountpoint -q ")[1].split()[0]
    mounts = {"cluster.yaml": target}
    for name in ("raycluster.yaml", "rayjob.yaml"):
        spec = yaml.safe_load((ROOT / "deploy" / "kuberay" / name).read_text())["spec"]
        spec = spec.get("rayClusterSpec", spec)
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            for container in group["template"]["spec"]["containers"]:
                (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "shared"]
                mounts[f"{name} {container['name']}"] = mount
    assert len(set(mounts.values())) == 1, mounts
    (shared,) = set(mounts.values())
    assert all(p.startswith(shared + "/") for p in paths), [p for p in paths if not p.startswith(shared + "/")]


def test_a_broken_cluster_yaml_is_caught_by_the_same_check():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["available_node_types"]["head"]["max_workers"] = "eight"
    with pytest.raises(jsonschema.ValidationError, match="'eight' is not of type 'integer'"):
        jsonschema.validate(config, schema)


# Field names of KubeRay's ray.io/v1 CRDs (RayCluster, RayJob) for the parts our manifests use: a misspelt or
# made-up field fails here rather than being silently pruned by the API server.
RAY_CLUSTER_SPEC = {"rayVersion", "enableInTreeAutoscaling", "autoscalerOptions", "headGroupSpec", "workerGroupSpecs",
                    "suspend", "managedBy", "authOptions"}
AUTH_OPTIONS = {"mode", "secretName", "enableK8sTokenAuth"}
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
        _check_efa_container(container, f"{where}: {group['groupName']}")
    for params in [head["rayStartParams"], *(g["rayStartParams"] for g in groups)]:
        assert all(isinstance(v, str) for v in params.values()), f"{where}: rayStartParams values are strings"
    # the head takes no work and, placed on a GPU node, must not count (or see) the GPUs a worker pod holds
    (head_container,) = head["template"]["spec"]["containers"]
    assert head["rayStartParams"]["num-cpus"] == head["rayStartParams"]["num-gpus"] == "0", where
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in head_container["env"], where
    assert spec["enableInTreeAutoscaling"] is True and spec["rayVersion"] == ray.__version__
    # token auth through authOptions, so KubeRay also gives the token to the autoscaler sidecar it injects
    auth = spec["authOptions"]
    assert set(auth) <= AUTH_OPTIONS and auth["mode"] == "token" and auth["secretName"], where
    containers = [*head["template"]["spec"]["containers"], *(c for g in groups for c in g["template"]["spec"]["containers"])]
    assert not [e for c in containers for e in c.get("env", []) if e["name"].startswith("RAY_AUTH")], (
        f"{where}: RAY_AUTH_* set by hand would reach the Ray containers but not the autoscaler")


def _check_efa_container(container: dict, where: str) -> None:
    """A GPU worker pod of the KubeRay files gets the node's EFA interfaces (requested = limit, as extended
    resources must be), NCCL's EFA settings exactly as fabric.py states them, and may pin memory for RDMA."""
    from amalia_ray.train.fabric import EFA_ENV, EFA_LIBRARY_PATH

    resources = container["resources"]
    assert int(resources["limits"]["vpc.amazonaws.com/efa"]) >= 1, where
    assert resources["requests"]["vpc.amazonaws.com/efa"] == resources["limits"]["vpc.amazonaws.com/efa"], where
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert {k: env.get(k) for k in EFA_ENV} == EFA_ENV, where
    assert env["LD_LIBRARY_PATH"].startswith(EFA_LIBRARY_PATH + ":"), where
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"], where


def test_gpu_nodes_of_every_cluster_file_run_nccl_over_efa():
    """cluster.yaml's worker nodes start Ray (whose workers inherit its environment) with NCCL's EFA settings and
    the aws-ofi-nccl plugin on the library path; the image installs libfabric and the plugin. (The KubeRay files'
    pods are checked by _check_cluster_spec.)"""
    import shlex

    from amalia_ray.train.fabric import EFA_ENV, EFA_LIBRARY_PATH

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    (start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    exports = dict(w.split("=", 1) for part in start.split(";") if part.strip().startswith("export ")
                   for w in shlex.split(part.strip())[1:])
    assert {k: exports.get(k) for k in EFA_ENV} == EFA_ENV, start
    assert exports["LD_LIBRARY_PATH"] == EFA_LIBRARY_PATH + ":$LD_LIBRARY_PATH", start
    assert start.index("export ") < start.index("ray start"), "set before Ray starts, so its workers inherit it"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "efa_installer.sh -y --skip-kmod" in dockerfile and "efa-installer.amazonaws.com" in dockerfile


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


@pytest.mark.reliability
def test_every_cluster_file_runs_ray_with_token_auth_and_no_dashboard_open_to_all():
    """Anyone who reaches a dashboard without token auth can run code on the cluster: cluster.yaml starts every node
    with RAY_AUTH_MODE=token and the token mounted where Ray reads it, its dashboard on the head's loopback; the
    KubeRay manifests turn on token auth through authOptions and keep the head service inside the cluster."""
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2 and all("RAY_AUTH_MODE=token " in c for c in starts), starts
    (head,) = [c for c in starts if "--head" in c]
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head, head
    assert config["file_mounts"].get("/home/ubuntu/.ray/auth_token") == "~/.ray/auth_token"
    assert config["auth"]["ssh_user"] == "ubuntu", "the token is mounted into the ssh user's home"
    cluster = yaml.safe_load((ROOT / "deploy" / "kuberay" / "raycluster.yaml").read_text())["spec"]
    job = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayjob.yaml").read_text())["spec"]["rayClusterSpec"]
    for where, spec in (("raycluster.yaml", cluster), ("rayjob.yaml", job)):
        assert spec["authOptions"]["mode"] == "token", where
        assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP", where


def test_the_image_python_satisfies_the_project_and_the_build_context_leaves_local_state_out():
    import re
    import tomllib

    from packaging.specifiers import SpecifierSet

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    (image,) = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    name, tag = image.rsplit(":", 1)
    assert name == "rayproject/ray" and tag.startswith(f"{ray.__version__}-"), image
    (py,) = re.findall(r"-py3(\d+)", tag)
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f"3.{py}" in SpecifierSet(required), (image, required)
    ignored = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".venv", "runs", ".git"} <= ignored, "COPY . must not take the virtualenv, run folders or history"


@pytest.mark.reliability
def test_a_jobs_upload_leaves_out_the_repository_history_and_local_secrets(tmp_path):
    """`amalia submit` uploads the working directory with Ray's own packager: built here with our excludes, the
    package holds the code and not .git, .env files, keys, runs or environments."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    from amalia_ray.cluster.jobs import EXCLUDES

    work = tmp_path / "project"
    for name in ("amalia_ray/__init__.py", "recipes/demo.yaml", ".git/config", ".git/objects/ab/cd", ".env",
                 ".env.local", "deploy/key.pem", "runs/demo/manifest.json", ".venv/bin/python"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    create_package(str(work), tmp_path / "pkg.zip", include_gitignore=True, excludes=EXCLUDES)
    names = {n.rstrip("/") for n in zipfile.ZipFile(tmp_path / "pkg.zip").namelist()}
    assert {"amalia_ray/__init__.py", "recipes/demo.yaml"} <= names
    assert not {n for n in names if n.split("/")[0] in (".git", ".env", ".env.local", "runs", ".venv")
                or n.endswith(".pem")}, names


@pytest.mark.reliability
def test_the_image_and_the_launchers_copy_leave_out_what_a_jobs_upload_does(tmp_path):
    """`docker build` (.dockerignore) and the cluster launcher's rsync of the project to every node (cluster.yaml's
    rsync_exclude) leave out what `amalia submit` does: a developer's .env, keys and .netrc never reach an image
    layer or a node. The launcher's list is given to rsync as it is: rsync run with it copies none of them."""
    import shutil
    import subprocess

    from amalia_ray.cluster.jobs import EXCLUDES

    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    missing = [p for p in EXCLUDES if not {p, f"{p}/", f"**/{p}", f"**/{p}/"} & ignored]
    assert not missing, f".dockerignore lacks {missing}"
    launcher = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert set(launcher["rsync_exclude"]) == set(EXCLUDES)
    if not shutil.which("rsync"):  # the lists above are checked; rsync itself only where it is installed
        return
    work = tmp_path / "project"
    for name in ("amalia_ray/__init__.py", ".env", "deploy/.env.local", "deploy/key.pem", ".netrc", "runs/x/a.txt",
                 "ckpt/model.safetensors", ".git/config"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("x")
    subprocess.run(["rsync", "-a", *(f"--exclude={p}" for p in launcher["rsync_exclude"]), f"{work}/",
                    str(tmp_path / "node")], check=True)
    copied = {str(p.relative_to(tmp_path / "node")) for p in (tmp_path / "node").rglob("*") if p.is_file()}
    assert copied == {"amalia_ray/__init__.py"}
