"""Faults, end to end on the session's Ray cluster: the driver killed mid-stage, and the same recipe run twice giving
the same data hashes and (before the kill) the same loss at every step. Elsewhere: training workers lost with their
node (tests/test_multinode.py), a checkpoint upload that fails half way and a damaged checkpoint in the bucket
(tests/test_e2e.py, on S3), a Serve replica killed during an evaluation (tests/test_e2e_serving.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.runner import Pipeline
from tests.conftest import DEMO_PRETRAIN_METRICS, STEPS, read_jsonl, write_recipe

pytestmark = [pytest.mark.e2e, pytest.mark.reliability]

EVERY = 5  # checkpoint interval of the fault runs
# the demo run's pretraining (tests/conftest.py), checkpointed more often and in the background (each checkpoint
# written while the next step trains, as on GPU): none of these changes a loss
FAULT_STAGE = {"train.0.steps": STEPS, "train.0.checkpoint_every": EVERY, "train.0.warmup_steps": 5,
               "train.0.checkpoint_async": True}


def fault_recipe(recipe_path: Path, folder: str, **overrides) -> Path:
    """The e2e run's recipe (same run folder, so the data stages are reused) with the fault runs' pretraining."""
    where = recipe_path.parent / folder
    where.mkdir()
    return write_recipe(where, **{"run.name": "e2e", "run.output_dir": str(recipe_path.parent / "runs"),
                                  **FAULT_STAGE, **overrides})


@pytest.fixture(scope="module")
def uninterrupted(demo_run, recipe_path) -> list[dict]:
    """The fault runs' pretraining trained straight through: the demo run's own, kept before these tests train that
    stage again in the same run folder."""
    history = read_jsonl(recipe_path.parent / DEMO_PRETRAIN_METRICS)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1)) and {h["attempt_start_step"] for h in history} == {0}
    return history


def assert_same_losses(history: list[dict], reference: list[dict], tolerance: float) -> None:
    assert [h["step"] for h in history] == [h["step"] for h in reference]
    for got, want in zip(history, reference):
        assert abs(got["loss"] - want["loss"]) <= tolerance * max(1.0, abs(want["loss"])), (got["step"], got, want)


def test_a_killed_driver_resumes_from_its_checkpoint_at_the_same_losses(demo_run, recipe_path, uninterrupted):
    """`amalia run` SIGKILLed mid-stage, past a checkpoint (its Ray job and workers die with it): the manifest shows
    the stage as interrupted, and running it again resumes from that checkpoint, not step 0. The loss at every step
    equals the uninterrupted run's: bit for bit before the kill (the same recipe run twice, each from step 0),
    within 1e-4 after the restart, the final step included; the checkpoints were written in the background.
    (Workers lost inside a run, to nodes going away and
    coming back, Ray Train restarting them from the latest checkpoint: tests/test_multinode.py.)"""
    import ray

    recipe = fault_recipe(recipe_path, "kills", **{"train.0.max_failures": 0})
    run_dir = recipe_path.parent / "runs" / "e2e"
    metrics = run_dir / "pretrain" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # the earlier history of this stage
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    log = recipe.parent / "driver.log"
    driver = subprocess.Popen([sys.executable, "-m", "amalia_ray.cli", "run", str(recipe), "--until", "pretrain"],
                              env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    driver.log = log
    # killed at a random step past its interval's registered checkpoint
    target = random.Random(int(os.environ.get("AMALIA_FAULT_SEED", "8"))).randint(EVERY + 1, 3 * EVERY - 1)
    _wait(lambda: (step := _last_step(metrics)) >= target and _registered_step(run_dir) >= step // EVERY * EVERY,
          f"step {target} and its checkpoint", driver)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    killed_at = _last_step(metrics)
    _wait(lambda: not _training_workers(), "the killed job's workers to go")
    rec = json.loads((run_dir / "manifest.json").read_text())["stages"]["pretrain"]
    assert rec["status"] == "running" and rec["attempts"] == 1, "interrupted, not failed"
    resumable = _last_registered_checkpoint(run_dir, rec["fingerprint"])

    resumed = Pipeline(load_recipe(recipe))
    resumed.run(until="pretrain")
    rec = resumed.manifest.stages["pretrain"]
    assert rec.status == "completed" and rec.attempts == 2, "the driver's kill took a second run"
    history = read_jsonl(metrics)
    starts = sorted({h["attempt_start_step"] for h in history})  # where each attempt began
    assert len(starts) == 2 and starts[0] == 0, (starts, resumable, killed_at)
    assert 0 < resumable <= starts[1] <= killed_at and starts[1] % EVERY == 0, (
        "the second run starts from the last checkpoint, not step 0", starts, resumable, killed_at)
    assert [h["loss"] for h in history[:starts[1]]] == [h["loss"] for h in uninterrupted[:starts[1]]], "reproducible"
    assert_same_losses(history, uninterrupted, 1e-4)
    assert abs(history[-1]["loss"] - uninterrupted[-1]["loss"]) <= 1e-4


def test_the_same_recipe_twice_gives_the_same_data(demo_run, recipe_path):
    """Reproducibility: the demo run's recipe run again under another run name, the data stages from scratch —
    identical output hashes of the data, tokenizer and pack stages. (The same loss at every step from the same
    data: test_a_killed_driver_resumes_from_its_checkpoint_at_the_same_losses, before the kill.)"""
    first = json.loads((recipe_path.parent / "runs" / "e2e" / "manifest.json").read_text())["stages"]
    again = Pipeline(load_recipe(recipe_path), run_name="e2e-again")
    again.run(until="pack")
    for name in ("data", "tokenizer", "pack"):
        assert again.manifest.stages[name].attempts == 1, f"{name} ran again from scratch"
        assert again.manifest.stages[name].output_hashes == first[name]["output_hashes"], name


def _training_workers() -> list:
    from ray._private.worker import get_dashboard_url
    from ray.util.state import list_actors

    # this session's cluster by address: `amalia serve` in a subprocess may run a second one
    return list_actors(address=f"http://{get_dashboard_url()}",
                       filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])


def _wait(condition, what: str, alive=None, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if alive is not None and not (alive.is_alive() if hasattr(alive, "is_alive") else alive.poll() is None):
            log = getattr(alive, "log", None)
            pytest.fail(f"the run ended while waiting for {what}" + (f": {log.read_text()[-2000:]}" if log else ""))
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _last_step(metrics: Path) -> int:
    try:
        return json.loads(metrics.read_text().splitlines()[-1])["step"]
    except (OSError, IndexError, json.JSONDecodeError, KeyError):
        return 0


def _last_registered_checkpoint(run_dir: Path, fingerprint: str) -> int:
    snapshot = run_dir / "pretrain" / "ray" / f"pretrain-{fingerprint}" / "checkpoint_manager_snapshot.json"
    return max(int(r["metrics"]["step"]) for r in json.loads(snapshot.read_text())["checkpoint_results"])


def _registered_step(run_dir: Path) -> int:
    """The step of the latest checkpoint the running pretrain stage's Ray Train controller has registered."""
    try:
        rec = json.loads((run_dir / "manifest.json").read_text())["stages"]["pretrain"]
        if rec["status"] != "running":
            return -1
        snapshot = run_dir / "pretrain" / "ray" / f"pretrain-{rec['fingerprint']}" / "checkpoint_manager_snapshot.json"
        results = json.loads(snapshot.read_text())["checkpoint_results"]
        return max(int(r["metrics"]["step"]) for r in results) if results else -1
    except (OSError, KeyError, ValueError, TypeError):
        return -1
