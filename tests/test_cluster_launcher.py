"""cluster.yaml's commands run for real, as the Ray cluster launcher runs them on a node: setup, then Ray's start,
in a fresh home with a fresh venv — this machine standing in for the head node and a worker node."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.reliability,
              pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                                 reason="the node stand-in needs Linux namespaces (root)")]

CHECK = """
import urllib.error, urllib.request
try:
    urllib.request.urlopen("http://127.0.0.1:8265/api/jobs/", timeout=30)
    print("jobs api open")
except urllib.error.HTTPError as e:
    print("jobs api without the token:", e.code)
import ray
ray.init(address="127.0.0.1:6379", log_to_driver=False)
alive = [n for n in ray.nodes() if n["Alive"]]
assert len(alive) == 2, alive
import amalia_ray, boto3, torch
print("nodes", len(alive), "cpus", ray.cluster_resources()["CPU"], "torch", torch.__version__)
from amalia_ray.cluster.local import resolve_use_gpu
print("device auto on the head:", "GPU" if resolve_use_gpu("auto") else "CPU")
"""


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--mount", "--net", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _checked(commands: list[str]) -> str:
    """Each command in a shell of its own, stopping at the first that fails, as the launcher does (a command's
    status is its last part's: `ulimit -n 65536; ray start …` stands or falls with `ray start`)."""
    return "\n".join(f"bash -c {shlex.quote(c)} || {{ echo FAILED: {shlex.quote(c)}; exit 1; }}" for c in commands)


def _in_namespaces(script: str, env: dict, namespaces: list[str], timeout: int) -> subprocess.CompletedProcess:
    with (log := tempfile.TemporaryFile("w+")):  # a file, not a pipe: Ray's daemons keep what they inherit open
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *namespaces, "bash", "-c", script],
                              env=env, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        log.seek(0)
        done.stdout = log.read()
    return done


def test_setup_and_start_commands_bring_up_a_head_and_a_worker_from_a_fresh_home(tmp_path):
    """What `ray up cluster.yaml` runs on each node, verbatim but for what only a real node has:
    - the launcher's file mounts are copies: the repository's tracked files in ~/amalia-ray, and a token made by
      `ray get-auth-token --generate` in ~/.ray/auth_token (what the user makes once on their machine);
    - uv is already in ~/.local/bin (its installer's host is out of reach here), so `command -v` skips the curl;
    - `.[gpu]` installs as `.`: vLLM's CUDA build has no use on a machine without a GPU;
    - `sudo` is a shim that runs its command (root here), and /mnt is a private tmpfs, so /mnt/shared is created
      out of this machine's sight, and a tmpfs mounted there stands in for the EFS mount (so its setup command
      skips the mount; without anything mounted, the check after it stops the node, which is tested first);
    - Ray starts in its own PID, mount and network namespaces: `ray stop` sees only these nodes, /tmp/ray is its
      own, and ports 6379 and 8265 are free whatever else runs here; the worker joins the head at
      RAY_HEAD_IP=127.0.0.1;
    - the open-files limit stays where this machine caps it (`ulimit -n 65536` fails here, and the launcher, like
      this test, judges `ulimit …; ray start …` by `ray start`).
    Then the Jobs API refuses a request without the token (token auth is on), a driver with the token connects,
    finds both nodes alive, imports the project, boto3 (the autoscaler's, installed by the head setup into the venv)
    and torch from the venv, resolves `device: auto` to GPU (no GPU node is up, but the launcher's config on the head
    says the autoscaler may start some), and `ray stop` from the venv stops them."""
    if not _namespaces_work():
        pytest.skip("unshare cannot make PID, mount and network namespaces here")
    local_wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    if not list(Path(local_wheels).glob("torch-*+cpu-*.whl")):
        pytest.skip(f"no CPU build of torch in {local_wheels}: the node's install would fetch the CUDA build")
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    tools = tmp_path / "tools"
    if subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tools / "uv"), "uv"],
                      timeout=300).returncode != 0:
        pytest.skip("uv cannot be installed here")
    (home / ".local" / "bin" / "uv").symlink_to(tools / "uv" / "bin" / "uv")
    (tools / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    (tools / "sudo").chmod(0o755)
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (home / "amalia-ray" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, home / "amalia-ray" / name)
    # what the launcher writes on the head before starting Ray: the cluster config, defaults filled in, that the
    # autoscaler reads (the AWS part of its bootstrap, keys and IAM roles, needs AWS itself)
    from ray.autoscaler._private.util import prepare_config

    (home / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(prepare_config(config)))

    env = {"HOME": str(home), "PATH": f"{tools}:/usr/local/bin:/usr/bin:/bin",
           # a client of the cluster: token auth, the token where the file mount puts it
           "RAY_HEAD_IP": "127.0.0.1", "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
           # this machine's package sources (its pip reads them from pip.conf; uv from the environment)
           "UV_FIND_LINKS": local_wheels, "UV_NATIVE_TLS": "1",
           **{k: v for k, v in os.environ.items() if k.startswith(("UV_", "SSL_", "http_", "https_", "HTTP", "NO_"))}}
    setup = [c.replace(".[gpu]", ".") for c in config["setup_commands"] + config["head_setup_commands"]
             + config["worker_setup_commands"]]
    (check,) = [c for c in setup if "nothing is mounted" in c]  # not the EFS mount before it: AWS only
    unshared = _in_namespaces("mount -t tmpfs none /mnt\ncd ~\n" + _checked([check]), env, ["--mount"], timeout=60)
    assert unshared.returncode == 1 and "nothing is mounted at /mnt/shared" in unshared.stdout, unshared.stdout
    shared = "mount -t tmpfs none /mnt && mkdir /mnt/shared && mount -t tmpfs none /mnt/shared"
    done = _in_namespaces(f"{shared}\ncd ~\n" + _checked(setup), env, ["--mount"], timeout=900)
    assert done.returncode == 0, done.stdout[-6000:]
    assert (home / "venv" / "bin" / "ray").exists() and not (home / "venv" / "bin" / "pip").is_symlink()
    token = subprocess.run([str(home / "venv" / "bin" / "ray"), "get-auth-token", "--generate"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert token.returncode == 0 and (home / ".ray" / "auth_token").exists(), token.stderr[-2000:]

    # the head in namespaces of its own; the worker in a PID and mount namespace nested in the head's (so its
    # `ray stop` sees only itself), kept alive in the background as a node would be
    private_tmp = "mkdir -p /tmp/ray && mount -t tmpfs none /tmp/ray && cd ~"
    worker = f"{private_tmp}\n{_checked(config['worker_start_ray_commands'])}\ntouch ~/worker.up\nsleep 900"
    script = "\n".join([
        "ip link set lo up", private_tmp, _checked(config["head_start_ray_commands"]),
        f"unshare --pid --fork --mount-proc --mount bash -c {shlex.quote(worker)} &",
        "for _ in $(seq 300); do [ -e ~/worker.up ] && break; kill -0 $! || exit 1; sleep 1; done",
        _checked([f"~/venv/bin/python -c {shlex.quote(CHECK)}", "~/venv/bin/ray stop"]),
        "kill $!"])
    ran = _in_namespaces(script, env, ["--mount", "--net"], timeout=600)
    assert ran.returncode == 0, ran.stdout[-6000:]
    assert "nodes 2" in ran.stdout, ran.stdout[-2000:]
    assert "jobs api without the token: 401" in ran.stdout, ran.stdout[-2000:]
    assert "device auto on the head: GPU" in ran.stdout, ran.stdout[-2000:]
