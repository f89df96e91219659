"""The run manifest: `runs/<name>/manifest.json`, one entry per stage with what it read, wrote and cost.

A stage is skipped when its fingerprint (config hash + input content hashes) matches a completed entry.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

import amalia_ray
from amalia_ray.core.storage import write_json

Status = Literal["pending", "running", "completed", "failed", "skipped"]


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
    started_at: str | None = None
    finished_at: str | None = None
    wall_time_s: float | None = None
    attempts: int = 0
    error: str | None = None


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
        if path.exists():
            return cls.model_validate(json.loads(path.read_text(encoding="utf-8")))
        return cls(run_name=run_name)

    def save(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / "manifest.json", self.model_dump(mode="json"))

    def stage(self, name: str) -> StageRecord:
        return self.stages.setdefault(name, StageRecord())


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
