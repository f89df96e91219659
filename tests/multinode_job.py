"""Run by tests/test_multinode.py in its own process: a three-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head with the job server, and two worker nodes that each fit one training worker),
a recipe submitted to it as a Ray job (`amalia submit --follow`) running data → tokenizer → pack → pretrain,
one worker node removed once training has passed its first checkpoint, and a node added back once the one worker
left has checkpointed; then `amalia status` and `amalia logs` on the finished job.

    python -m tests.multinode_job RECIPE RUN_DIR OUT_DIR
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port

WORKER_NODE_CPUS = 3  # one training worker of 2 CPUs per node


def _registered_checkpoint(run_dir: Path, world_size: int, after: int = 0) -> int | None:
    """The step of the newest checkpoint that `world_size` workers wrote after step `after` and Ray Train has
    registered (so a restart resumes from it, not from an earlier one). The stage may start with one worker —
    what the cluster had free just then — and grow to two."""
    try:
        rec = json.loads((run_dir / "manifest.json").read_text())["stages"]["pretrain"]
        if rec["status"] != "running":
            return None
        snapshot = run_dir / "pretrain" / "ray" / f"pretrain-{rec['fingerprint']}" / "checkpoint_manager_snapshot.json"
        results = json.loads(snapshot.read_text())["checkpoint_results"]
    except (OSError, KeyError, json.JSONDecodeError):
        return None
    steps = [r["metrics"]["step"] for r in results
             if r.get("metrics", {}).get("world_size") == world_size and r["metrics"]["step"] > after]
    return max(steps) if steps else None


def _job_id(log: Path) -> str | None:
    found = re.search(r"\braysubmit_\w+", log.read_text()) if log.exists() else None
    return found.group(0) if found else None


def _last_step(metrics: Path) -> int:
    return max(json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if ln)


def main(recipe: Path, run_dir: Path, out: Path) -> None:
    from ray.cluster_utils import Cluster
    from ray.job_submission import JobStatus, JobSubmissionClient

    dashboard = free_port()
    # distinct agent ports: the test session's own cluster already holds the defaults on this machine
    head = {"num_cpus": 1, "include_dashboard": True, "dashboard_port": dashboard, "dashboard_host": "127.0.0.1",
            "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
            "runtime_env_agent_port": free_port()}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    def add_worker_node():
        return cluster.add_node(num_cpus=WORKER_NODE_CPUS, dashboard_agent_listen_port=free_port(),
                                metrics_export_port=free_port(), runtime_env_agent_port=free_port())

    nodes = [add_worker_node() for _ in range(2)]
    cluster.wait_for_nodes()
    address = f"http://127.0.0.1:{dashboard}"
    result: dict = {"address": address}
    cli = [sys.executable, "-m", "amalia_ray.cli"]
    submit_log = out / "submit.log"  # a file, not a pipe: the followed log is long
    # --no-upload: this machine's environment has the project installed, as a cluster image would (uploading the
    # working directory failed once here with Ray's "package prematurely deleted from the GCS", ray#36703)
    submit = subprocess.Popen(
        [*cli, "submit", str(recipe), "--address", address, "--follow", "--python", sys.executable, "--no-upload",
         "--env", "RAY_AUTH_MODE=disabled"], stdout=submit_log.open("w"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (job_id := _job_id(submit_log)) and submit.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # `amalia submit` prints the job id first
        if not job_id:
            raise RuntimeError(f"submit failed: {submit_log.read_text()[-4000:]}")
        result["job_id"] = job_id
        client = JobSubmissionClient(address)
        metrics = run_dir / "pretrain" / "metrics.jsonl"
        deadline = time.monotonic() + 1500
        while time.monotonic() < deadline:
            status = client.get_job_status(job_id)
            if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                break
            if "removed_at_step" not in result and _registered_checkpoint(run_dir, 2):
                result["removed_at_step"] = _last_step(metrics)
                cluster.remove_node(nodes[1])  # the Train controller sits with the job's driver on the head
            elif ("added_at_step" not in result and "removed_at_step" in result
                  and _registered_checkpoint(run_dir, 1, after=result["removed_at_step"])):
                result["added_at_step"] = _last_step(metrics)
                add_worker_node()  # capacity frees up again: the stage grows back to two workers
            time.sleep(0.5)
        result["status"] = str(client.get_job_status(job_id).value)
        result["logs"] = client.get_job_logs(job_id)[-6000:]
        result["submit"] = {"returncode": submit.wait(timeout=120), "output": submit_log.read_text()[-3000:]}
        for name, command in (("status_cli", "status"), ("logs_cli", "logs")):
            done = subprocess.run([*cli, command, job_id, "--address", address], capture_output=True, text=True,
                                  timeout=120)
            result[name] = {"returncode": done.returncode, "output": done.stdout[-3000:], "stderr": done.stderr[-1000:]}
    finally:
        if submit.poll() is None:
            submit.kill()
        (out / "result.json").write_text(json.dumps(result))
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
