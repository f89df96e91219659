"""A recipe as a Ray job on a multi-node cluster (three Ray nodes on this machine, tests/multinode_job.py in its own
process): data → tokenizer → pack → pretrain with workers SPREAD over the two worker nodes.
Elastic in both directions: one worker node is removed after the first checkpoint and the stage (num_workers
[1, 2]) carries on with the worker that is left from that checkpoint; a node is added back after the next one and
the stage grows to two workers again. The global batch never changes, every step is trained once, the loss curve is
a fixed-size run's, and the job succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import write_recipe

pytestmark = pytest.mark.e2e
STEPS = 60


def test_a_submitted_job_shrinks_and_grows_with_its_worker_nodes(ray_cluster, tmp_path):
    recipe = write_recipe(tmp_path, **{
        "run.name": "multinode", "pack.seq_len": 128,
        "train.0.steps": STEPS, "train.0.num_workers": [1, 2], "train.0.cpus_per_worker": 2,
        "train.0.placement": "SPREAD", "train.0.elastic_resize_interval_s": 5, "train.0.checkpoint_every": 5, "train.0.max_failures": 2,
        "train.0.warmup_steps": 2, "train.0.log_every": 5, "train.0.curriculum": None,
        "eval.tasks": [],  # serving and evaluation over HTTP: test_e2e.py
    })
    run_dir = tmp_path / "runs" / "multinode"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "tests.multinode_job", str(recipe), str(run_dir), str(tmp_path)],
                          cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=1800)
    result = json.loads((tmp_path / "result.json").read_text()) if (tmp_path / "result.json").exists() else {}
    assert proc.returncode == 0 and result.get("status") == "SUCCEEDED", (
        result.get("logs", "")[-4000:], proc.stdout[-2000:], proc.stderr[-3000:])
    assert result.get("removed_at_step"), "a worker node was removed during training"

    manifest = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert list(manifest) == ["data", "tokenizer", "pack", "pretrain"]
    assert all(rec["status"] == "completed" for rec in manifest.values())
    history = [json.loads(ln) for ln in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines() if ln]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1)), "every step once, across the restarts"
    two = [h for h in history if h["world_size"] == 2]
    assert two and all(h["worker_nodes"] == 2 for h in two), "SPREAD: one worker per node"
    assert result.get("added_at_step"), "a worker node was added back during training"
    shrunk = [h for h in history if result["removed_at_step"] < h["step"] <= result["added_at_step"]]
    assert shrunk and shrunk[-1]["world_size"] == 1, "carried on with the worker that was left"
    restart = shrunk[0]["attempt_start_step"]
    assert restart >= two[0]["step"] and restart % 5 == 0, "from a checkpoint the two workers wrote"
    grown = [h for h in history if h["step"] > result["added_at_step"]]
    assert grown and grown[-1]["world_size"] == 2 and grown[-1]["worker_nodes"] == 2, "grew back to two workers"
    assert grown[0]["attempt_start_step"] % 5 == 0 and grown[0]["attempt_start_step"] >= restart
    assert all(h["tokens"] == history[0]["tokens"] for h in history), "same global batch with one worker or two"
    fixed = _fixed_size_losses(recipe, run_dir, tmp_path)
    assert [h["step"] for h in fixed] == [h["step"] for h in history]
    for got, want in zip(history, fixed):
        assert abs(got["loss"] - want["loss"]) <= 1e-3 * max(1.0, abs(want["loss"])), (got, want)

    report = (run_dir / "report.md").read_text()
    assert "2 on 2 node(s) → 1 on 1 node(s) → 2 on 2 node(s), SPREAD" in report, "where the workers were"
    pretrain_cost = manifest["pretrain"]["cost"]
    assert 1 < pretrain_cost["held"]["CPU"] <= 4, "between one and two 2-CPU workers, weighted by time"


def _fixed_size_losses(recipe: Path, run_dir: Path, tmp_path: Path) -> list[dict]:
    """The same pretraining on two workers throughout, on the test session's cluster, from the elastic run's own
    packed data (its data stage records carried over, so only pretraining runs)."""
    import shutil

    import yaml

    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline
    from tests.conftest import read_jsonl

    data = yaml.safe_load(recipe.read_text())
    data["run"]["name"] = "fixed"
    data["train"][0].update(num_workers=2, cpus_per_worker=1, placement="PACK")
    fixed_recipe = tmp_path / "fixed.yaml"
    fixed_recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    fixed_dir = run_dir.parent / "fixed"
    fixed_dir.mkdir()
    for stage in ("data", "tokenizer", "pack"):
        shutil.copytree(run_dir / stage, fixed_dir / stage)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(run_name="fixed", stages={k: manifest["stages"][k] for k in ("data", "tokenizer", "pack")})
    (fixed_dir / "manifest.json").write_text(json.dumps(manifest))
    pipeline = Pipeline(load_recipe(fixed_recipe))
    pipeline.run(until="pretrain")
    assert pipeline.manifest.stages["pack"].attempts == manifest["stages"]["pack"]["attempts"], "pack reused"
    return read_jsonl(fixed_dir / "pretrain" / "metrics.jsonl")
