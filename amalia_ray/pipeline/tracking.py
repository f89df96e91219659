"""Experiment tracking through the trackers' own clients: MLflow (by default a SQLite store in the run folder) and
Weights & Biases when the recipe names a project.

One MLflow run per `amalia run`, named after the run, with a nested run per stage that ran: the stage's recipe
sections as params, every metric the stage logs per step (followed live from the `metrics.jsonl` the training loop
appends), its final metrics and cost; the recipe, the report and its plots are artifacts of the parent. W&B has no
nesting: each stage is a W&B run grouped by the run's name. Tracking never fails a stage that is training: a
tracker that stops answering mid-stage is reported once and the stage carries on."""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from amalia_ray.core.config import TrackingConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.formats.step_metrics import step_record

log = logging.getLogger("amalia_ray.tracking")
MLFLOW_DIR = "mlruns"
# MLflow's limits: a param value's length, params and metrics per call
PARAM_CHARS, PARAMS_PER_CALL, METRICS_PER_CALL = 6000, 100, 1000
FOLLOW_POLL_S = 2.0  # how often a training stage's new metrics reach the trackers


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as dotted keys (`train.0.lr`), the way params and summaries are named."""
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    if isinstance(data, list | tuple) and any(isinstance(v, dict | list) for v in data):
        return {k: v for i, value in enumerate(data) for k, v in flatten(value, f"{prefix}{i}.").items()}
    return {prefix[:-1]: data} if prefix else {}


def numbers(record: dict) -> dict[str, float]:
    """The finite numeric values of a (flattened) record: what a tracker can plot."""
    return {k: float(v) for k, v in flatten(record).items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def default_mlflow_uri(run_dir: Path) -> str:
    return f"sqlite:///{(run_dir / MLFLOW_DIR / 'mlflow.db').resolve()}"


class _MLflow:
    def __init__(self, uri: str | None, run_dir: Path, run_name: str, params: dict[str, Any]):
        for name in ("mlflow", "alembic"):  # schema creation and store notices are not the user's business
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        artifacts = None
        if uri is None:
            (run_dir / MLFLOW_DIR).mkdir(parents=True, exist_ok=True)
            uri, artifacts = default_mlflow_uri(run_dir), (run_dir / MLFLOW_DIR / "artifacts").resolve().as_uri()
            if not (run_dir / MLFLOW_DIR / "mlflow.db").exists():
                _forget_engine(uri)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(run_name)
        if experiment is None:
            try:
                experiment_id = self.client.create_experiment(run_name, artifact_location=artifacts)
            except Exception:  # noqa: BLE001 - another stage job of this run created it first
                experiment_id = self.client.get_experiment_by_name(run_name).experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.experiment_id = experiment_id
        self.parent = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.params(self.parent, params)

    def params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], json.dumps(v) if not isinstance(v, str) else v) for k, v in params.items()]
        items = [Param(p.key, p.value[:PARAM_CHARS]) for p in items]
        for i in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=items[i:i + PARAMS_PER_CALL])

    def start_stage(self, name: str, params: dict[str, Any]) -> str:
        run_id = self.client.create_run(self.experiment_id, run_name=name,
                                        tags={"mlflow.parentRunId": self.parent, "stage": name}).info.run_id
        self.params(run_id, params)
        return run_id

    def log(self, run_id: str, records: list[dict]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(r.get("step", 0))) for r in records for k, v in numbers(r).items()
                   if k != "step"]
        for i in range(0, len(metrics), METRICS_PER_CALL):
            self.client.log_batch(run_id, metrics=metrics[i:i + METRICS_PER_CALL])

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.parent, str(path))

    def end(self, run_id: str | None, ok: bool) -> None:
        self.client.set_terminated(run_id or self.parent, status="FINISHED" if ok else "FAILED")


def _forget_engine(uri: str) -> None:
    """MLflow keeps one database engine (and store) per URI for the life of the process; after the run folder was
    deleted, both still believe the schema exists and the new database file gets no tables. Drop them."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    engine = getattr(SqlAlchemyStore, "_engine_map", {}).pop(uri, None)
    if engine is not None:
        engine.dispose()
        _tracking_store_registry._get_store_with_resolved_uri.cache_clear()  # the stores built on it


class _WandB:
    def __init__(self, cfg, run_dir: Path, run_name: str, params: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise AmaliaError("tracking.wandb is set but the wandb package is not installed: pip install wandb") from None
        self.wandb, self.cfg, self.run_dir, self.run_name, self.recipe = wandb, cfg, run_dir, run_name, params

    def _init(self, name: str, job_type: str, config: dict):
        return self.wandb.init(project=self.cfg.project, entity=self.cfg.entity, mode=self.cfg.mode,
                               group=self.run_name, name=f"{self.run_name}/{name}", job_type=job_type,
                               config=config, dir=str(self.run_dir), reinit="create_new",
                               settings=self.wandb.Settings(quiet=True, console="off"))

    def start_stage(self, name: str, params: dict[str, Any]):
        return self._init(name, name, params)

    def log(self, run, records: list[dict]) -> None:
        for r in records:
            values = {k: v for k, v in numbers(r).items() if k != "step"}
            run.log(values, step=int(r["step"])) if "step" in r else run.summary.update(values)

    def artifacts(self, paths: list[Path]) -> None:
        run = self._init("report", "report", self.recipe)  # the run's own files: a run of their own (no nesting)
        for path in paths:
            run.save(str(path), base_path=str(path.parent), policy="now")
        run.finish()

    def end(self, run, ok: bool) -> None:
        if run is not None:
            run.finish(exit_code=0 if ok else 1)


class StageRun:
    """The trackers' runs of one stage."""

    def __init__(self, runs: list[tuple[Any, Any]]):
        self.runs = runs
        self._warned = False
        self.per_step: set[str] = set()  # metrics already logged step by step
        self.follower: _Follower | None = None

    def log(self, records: list[dict]) -> None:
        self.per_step.update(k for r in records if "step" in r for k in r)
        for backend, run in self.runs:
            try:
                backend.log(run, records)
            except Exception as e:  # noqa: BLE001 - a tracker's outage must not stop a training stage
                if not self._warned:
                    log.warning(f"tracking: {type(backend).__name__.strip('_')} did not take the stage's metrics "
                                f"({type(e).__name__}: {e}); the stage carries on, its metrics.jsonl keeps them")
                    self._warned = True

    def summary(self, metrics: dict) -> None:
        """A stage's final metrics (no step): data counts, eval scores, cost; not those already logged per step
        (a training stage's last loss is its last step's)."""
        if self.follower:
            self.follower.drain()  # the stage's last records first
        self.log([{k: v for k, v in flatten(metrics).items() if k != "step" and k not in self.per_step}])


class _Follower(threading.Thread):
    """Forwards the records a training stage appends to its metrics.jsonl, as they appear."""

    def __init__(self, path: Path, stage: StageRun):
        super().__init__(daemon=True)
        self.path, self.stage, self.poll_s = path, stage, FOLLOW_POLL_S
        self.offset, self.last_step, self.last_line = 0, -1, b""
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # the thread and the stage's end both drain

    def run(self) -> None:
        while not self.stopping.wait(self.poll_s):
            self.drain()

    def drain(self) -> None:
        with self.lock:
            self._drain()

    def _drain(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(max(0, self.offset - len(self.last_line)))
                if f.read(len(self.last_line)) != self.last_line:  # rewritten since (a restart cut it back)
                    self.offset, self.last_line = 0, b""
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
        if not whole:
            return
        self.offset += len(whole)
        self.last_line = whole[whole.rfind(b"\n", 0, len(whole) - 1) + 1:]
        records = []
        for line in whole.decode("utf-8", "replace").splitlines():
            record = step_record(line)
            if record is not None and record["step"] > self.last_step:  # each step once: trackers keep steps rising
                records.append(record)
                self.last_step = record["step"]
        if records:
            self.stage.log(records)


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, params: dict[str, Any]):
        self.backends: list = []
        if cfg.mlflow:
            self.backends.append(_MLflow(cfg.mlflow_uri, run_dir, run_name, params))
        if cfg.wandb:
            self.backends.append(_WandB(cfg.wandb, run_dir, run_name, params))

    @contextmanager
    def stage(self, name: str, params: dict[str, Any], follow: Path | None = None) -> Iterator[StageRun]:
        stage = StageRun([(b, b.start_stage(name, params)) for b in self.backends])
        follower = stage.follower = _Follower(follow, stage) if follow and self.backends else None
        if follower:
            follower.start()
        ok = False
        try:
            yield stage
            ok = True
        finally:
            if follower:
                follower.stopping.set()
                follower.join()
                follower.drain()
            for backend, run in stage.runs:
                backend.end(run, ok)

    def artifacts(self, paths: list[Path]) -> None:
        """Files of the whole run (recipe, report, plots), on the parent run."""
        for backend in self.backends:
            backend.artifacts([p for p in paths if p.exists()])

    def close(self, ok: bool) -> None:
        for backend in self.backends:
            backend.end(None, ok)


class NoTracker(Tracker):
    def __init__(self):
        self.backends = []
