"""Experiment tracking: what the MLflow store holds after a run's stages, and the calls W&B's client gets."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from amalia_ray.core.config import TrackingConfig, WandbConfig
from amalia_ray.pipeline.tracking import Tracker, default_mlflow_uri, flatten


def _append(path: Path, *records: dict) -> None:
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_mlflow_keeps_a_nested_run_per_stage_with_every_step_its_params_and_the_run_files(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr("amalia_ray.pipeline.tracking.FOLLOW_POLL_S", 0.2)
    tracker = Tracker(TrackingConfig(), tmp_path, "demo", {"train.0.lr": 0.003, "model.hidden_size": 256})
    metrics = tmp_path / "pretrain" / "metrics.jsonl"
    metrics.parent.mkdir()
    with tracker.stage("pretrain", {"stage.lr": 0.003, "stage.steps": 4}, follow=metrics) as stage:
        _append(metrics, {"step": 1, "loss": 4.0, "lr": 1e-4}, {"step": 2, "loss": 3.5, "lr": 2e-4})
        time.sleep(0.6)  # the follower forwards these while the stage runs
        _append(metrics, {"step": 3, "loss": 3.0, "val_loss/faq": 3.2, "worker_layout": "2 on 1 node(s)"})
        time.sleep(0.6)
        # a restarted attempt cuts the file back to its checkpoint (step 2) and trains step 3 again, then 4
        metrics.write_text(json.dumps({"step": 1, "loss": 4.0}) + "\n" + json.dumps({"step": 2, "loss": 3.5}) + "\n")
        _append(metrics, {"step": 3, "loss": 2.9}, {"step": 4, "loss": 2.5})
        with metrics.open("a") as f:
            f.write('{"step": 5, "lo')  # half a line: never read as a record
        stage.summary({"tokens_trained": 4096, "loss": 2.5, "cost": {"gpu_hours": 0.0, "usd": 0.01}})
    with pytest.raises(RuntimeError), tracker.stage("sft", {"stage.lr": 2e-5}):
        raise RuntimeError("worker died")
    report = tmp_path / "report.md"
    report.write_text("# report\n")
    tracker.artifacts([report, tmp_path / "absent.png"])
    tracker.close(ok=True)

    client = MlflowClient(tracking_uri=default_mlflow_uri(tmp_path))
    experiment = client.get_experiment_by_name("demo")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"demo", "pretrain", "sft"}
    parent, pretrain, sft = runs["demo"], runs["pretrain"], runs["sft"]
    assert parent.data.params == {"train.0.lr": "0.003", "model.hidden_size": "256"}
    assert pretrain.data.tags["mlflow.parentRunId"] == sft.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert (parent.info.status, pretrain.info.status, sft.info.status) == ("FINISHED", "FINISHED", "FAILED")
    assert pretrain.data.params["stage.steps"] == "4"
    history = client.get_metric_history(pretrain.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 4.0), (2, 3.5), (3, 3.0), (4, 2.5)]
    assert [m.step for m in client.get_metric_history(pretrain.info.run_id, "val_loss/faq")] == [3]
    assert pretrain.data.metrics["tokens_trained"] == 4096 and pretrain.data.metrics["cost.usd"] == 0.01
    assert "worker_layout" not in pretrain.data.metrics
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == ["report.md"]


def test_a_second_invocation_adds_a_run_to_the_same_experiment(tmp_path):
    from mlflow.tracking import MlflowClient

    for _ in range(2):
        Tracker(TrackingConfig(), tmp_path, "demo", {}).close(ok=True)
    client = MlflowClient(tracking_uri=default_mlflow_uri(tmp_path))
    assert len(client.search_runs([client.get_experiment_by_name("demo").experiment_id])) == 2


def test_weights_and_biases_gets_one_run_per_stage_grouped_by_the_run(tmp_path, monkeypatch):
    calls: list = []

    class Run:
        def __init__(self, **kwargs):
            self.kwargs, self.logged, self.saved, self.exit_code = kwargs, [], [], None
            self.summary = {}
            calls.append(self)

        def log(self, values, step):
            self.logged.append((step, values))

        def save(self, path, base_path, policy):
            self.saved.append(Path(path).name)

        def finish(self, exit_code=0):
            self.exit_code = exit_code

    fake = types.SimpleNamespace(init=lambda **kw: Run(**kw), Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = TrackingConfig(mlflow=False, wandb=WandbConfig(project="amalia", mode="offline"))
    tracker = Tracker(cfg, tmp_path, "demo", {"run.seed": 1})
    metrics = tmp_path / "metrics.jsonl"
    _append(metrics, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5})
    with tracker.stage("pretrain", {"stage.lr": 0.003}, follow=metrics) as stage:
        stage.summary({"tokens_trained": 10})
    (tmp_path / "report.md").write_text("r")
    tracker.artifacts([tmp_path / "report.md"])
    tracker.close(ok=True)
    stage_run, report_run = calls
    assert stage_run.kwargs | {"settings": None} == {
        "project": "amalia", "entity": None, "mode": "offline", "group": "demo", "name": "demo/pretrain",
        "job_type": "pretrain", "config": {"stage.lr": 0.003}, "dir": str(tmp_path), "reinit": "create_new",
        "settings": None}
    assert stage_run.logged == [(1, {"loss": 2.0}), (2, {"loss": 1.5})]
    assert stage_run.summary == {"tokens_trained": 10.0} and stage_run.exit_code == 0
    assert report_run.kwargs["job_type"] == "report" and report_run.saved == ["report.md"]


def test_real_weights_and_biases_client_writes_an_offline_run(tmp_path):
    pytest.importorskip("wandb")
    cfg = TrackingConfig(mlflow=False, wandb=WandbConfig(project="amalia", mode="offline"))
    tracker = Tracker(cfg, tmp_path, "demo", {})
    metrics = tmp_path / "metrics.jsonl"
    _append(metrics, {"step": 1, "loss": 2.0})
    with tracker.stage("pretrain", {}, follow=metrics):
        pass
    tracker.close(ok=True)
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 0


def test_flatten_names_nested_params_by_path():
    assert flatten({"train": [{"lr": 0.1, "rewards": ["a", "b"]}], "seed": 1}) == {
        "train.0.lr": 0.1, "train.0.rewards": ["a", "b"], "seed": 1}


def test_a_deleted_run_folder_gets_a_new_store_in_the_same_process(tmp_path):
    """A long-lived process (a service, a notebook) that deletes a run folder and runs it again."""
    import shutil

    from mlflow.tracking import MlflowClient

    Tracker(TrackingConfig(), tmp_path / "run", "demo", {}).close(ok=True)
    shutil.rmtree(tmp_path / "run")
    Tracker(TrackingConfig(), tmp_path / "run", "demo", {}).close(ok=True)
    assert (tmp_path / "run" / "mlruns" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=default_mlflow_uri(tmp_path / "run"))
    assert len(client.search_runs([client.get_experiment_by_name("demo").experiment_id])) == 1

