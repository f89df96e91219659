"""Security: the API key is enforced (tests/test_serve_config.py, and over real HTTP in tests/test_e2e.py), the
dashboard and Serve bind to loopback by default, checkpoints load only as safetensors or with weights_only=True,
nothing a recipe (or a stored run) names lands outside the run folder, and secrets reach no file and no log."""

from __future__ import annotations

import ast
import json
import logging
import re
import uuid
from pathlib import Path

import fsspec
import fsspec.implementations.memory
import pytest
import yaml
from typer.testing import CliRunner

from amalia_ray.cli import app
from amalia_ray.core import secrets
from amalia_ray.core.config import ServeConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.filesystem import RunStore
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.runner import Pipeline, StageSpec
from tests.conftest import ROOT, write_recipe

pytestmark = pytest.mark.reliability

SECRET = "sk-amalia-" + uuid.uuid4().hex


def python_files():
    for folder in ("amalia_ray", "jobs", "bench"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
            yield node, owner, name


def test_no_unsafe_deserialization_anywhere():
    """torch.load only with weights_only=True, no pickle/marshal loads, no yaml.load, no remote code: a checkpoint
    or a data file from elsewhere can never run code here (weights themselves are read as safetensors)."""
    found = []
    for path in python_files():
        for node, owner, name in calls(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            kwargs = {k.arg: k.value for k in node.keywords}
            if owner == "torch" and name == "load":
                safe = kwargs.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    found.append(f"{where} torch.load without weights_only=True")
            if owner in ("pickle", "marshal", "dill", "cloudpickle") and name in ("load", "loads"):
                found.append(f"{where} {owner}.{name}")
            if owner == "yaml" and name in ("load", "load_all", "unsafe_load"):
                found.append(f"{where} yaml.{name}")
            remote = kwargs.get("trust_remote_code")
            if isinstance(remote, ast.Constant) and remote.value is True:
                found.append(f"{where} trust_remote_code=True")
    assert not found, found


def test_loopback_by_default(monkeypatch):
    """Serve binds to 127.0.0.1 unless told otherwise, and the embedded Ray's dashboard (which runs submitted jobs)
    listens on loopback only. (tests/test_e2e.py checks the sockets of a real `amalia serve`.)"""
    import ray

    from amalia_ray.cluster import local

    assert ServeConfig().host == "127.0.0.1"
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8})
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(local, "billable_cpus", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with local.ray_session():
        pass
    assert seen["dashboard_host"] == "127.0.0.1" and seen["include_dashboard"] is True
    serve_help = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200).output
    assert "127.0.0.1" in serve_help


@pytest.mark.parametrize("field,value", [
    ("run.name", "../outside"), ("run.name", "a/b"), ("run.name", "/etc"), ("train.0.name", "../../x"),
    ("train.0.name", ".."), ("data.sources.0.name", "../src"), ("eval.tasks.0.name", "sub/task"),
])
def test_recipe_names_cannot_leave_the_run_folder(tmp_path, field, value):
    recipe = write_recipe(tmp_path, **{field: value})
    shown = re.sub(r"\.(\d+)", r"[\1]", field)  # how errors name a field: train[0].name
    with pytest.raises(AmaliaError, match=re.escape(f"{shown}: String should match pattern")):
        load_recipe(recipe)


def test_run_name_given_on_the_command_line_is_checked_too(tmp_path):
    with pytest.raises(AmaliaError, match="run name '../../etc'"):
        Pipeline(load_recipe(write_recipe(tmp_path)), run_name="../../etc")


def test_a_stored_run_cannot_write_outside_the_run_folder(tmp_path):
    """A key with `..` in the store (a tampered bucket) is refused when pulled, nothing written outside."""
    uri = f"memory://bucket-{uuid.uuid4().hex[:8]}/runs"
    store = RunStore(uri, None, "r")
    memory = fsspec.filesystem("memory")
    memory.pipe(f"{store.root}/thing/ok.txt", b"ok")
    memory.pipe(f"{store.root}/thing/../../../../../../../../{tmp_path}/escaped.txt", b"x")
    with pytest.raises(AmaliaError, match="would be written outside"):
        store.pull("thing", tmp_path / "run" / "thing")
    assert not (tmp_path / "escaped.txt").exists()
    assert not list((tmp_path / "run").iterdir()), "nothing of the refused folder is left, whole or in part"


def test_a_pull_cut_short_leaves_nothing_a_later_attempt_would_take_for_whole(tmp_path, monkeypatch):
    """A job preempted while it pulls a stage's folder from run.storage: the folder is copied beside its place and
    renamed once whole, so the next attempt, which pulls what is missing, finds it missing and pulls it again."""
    import pyarrow.fs as pafs

    from amalia_ray.core import filesystem

    uri = f"memory://bucket-{uuid.uuid4().hex[:8]}/runs"
    store = RunStore(uri, None, "r")
    memory = fsspec.filesystem("memory")
    for i in range(3):
        memory.pipe(f"{store.root}/pack/shard-{i}.parquet", b"x" * 10)
    copied, copy = [], pafs.copy_files

    def preempted(*args, **kwargs):
        if len(copied) == 2:
            raise OSError("preempted")
        copied.append(args[0])
        return copy(*args, **kwargs)

    monkeypatch.setattr(filesystem.pafs, "copy_files", preempted)
    with pytest.raises(AmaliaError, match="preempted"):
        store.pull("pack", tmp_path / "run" / "pack")
    assert not list((tmp_path / "run").iterdir()), "no partial pack/ (two of its three shards) left in place"
    monkeypatch.setattr(filesystem.pafs, "copy_files", copy)
    assert store.pull("pack", tmp_path / "run" / "pack")
    assert sorted(f.name for f in (tmp_path / "run" / "pack").iterdir()) == [f"shard-{i}.parquet" for i in range(3)]
    # two jobs on one shared filesystem pull the same folder: the one renamed second keeps the first one's
    replace = filesystem.os.replace

    def beaten(source, target):
        Path(target).mkdir()
        (Path(target) / "theirs").write_text("x")
        return replace(source, target)

    monkeypatch.setattr(filesystem.os, "replace", beaten)
    assert store.pull("pack", tmp_path / "other" / "pack")
    assert [f.name for f in (tmp_path / "other").iterdir()] == ["pack"], "its own copy removed"
    assert [f.name for f in (tmp_path / "other" / "pack").iterdir()] == ["theirs"]


def test_secrets_reach_no_file_and_no_log(tmp_path, monkeypatch, caplog, capsys):
    """Storage credentials in the recipe and the API key in the environment: the run folder (recipe copy,
    manifest, report), the store, the failure recorded for a stage and every log line hold none of them."""
    api_key = "key-" + uuid.uuid4().hex
    monkeypatch.setenv("AMALIA_API_KEY", api_key)
    uri = f"memory://bucket-{uuid.uuid4().hex[:8]}/runs"
    recipe = write_recipe(tmp_path, **{"run.storage": uri, "run.storage_options": {"secret_key": SECRET}})
    monkeypatch.setattr(fsspec.implementations.memory.MemoryFileSystem, "__init__",
                        lambda self, *a, **kw: super(type(self), self).__init__())  # takes no credentials itself
    p = Pipeline(load_recipe(recipe))
    out = p.stage_dir("thing")

    def leaky():
        logging.getLogger("amalia_ray.test").warning(f"connecting with {SECRET} and {api_key}")
        raise RuntimeError(f"auth failed for secret_key={SECRET}")

    p.write_recipe_copy()
    with caplog.at_level(logging.INFO):
        secrets.install_log_masking()
        with pytest.raises(RuntimeError):
            p.execute(StageSpec("thing", [1], {}, {"out": out}, leaky, {"CPU": 1}))
        out.mkdir(parents=True)
        p.execute(StageSpec("thing2", [1], {}, {"out": out}, lambda: {"n": 1}, {"CPU": 1}))
    copy = yaml.safe_load((p.run_dir / "recipe.yaml").read_text())
    assert copy["run"]["storage_options"] == {"secret_key": "***"}, "the recipe copy is masked"
    assert "auth failed for secret_key=***" in p.manifest.stages["thing"].error
    logged = caplog.text + "".join(caplog.messages)
    assert "connecting with *** and ***" in logged
    everything = [f.read_bytes() for f in p.run_dir.rglob("*") if f.is_file()]
    everything += [fsspec.filesystem("memory").cat(f) for f in fsspec.filesystem("memory").find(p.store.root)]
    everything += [logged.encode(), "".join(capsys.readouterr()).encode()]
    for blob in everything:
        assert SECRET.encode() not in blob and api_key.encode() not in blob


def test_error_messages_are_masked_on_the_command_line(tmp_path, monkeypatch):
    """An error that happens to quote a secret (here a path that holds the API key) prints it masked."""
    monkeypatch.setenv("AMALIA_API_KEY", SECRET)
    recipe = write_recipe(tmp_path, **{"data.sources.0.paths": [f"/nonexistent/{SECRET}/*.txt"]})
    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 1 and "corpus path not found" in result.output
    assert SECRET not in result.output and "/nonexistent/***/*.txt" in result.output


@pytest.mark.parametrize("error", [AmaliaError, RuntimeError])
def test_a_failing_job_prints_its_error_masked(tmp_path, monkeypatch, capsys, error):
    """A Ray job's log is readable by anyone with the dashboard: `python -m jobs.pipeline` and `jobs.serve` print an
    error that quotes a secret (an expected one, or any other with its traceback) masked, and exit 1."""
    from jobs import pipeline as job

    monkeypatch.setenv("AMALIA_API_KEY", SECRET)

    def leak(self, **_):
        raise error(f"the request with 'Authorization: Bearer {SECRET}' failed")

    monkeypatch.setattr(Pipeline, "run", leak)
    assert job.main([str(write_recipe(tmp_path))]) == 1
    printed = capsys.readouterr()
    assert "Authorization: Bearer ***" in printed.err and SECRET not in printed.err + printed.out


def test_an_embedded_ray_refuses_anyone_without_its_token(tmp_path):
    """Ray 2.60 listens on every interface whatever node address it is given, so the embedded cluster keeps token
    auth on with a random token of its own (in no file). Probed from outside, with no token, every port off
    loopback refuses (gRPC UNAUTHENTICATED or HTTP 401: the GCS, the raylet's node manager and object manager,
    every worker, the dashboard agent's log service and job API, the runtime-env agent): no Prometheus exporter
    answers (the node's, which names the run's tasks, actors and deployments, nor the dashboard's and the autoscaler
    monitor's own); its own task runs."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token
    proc = subprocess.run([sys.executable, "-m", "tests.embedded_auth_probe"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["task"] == "ran" and seen["mode"] == "token"
    assert not (tmp_path / ".ray").exists(), "the session token is written nowhere"
    answers = {(p["process"], p["port"]): p["answers"] for p in seen["ports"]}
    assert any(p == "gcs_server" for p, _ in answers), answers
    for (process, port), got in answers.items():
        assert "OK" not in got.values() and got["http job"] not in (200, 201), (process, port, got)
        assert "UNAUTHENTICATED" in got.values() or 401 in got.values(), (process, port, got)
    refused = {(process, service) for (process, _), got in answers.items() for service, answer in got.items()
               if answer in ("UNAUTHENTICATED", 401)}
    assert {("gcs_server", "gcs"), ("raylet", "node manager"), ("raylet", "object manager"),
            ("ray::DashboardAgent", "agent logs")} <= refused, answers  # its HTTP API, when up at probe time,
    # is held to the rule above
    assert any(process.startswith("ray::") and service == "core worker" for process, service in refused), answers


def test_secrets_of_every_shape_reach_no_file_of_the_run(tmp_path, monkeypatch, caplog):
    """Secrets known by their key (a service account's whole mapping, a connection string, s3fs's `key` and
    `secret`) or by their value (a URI's password, a Hugging Face token, wherever they are): planted in a recipe's
    storage options, then the run's recipe copy, MLflow store and offline W&B run (their params are the recipe's),
    a stage's params, the records, manifest and report of a stage that failed quoting them and of one whose metrics
    quote them, and the log are scanned for each; the driver log is readable by its owner only."""
    import os

    from amalia_ray.core.config import TrackingConfig, WandbConfig
    from amalia_ray.core.console import quiet_output
    from amalia_ray.pipeline.tracking import Tracker, flatten

    pytest.importorskip("wandb")

    pem = uuid.uuid4().hex
    planted = {"private key": pem, "connection string": "AccountKey=" + uuid.uuid4().hex,
               "s3 key": "AKIA" + uuid.uuid4().hex[:16].upper(), "s3 secret": uuid.uuid4().hex,
               "URI password": "pw" + uuid.uuid4().hex[:12], "HF token": "hf_" + uuid.uuid4().hex + "abcd"}
    options = {"key": planted["s3 key"], "secret": planted["s3 secret"],
               "connection_string": planted["connection string"],
               "token": {"type": "service_account", "private_key": f"-----BEGIN PRIVATE KEY-----\n{pem}\n-----END "
                         "PRIVATE KEY-----"},
               "endpoint_url": f"https://bob:{planted['URI password']}@s3.example.org",
               "note": f"mirrored with {planted['HF token']}"}
    loaded = load_recipe(write_recipe(tmp_path, **{"data.sources.0.storage_options": options}))
    p = Pipeline(loaded)
    p.write_recipe_copy()
    tracking = TrackingConfig(wandb=WandbConfig(project="amalia", mode="offline"))
    tracker = Tracker(tracking, p.run_dir, p.run_name,
                      flatten(secrets.redact(loaded.recipe.model_dump(mode="json", by_alias=True))))
    secrets.install_log_masking()
    with quiet_output(p.run_dir / "logs") as log, caplog.at_level(logging.INFO):
        logging.getLogger("amalia_ray.test").warning("storage options %s", options)
        with tracker.stage("data", flatten(secrets.redact({"storage_options": options})), None):
            pass
        tracker.close(ok=True)
    # a stage that fails quoting them, one whose metrics quote them: its record, the manifest and the report
    from amalia_ray.pipeline.report import write_report

    quoted = (f"s3://bob:{planted['URI password']}@s3.example.org/crawl {planted['HF token']} "
              f"{planted['s3 secret']} {planted['connection string']}")

    def fails():
        raise OSError(f"storage said no: {quoted}")

    with pytest.raises(OSError):
        p.execute(StageSpec("data", [], {}, {}, fails, {}))
    p.execute(StageSpec("tokenizer", [], {}, {}, lambda: {"listed_from": quoted, "next_token": {"acc": 0.4375}}, {}))
    assert "tokenizer" in write_report(p.run_dir, p.manifest).read_text()
    recorded = json.loads((p.run_dir / "manifest.json").read_text())["stages"]["tokenizer"]
    assert recorded["metrics"]["next_token"] == {"acc": 0.4375}, "a metric named like a secret key stays readable"
    assert os.stat(log).st_mode & 0o777 == 0o600
    assert list(p.run_dir.rglob("mlflow.db")), "the MLflow store is in the run folder"
    assert list(p.run_dir.rglob("*.wandb")), "and the offline W&B run"
    blobs = [f.read_bytes() for f in p.run_dir.rglob("*") if f.is_file()] + [caplog.text.encode()]
    for name, value in planted.items():
        assert not [b for b in blobs if value.encode() in b], name


class _Plant:
    """A pickle that creates a file when it is loaded: what a planted state file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_sweep_restores_only_tune_state_signed_with_this_machines_key(ray_cluster, tmp_path, monkeypatch):
    """Tune restores a sweep from files it pickled. A state file planted in the experiment folder is unpickled by
    Tune's own restore; before ours, every state file is replaced by the copy the sweep's driver signed, so the plant
    is never read; nor is a failed trial's error.pkl (deleted as it is written, and before a restore: the error is
    read from its error.txt). A damaged copy, a list signed with another key or no list at all is refused, naming
    the fix."""
    from ray import cloudpickle, tune

    from amalia_ray.pipeline.sweep_state import (SIGNED_DIR, SIGNED_LIST, TUNER_FILE, SignTuneState,
                                                  restore_signed_state, sign_state)

    monkeypatch.setenv("AMALIA_CHECKPOINT_KEY", "the-sweeps-key")

    def trainable(config):
        for step in range(1, 4):
            tune.report({"score": config["x"] * step, "step": step})
            if config["x"] == 2:
                raise ValueError("a trial that fails")

    experiment, signed = tmp_path / "tune", tmp_path / SIGNED_DIR
    tuner = tune.Tuner(trainable, param_space={"x": tune.grid_search([1, 2, 3])},
                       run_config=tune.RunConfig(name="tune", storage_path=str(tmp_path), verbose=0,
                                                 callbacks=[SignTuneState()]))
    sign_state([experiment / TUNER_FILE], signed)
    results = tuner.fit()
    assert sorted(r.metrics["score"] for r in results if not r.error) == [3, 9]
    assert [str(r.error) for r in results if r.error] and "a trial that fails" in str(
        next(r.error for r in results if r.error)), "read from its error.txt"
    assert not list(experiment.glob("*/error.pkl")), "the pickled error is not left to be read"
    names = set(json.loads((signed / SIGNED_LIST).read_text())["files"])
    assert TUNER_FILE in names and any(n.startswith("experiment_state-") for n in names), names

    marker = tmp_path / "planted-code-ran"
    plant = {"runner_data": {"_type": "CLOUDPICKLE_FALLBACK", "value": cloudpickle.dumps(_Plant(marker)).hex()}}
    planted = experiment / "experiment_state-9999-12-31_23-59-59.json"  # the newest: the one Tune reads
    planted.write_text(json.dumps(plant))
    tune.Tuner.restore(str(experiment), trainable=trainable)
    assert marker.exists(), "Tune's own restore runs the planted pickle: the danger this guards against"
    marker.unlink()

    planted.write_text(json.dumps(plant))
    failed = next(p.parent for p in experiment.glob("*/error.txt"))
    (failed / "error.pkl").write_bytes(cloudpickle.dumps(_Plant(marker)))  # the failed trial's, replaced
    assert restore_signed_state(experiment)
    assert not planted.exists() and not (failed / "error.pkl").exists()
    restored = tune.Tuner.restore(str(experiment), trainable=trainable, resume_unfinished=True, resume_errored=False)
    assert sorted(r.metrics["score"] for r in restored.fit() if not r.error) == [3, 9]
    assert not marker.exists()

    copy = next(f for f in signed.iterdir() if f.name.endswith(".json") and "experiment_state-" in f.name)
    copy.write_bytes(copy.read_bytes().replace(b'"runner_data"', b'"runner_dat4"'))
    with pytest.raises(AmaliaError, match="signed copy of 'experiment_state-.*' is missing or damaged"):
        restore_signed_state(experiment)
    monkeypatch.setenv("AMALIA_CHECKPOINT_KEY", "another-key")
    with pytest.raises(AmaliaError, match="not signed with this machine's key.*AMALIA_CHECKPOINT_KEY"):
        restore_signed_state(experiment)
    (signed / SIGNED_LIST).unlink()
    with pytest.raises(AmaliaError, match=f"is missing.*remove {experiment}"):
        restore_signed_state(experiment)
    assert not marker.exists()
