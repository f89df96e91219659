"""Stage orchestration: run the recipe's stages in order under `runs/<name>/`, skipping those whose config and
input contents are unchanged, resuming one that was interrupted, and recording each in the manifest."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import traceback
from contextlib import nullcontext
from pathlib import Path

from pydantic import BaseModel

from amalia_ray.core import secrets
from amalia_ray.core.config import NAME_PATTERN, Recipe
from amalia_ray.core.console import activity, stage_line
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.filesystem import RunStore
from amalia_ray.core.recipe import LoadedRecipe, config_hash
from amalia_ray.core.stop import StageStopped, clear_stop, stop_on_signals, stop_requested
from amalia_ray.core.storage import hash_paths
from amalia_ray.pipeline import stages
from amalia_ray.pipeline.accounting import stage_cost, total_cost
from amalia_ray.pipeline.locks import stage_lock
from amalia_ray.pipeline.manifest import RECORDS, Manifest, Stopwatch, code_hash, code_version, now_iso
from amalia_ray.pipeline.report import write_report
from amalia_ray.pipeline.spec import StageSpec
from amalia_ray.pipeline.tracking import MLFLOW_DIR, NoTracker, Tracker, flatten



def fingerprint_of(cfg: str, inputs: dict[str, str], code: str | None) -> str:
    """A stage's fingerprint; `code` None is a record made before the code was part of it."""
    parts = [cfg, inputs] + ([code] if code else [])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class Pipeline:
    def __init__(self, loaded: LoadedRecipe, run_name: str | None = None, force: bool = False,
                 reuse_stale: bool = False):
        self.loaded = loaded
        self.recipe: Recipe = loaded.recipe
        self.run_name = run_name or self.recipe.run.name
        if not re.fullmatch(NAME_PATTERN, self.run_name):
            raise AmaliaError(f"run name {self.run_name!r}: letters, digits, '.', '_' and '-' only, not starting with "
                              "'.' or '-' (it names the run folder)")
        self.run_dir = (Path(self.recipe.run.output_dir) / self.run_name).resolve()
        self.force, self.reuse_stale = force, reuse_stale
        run = self.recipe.run
        for options in [run.storage_options, *(s.storage_options for s in self.recipe.data.sources)]:
            secrets.remember_in(options)  # so no log line or recorded error shows them
        secrets.remember(os.environ.get(self.recipe.serve.api_key_env))
        for env in self.recipe.key_variables():  # the eval judge's and the judge rewards' keys
            secrets.remember(os.environ.get(env))
        self.store = RunStore(run.storage, run.storage_options, self.run_name) if run.storage else None
        self.own: set[str] = set()  # the stages this process runs: their manifest records are its to write
        self.corpus = None  # listed once, when first needed
        self.base_dir = None  # placed once, when first needed
        if self.store and not (self.run_dir / "manifest.json").exists():  # a fresh machine: carry on the stored run
            self.store.pull("manifest.json", self.run_dir / "manifest.json")
        if self.store:
            self.pull_records()
        self.manifest = Manifest.load_or_new(self.run_dir, self.run_name)
        self.manifest.recipe_path = str(loaded.path)
        self.manifest.recipe_hash = config_hash(self.recipe)
        self.manifest.accounting = self.recipe.accounting.model_dump()
        self.manifest.provenance = list(self.recipe.provenance)
        self.code_version = code_version()
        self.tracker: Tracker = NoTracker()
        self._checked: tuple | None = None  # the selection preflight passed for

    def write_recipe_copy(self) -> None:
        """The recipe as run, beside the manifest; re-dumped with its secrets masked when it holds any."""
        import yaml

        text = self.loaded.path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
        if (masked := secrets.redact(data)) != data:
            text = "# secrets masked by amalia\n" + yaml.safe_dump(masked, sort_keys=False, allow_unicode=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.yaml").write_text(text, encoding="utf-8")

    # ---- paths -------------------------------------------------------------------------------------------------
    def stage_dir(self, name: str) -> Path:
        if not re.fullmatch(NAME_PATTERN, name):
            raise AmaliaError(f"stage name {name!r} would not be a folder inside {self.run_dir}")
        return self.run_dir / name

    def checkpoint_of(self, stage_name: str) -> Path:
        return self.stage_dir(stage_name) / "hf"

    def model_id(self, stage_name: str) -> str:
        return f"{self.run_name}-{stage_name}"

    # ---- stage execution ---------------------------------------------------------------------------------------
    def fingerprint(self, spec: StageSpec) -> tuple[str, str, dict[str, str]]:
        """What a stage's result depends on: its config, its inputs' content and the package's code."""
        cfg = config_hash(*spec.config)
        inputs = hash_paths(dict(sorted(spec.inputs.items())))
        return fingerprint_of(cfg, inputs, code_hash()), cfg, inputs

    # ---- the durable copy (run.storage) -------------------------------------------------------------------------
    def save(self, stage: str) -> None:
        """Record `stage` and rebuild the manifest with what other processes recorded meanwhile; with run.storage,
        other machines' stored records are merged in first, and this stage's record and the manifest are stored."""
        self.own.add(stage)
        if self.store:
            self.pull_records()
        self.manifest.save(self.run_dir, [stage])
        if self.store:
            self.store.push(self.run_dir / RECORDS / f"{stage}.json", f"{RECORDS}/{stage}.json")
            self.store.push(self.run_dir / "manifest.json", "manifest.json")

    def pull_records(self) -> None:
        """The stored records of the stages other processes run (a stage's record has one writer)."""
        incoming = self.run_dir / f".{RECORDS}.{os.getpid()}"
        shutil.rmtree(incoming, ignore_errors=True)
        if self.store.pull(RECORDS, incoming):
            (self.run_dir / RECORDS).mkdir(parents=True, exist_ok=True)
            for f in incoming.glob("*.json"):
                if f.stem not in self.own:
                    os.replace(f, self.run_dir / RECORDS / f.name)
        shutil.rmtree(incoming, ignore_errors=True)

    def pull_missing(self, paths) -> None:
        """Fetch run-folder paths this machine lacks from the store (a run carried on elsewhere)."""
        for path in paths:
            if self.store and not path.exists() and path.is_relative_to(self.run_dir):
                self.store.pull(path.relative_to(self.run_dir).as_posix(), path)

    def push_stage(self, spec: StageSpec) -> None:
        if not self.store:
            return
        folder = self.stage_dir(spec.name)
        # Ray Train wrote its checkpoints to the store itself
        for path in [folder] if folder.exists() else [p for p in spec.outputs.values() if p.exists()]:
            self.store.push(path, path.relative_to(self.run_dir).as_posix(), skip=("ray",))

    def execute(self, spec: StageSpec) -> dict:
        with stage_lock(self.run_dir, spec.name):  # one process at a time per stage of this run
            return self._execute(spec)

    def _execute(self, spec: StageSpec) -> dict:
        self.pull_missing(spec.inputs.values())
        if missing := [f"{k} ({p})" for k, p in spec.inputs.items() if not p.exists()]:
            raise AmaliaError(f"stage '{spec.name}' is missing its input(s) {', '.join(missing)}: run the stages "
                              "that make them first (amalia run --until, or python -m jobs.<stage>)")
        fp, cfg, inputs = self.fingerprint(spec)
        self.manifest.reload_stage(self.run_dir, spec.name)  # what the lock's last holder recorded
        rec = self.manifest.stage(spec.name)
        # completed with the same config and inputs by other code: rerun, unless kept on purpose
        stale = (rec.status == "completed" and rec.fingerprint != fp
                 and rec.fingerprint == fingerprint_of(cfg, inputs, rec.code_hash))
        # a stage that completed without all of its work (the eval stage, a model it could not serve) runs again
        if incomplete := rec.status == "completed" and not rec.done:
            stage_line(spec.name, f"[yellow]running again[/]: its completed run was partial "
                       f"({rec.metrics['incomplete']})")
        if not self.force and rec.done and (rec.fingerprint == fp or (stale and self.reuse_stale)):
            self.pull_missing(spec.outputs.values())
            present = {k: p for k, p in spec.outputs.items() if p.exists()}
            changed = [k for k, h in hash_paths(present).items() if rec.output_hashes.get(k, h) != h]
            if changed:
                stage_line(spec.name, f"its output {', '.join(changed)} changed since the completed run: running "
                           "again")
            elif len(present) == len(spec.outputs):
                if stale:
                    stage_line(spec.name, "[yellow]reused[/]: completed by an older version of the code, kept as "
                               "--reuse-stale asks")
                    rec.reused_stale = code_hash()
                    self.save(spec.name)
                else:
                    stage_line(spec.name, "[green]skipped[/]: inputs, config and code unchanged since the completed "
                               "run")
                if self.store and not self.store.exists(spec.name):  # storage added to a run made without it
                    self.push_stage(spec)
                    self.save(spec.name)
                return rec.metrics
        if rec.status in ("running", "failed", "stopped") and rec.fingerprint == fp:
            stage_line(spec.name, f"[yellow]resuming[/] {'a stopped' if rec.status == 'stopped' else 'an interrupted'}"
                       f" run (attempt {rec.attempts + 1})")
            if rec.cost:  # what the failed attempt burnt still counts
                rec.earlier_attempts_cost = total_cost([rec.earlier_attempts_cost, rec.cost])
        else:
            changed = [what for what, before, now in (("settings", rec.config_hash, cfg), ("inputs", rec.inputs, inputs),
                                                      ("code", rec.code_hash, code_hash())) if before != now]
            if rec.status in ("running", "failed", "stopped") and rec.fingerprint and changed:
                stage_line(spec.name, f"[yellow]starting over[/]: its {rec.status} attempt ran with other "
                           f"{', '.join(changed)}, so its checkpoints are not this run's (for a training stage, a "
                           "change of only how it runs — workers, retries, placement, logging, checkpoints kept — "
                           "resumes)")
            elif not incomplete:  # said above
                stage_line(spec.name, "running again: the code changed since its completed run (--reuse-stale "
                           "keeps such a result)" if stale else "running")
            rec.attempts, rec.earlier_attempts_cost, rec.slurm_jobs = 0, {}, []  # tries at this fingerprint
        rec.status, rec.fingerprint, rec.config_hash, rec.inputs = "running", fp, cfg, inputs
        rec.code_version, rec.resources, rec.started_at, rec.error = self.code_version, spec.resources, now_iso(), None
        rec.code_hash, rec.reused_stale = code_hash(), None
        rec.cost = {}
        rec.attempts += 1
        if (slurm_job := os.environ.get("SLURM_JOB_ID")) and slurm_job not in rec.slurm_jobs:
            rec.slurm_jobs.append(slurm_job)  # to set beside what sacct says the allocation cost
        self.save(spec.name)
        with Stopwatch() as sw, self.tracker.stage(spec.name, self.params_of(spec), spec.metrics_file) as tracked:
            try:
                # a training stage draws its own progress bar from its metrics
                with nullcontext() if spec.metrics_file else activity(spec.name):
                    metrics = spec.body()
            except BaseException as e:
                rec.status = "stopped" if isinstance(e, StageStopped) else "failed"
                rec.error = secrets.mask(f"{type(e).__name__}: {e}")
                # the clock is read once: the recorded wall time and the cost billed on it must agree
                rec.finished_at, rec.wall_time_s = now_iso(), sw.seconds
                rec.metrics = {"traceback": secrets.mask(traceback.format_exc(limit=5)[-2000:])}
                rec.cost = stage_cost(spec.held({}), rec.wall_time_s, None, self.recipe.accounting)
                self.save(spec.name)
                raise
            rec.status, rec.metrics, rec.finished_at, rec.wall_time_s = "completed", metrics, now_iso(), sw.seconds
            rec.cost = stage_cost(spec.held(metrics), rec.wall_time_s, spec.tokens(metrics), self.recipe.accounting)
            tracked.summary({**metrics, "wall_time_s": rec.wall_time_s, "cost": rec.cost})
        rec.outputs = {k: str(p.relative_to(self.run_dir)) if p.is_relative_to(self.run_dir) else str(p)
                       for k, p in spec.outputs.items()}
        rec.output_hashes = hash_paths({k: p for k, p in spec.outputs.items() if p.exists()})
        self.push_stage(spec)  # outputs first: a stored manifest never names outputs that are not stored
        self.save(spec.name)
        stage_line(spec.name, f"[green]done[/] in {sw.seconds:.1f}s")
        return metrics

    def params_of(self, spec: StageSpec) -> dict:
        """What a stage ran with, for the trackers: its recipe sections by name (`stage.lr`, `model.hidden_size`)."""
        names = {id(getattr(self.recipe, f)): f for f in Recipe.model_fields}
        names.update({id(s): "stage" for s in self.recipe.train})
        parts = {names.get(id(part), f"input{i}"): part.model_dump(mode="json", by_alias=True)
                 if isinstance(part, BaseModel) else part for i, part in enumerate(spec.config)}
        return flatten(secrets.redact(parts))

    # ---- the recipe's stages -----------------------------------------------------------------------------------
    def stage_names(self) -> list[str]:
        return [*self.recipe.data_stages, *(s.name for s in self.recipe.train),
                *(["eval"] if self.recipe.train or self.recipe.eval.tasks else [])]

    def select(self, until: str | None = None, only: list[str] | None = None) -> tuple[list[str], list[str]]:
        """(the stages to build, up to the last one that runs; the stages that run)."""
        names = self.stage_names()
        for name in [until, *(only or [])]:
            if name and name not in names:
                raise AmaliaError(f"unknown stage '{name}'; stages of this recipe: {', '.join(names)}")
        if only:
            stop_at = max(names.index(n) for n in only)
            return names[: stop_at + 1], [n for n in names[: stop_at + 1] if n in only]
        stop_at = names.index(until) if until else len(names) - 1
        return names[: stop_at + 1], names[: stop_at + 1]

    def preflight(self, until: str | None = None, only: list[str] | None = None) -> None:
        """Everything that can be checked before any work starts (and before the run folder is written)."""
        stages.preflight(self, needs_serving="eval" in self.select(until, only)[1])
        self._checked = (until, tuple(only or ()))

    def run(self, until: str | None = None, only: list[str] | None = None) -> Path:
        """Run every stage up to and including `until` (all by default), or just the stages in `only` (their
        inputs must exist already: a per-stage job on a cluster), then write the report."""
        built, selected = self.select(until, only)
        if self._checked != (until, tuple(only or ())):
            self.preflight(until, only)
        self.write_recipe_copy()
        clear_stop(self.run_dir)  # a stop asked of an earlier run is not this one's
        self.tracker = Tracker(self.recipe.tracking, self.run_dir, self.run_name,
                               flatten(secrets.redact(self.recipe.model_dump(mode="json", by_alias=True))))
        ok = False
        try:
            with stop_on_signals(self.run_dir), stages.cluster(self):
                for spec in stages.build(self, built):
                    if spec.name in selected:
                        if reason := stop_requested(self.run_dir):
                            raise StageStopped(f"stopped before stage '{spec.name}' ({reason}): run the same "
                                               "recipe again to carry on")
                        self.execute(spec)
            report = write_report(self.run_dir, self.manifest, {s.name: s.objective for s in self.recipe.train})
            ok = True
        finally:
            self.tracker.artifacts([self.run_dir / "recipe.yaml", *([report] if ok else []),
                                    *sorted(self.run_dir.glob("*.png"))])
            self.tracker.close(ok)
        if self.store:
            for f in [report, self.run_dir / "recipe.yaml", *self.run_dir.glob("*.png")]:
                self.store.push(f, f.name)
            if (self.run_dir / MLFLOW_DIR).exists():
                self.store.push(self.run_dir / MLFLOW_DIR, MLFLOW_DIR)
        stage_line("report", f"{report}" + (f" (stored under {self.store.uri})" if self.store else ""))
        return report
