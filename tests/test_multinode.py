"""A recipe as a Ray job on a multi-node cluster (three Ray nodes on this machine, tests/multinode_job.py in its own
process): `amalia submit --follow` runs the pipeline, its data stages carried over from the demo run (their manifest
records and folders: curation on Ray Data is the demo's to test), pretraining with workers SPREAD over the two worker
nodes, and `amalia status` / `amalia logs` read the job back.
Elastic in both directions: one worker node is removed after the first checkpoint and the stage (num_workers
[1, 2]) carries on with the worker that is left from that checkpoint; a node is added back after the next one and
the stage grows to two workers again. The global batch never changes, every step is trained once, the loss curve is
the fixed-size demo run's (the same recipe on two workers throughout), and the job succeeds. And a hub base model
trained on a node whose own Hugging Face cache lacks it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import DATA_STAGES, DEMO_PRETRAIN_METRICS, STEPS, carry_over_data_stages, read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.reliability]


def test_a_hub_base_model_trains_on_a_node_whose_cache_does_not_have_it(tmp_path):
    """Two Ray nodes with Hugging Face caches of their own (tests/hub_cache_job.py, in its own process): the hub model
    is in the head's cache only, the worker node's is empty and offline. Placed in the run folder as the pipeline
    places it, the head's cache then deleted, the model trains on the worker node and exports."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HF_HOME", "HF_HUB_OFFLINE")} | {
        "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "tests.hub_cache_job", str(tmp_path)], cwd=Path(__file__).parents[1],
                          env=env, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "result.json").read_text()) if (tmp_path / "result.json").exists() else {}
    assert proc.returncode == 0 and "error" not in result and result, (result.get("error"), proc.stderr[-3000:])
    assert Path(result["base"]).is_relative_to(tmp_path / "run" / "hub"), "read from the run folder, not a cache"
    assert not (tmp_path / "head-hf").exists() and result["worker_caches"] == [], "no cache was read or filled"
    assert result["steps"] == [1, 2] and result["metrics"]["worker_nodes"] == 1
    assert "config.json" in result["exported"] and any(f.endswith(".safetensors") for f in result["exported"])


# the suite's longest scenario (over three minutes on two cores): `make test-all` runs it, `make test` does not
@pytest.mark.slow
def test_a_submitted_job_shrinks_and_grows_with_its_worker_nodes(demo_run, recipe_path, tmp_path):
    data = yaml.safe_load(recipe_path.read_text())
    data["run"].update(name="multinode", output_dir=str(tmp_path / "runs"))
    data["train"][0].update(num_workers=[1, 2], cpus_per_worker=2, placement="SPREAD", elastic_resize_interval_s=5,
                            checkpoint_every=5, max_failures=2, log_every=5)
    data["eval"]["tasks"] = []  # serving and evaluation over HTTP: test_e2e.py
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = tmp_path / "runs" / "multinode"
    carried = carry_over_data_stages(demo_run, run_dir)
    # Right after a node goes, Ray Train's elastic policy may still count its CPUs and wait for a worker group of
    # the old size until its start-up timeout (60 s by default) before it retries with what is left; workers start
    # in seconds on these nodes, so the test waits 30 s at most
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "RAY_AUTH_MODE": "disabled", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}
    proc = subprocess.run([sys.executable, "-m", "tests.multinode_job", str(recipe), str(run_dir), str(tmp_path)],
                          cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=1800)
    result = json.loads((tmp_path / "result.json").read_text()) if (tmp_path / "result.json").exists() else {}
    assert proc.returncode == 0 and result.get("status") == "SUCCEEDED", (
        result.get("logs", "")[-4000:], proc.stdout[-2000:], proc.stderr[-3000:])
    job_id = result["job_id"]
    assert job_id.startswith("raysubmit_")
    assert result["submit"]["returncode"] == 0 and f"job {job_id}: SUCCEEDED" in " ".join(
        result["submit"]["output"].split()), (
        "`amalia submit --follow` streamed the job to its end", result["submit"])
    status = result["status_cli"]
    assert status["returncode"] == 0 and json.loads(status["output"])["status"] == "SUCCEEDED", status
    assert result["logs_cli"]["returncode"] == 0 and "report: " in result["logs_cli"]["output"]
    assert result.get("removed_at_step"), "a worker node was removed during training"

    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert list(manifest) == ["data", "tokenizer", "pack", "pretrain"]
    assert all(rec["status"] == "completed" for rec in manifest.values())
    assert all(manifest[k]["attempts"] == carried["stages"][k]["attempts"] for k in DATA_STAGES), \
        "the data stages were carried over, not run again"
    history = read_jsonl(run_dir / "pretrain" / "metrics.jsonl")
    assert [h["step"] for h in history] == list(range(1, STEPS + 1)), "every step once, across the restarts"
    two = [h for h in history if h["world_size"] == 2]
    assert two and all(h["worker_nodes"] == 2 for h in two), "SPREAD: one worker per node"
    assert result.get("added_at_step"), "a worker node was added back during training"
    # the attempts by where they started (a step trained again by a later attempt keeps only its later record)
    restart = next(h for h in history if h["step"] > result["removed_at_step"])["attempt_start_step"]
    assert restart >= two[0]["step"] and restart % 5 == 0, "from a checkpoint the two workers wrote"
    shrunk = [h for h in history if h["attempt_start_step"] == restart]
    assert shrunk and all(h["world_size"] == 1 for h in shrunk), "carried on with the worker that was left"
    grown = [h for h in history if h["attempt_start_step"] > restart]
    assert grown and all(h["world_size"] == 2 and h["worker_nodes"] == 2 for h in grown), "grew back to two workers"
    assert grown[0]["attempt_start_step"] % 5 == 0 and grown[-1]["step"] == STEPS
    assert all(h["tokens"] == history[0]["tokens"] for h in history), "same global batch with one worker or two"
    fixed = read_jsonl(recipe_path.parent / DEMO_PRETRAIN_METRICS)  # the same stage on two workers throughout
    assert [h["step"] for h in fixed] == [h["step"] for h in history] and {h["world_size"] for h in fixed} == {2}
    for got, want in zip(history, fixed):
        assert abs(got["loss"] - want["loss"]) <= 1e-3 * max(1.0, abs(want["loss"])), (got, want)

    report = (run_dir / "report.md").read_text()
    assert "2 on 2 node(s) → 1 on 1 node(s) → 2 on 2 node(s), SPREAD" in report, "where the workers were"
    pretrain_cost = manifest["pretrain"]["cost"]
    assert 1 < pretrain_cost["held"]["CPU"] <= 4, "between one and two 2-CPU workers, weighted by time"
