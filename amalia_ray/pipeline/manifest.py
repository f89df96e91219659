"""The run manifest: `runs/<name>/manifest.json`, one entry per stage with what it read, wrote and cost.

A stage is skipped when its fingerprint (config hash + input content hashes) matches a completed entry.

Stage jobs of one run may finish at the same moment in different processes (`python -m jobs.<stage>`), so a stage's
record is written on its own, to `manifest.d/<stage>.json`, by the one process running that stage, and
`manifest.json` is rebuilt from every record under a lock: no process writes back its stale copy of another
stage's record. On object storage the records are separate objects too, merged when read.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

import amalia_ray
from amalia_ray.core import secrets
from amalia_ray.core.storage import write_json

# what decides skips and resumes: compared whole, never masked
HASHES = frozenset({"fingerprint", "config_hash", "code_hash", "inputs", "output_hashes", "recipe_hash"})
Status = Literal["pending", "running", "completed", "failed", "stopped", "skipped"]
RECORDS = "manifest.d"  # one file per stage
LOCK = ".manifest.lock"


class StageRecord(BaseModel):
    status: Status = "pending"
    fingerprint: str | None = None
    config_hash: str | None = None
    inputs: dict[str, str] = Field(default_factory=dict, description="name -> content hash")
    outputs: dict[str, str] = Field(default_factory=dict, description="name -> path (relative to the run dir)")
    output_hashes: dict[str, str] = Field(default_factory=dict)
    metrics: dict = Field(default_factory=dict)
    resources: dict = Field(default_factory=dict)
    cost: dict = Field(default_factory=dict, description="this attempt's device-hours, tokens, energy, money")
    earlier_attempts_cost: dict = Field(default_factory=dict, description="failed attempts at this fingerprint")
    code_version: str | None = None
    code_hash: str | None = Field(None, description="sha256 of the package's source the stage ran with")
    reused_stale: str | None = Field(None, description="the code hash under which a completed stage of older code "
                                     "was kept on purpose (--reuse-stale)")
    started_at: str | None = None
    finished_at: str | None = None
    wall_time_s: float | None = None
    attempts: int = 0
    slurm_jobs: list[str] = Field(default_factory=list, description="the Slurm jobs that ran its attempts")
    error: str | None = None

    @property
    def done(self) -> bool:
        """Completed with all of its work: a stage that completed part of it (the eval stage with a model it could
        not serve: metrics' `incomplete`) runs again."""
        return self.status == "completed" and not self.metrics.get("incomplete")


class Manifest(BaseModel):
    run_name: str
    recipe_path: str | None = None
    recipe_hash: str | None = None
    accounting: dict = Field(default_factory=dict, description="the per-device figures the costs were computed with")
    provenance: list[dict] = Field(default_factory=list, description="the recipe's record of promoted sweep values")
    stages: dict[str, StageRecord] = Field(default_factory=dict)

    @classmethod
    def load_or_new(cls, run_dir: Path, run_name: str) -> Manifest:
        path = run_dir / "manifest.json"
        try:
            manifest = cls.model_validate(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            manifest = cls(run_name=run_name)
        except (OSError, ValueError, RecursionError) as e:  # rebuilt from the stage records, which are what count
            from amalia_ray.core.console import stage_line

            stage_line("manifest", f"[yellow]unreadable[/] ({path}: {type(e).__name__}): rebuilt from the stage "
                       "records")
            manifest = cls(run_name=run_name)
        manifest.stages.update(read_records(run_dir))
        return manifest

    def save(self, run_dir: Path, stages: Iterable[str] = ()) -> None:
        """Write the records of `stages` (the ones this process runs) and rebuild manifest.json from the run's
        fields and every stage's latest record; this copy takes in the records other processes wrote."""
        stages = set(stages)
        (run_dir / RECORDS).mkdir(parents=True, exist_ok=True)
        for name in stages:
            # a stage's metrics and error may quote what it was given (a storage URI with its password …)
            write_json(run_dir / RECORDS / f"{name}.json",
                       secrets.mask_values(self.stages[name].model_dump(mode="json"), HASHES))
        with locked(run_dir / LOCK):
            for name, record in read_records(run_dir).items():
                if name not in stages:
                    self.stages[name] = record
            write_json(run_dir / "manifest.json", secrets.mask_values(self.model_dump(mode="json"), HASHES))

    def stage(self, name: str) -> StageRecord:
        return self.stages.setdefault(name, StageRecord())

    def reload_stage(self, run_dir: Path, name: str) -> None:
        """Take in the stage's record as its last writer left it (another process may have run it since this
        manifest was read)."""
        if (record := _read_record(run_dir / RECORDS / f"{name}.json")) is not None:
            self.stages[name] = record


def read_records(run_dir: Path) -> dict[str, StageRecord]:
    """The stage records of `manifest.d/`, in the order the stages started. A record that cannot be read (cut short
    by a crash, edited by hand) is reported and left out: its stage runs again, the others are kept."""
    folder = run_dir / RECORDS
    records = {f.stem: record for f in (sorted(folder.glob("*.json")) if folder.is_dir() else [])
               if (record := _read_record(f)) is not None}
    return dict(sorted(records.items(), key=lambda kv: (kv[1].started_at or "", kv[0])))


def _read_record(path: Path) -> StageRecord | None:
    try:
        return StageRecord.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    # ValueError: not JSON, or not a record (pydantic's ValidationError); RecursionError: nested past the parser's depth
    except (OSError, ValueError, RecursionError) as e:
        from amalia_ray.core.console import stage_line

        stage_line(path.stem, f"[yellow]record unreadable[/] ({path}: {type(e).__name__}): treated as never run")
        return None


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of this machine (advisory, released when the holder dies)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@functools.cache
def code_hash() -> str:
    """sha256 of the package's own source (every .py file's path and content): what a stage's result depends on
    besides its config and inputs, whether or not the code runs from a git checkout (a wheel has no commit)."""
    return _source_hash(Path(amalia_ray.__file__).resolve().parent)


def _source_hash(root: Path) -> str:
    """sha256 over a package folder's .py files: each one's path and content."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def named_code_hash(spec: str) -> str:
    """sha256 of the source of the code a recipe names ('package.module:function'): every .py file of its top-level
    package (what the function may import from beside it), or its module's file. A change to it changes what a
    stage computes, as a change to this package's code does."""
    top = spec.partition(":")[0].split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None:
        return "not found"
    if found.submodule_search_locations:
        return _source_hash(Path(next(iter(found.submodule_search_locations))))
    origin = Path(found.origin) if found.origin else None
    return hashlib.sha256(origin.read_bytes()).hexdigest()[:16] if origin and origin.is_file() else "not found"


def code_version() -> str:
    """Package version plus the git commit (and '+dirty') when running from a checkout."""
    version = amalia_ray.__version__
    root = Path(amalia_ray.__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version}+g{sha}{'.dirty' if dirty else ''}" if sha else version


class Stopwatch:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.start

    @property
    def seconds(self) -> float:
        return getattr(self, "elapsed", time.perf_counter() - self.start)
