"""What the orchestration and the stage wiring share: a stage's description (`StageSpec`) and what a stage's wiring
may read of the run it belongs to (`RunContext`, which `runner.Pipeline` is)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from amalia_ray.core.config import Recipe
from amalia_ray.core.filesystem import RunStore
from amalia_ray.core.recipe import LoadedRecipe
from amalia_ray.pipeline.manifest import Manifest


@dataclass
class StageSpec:
    name: str
    config: list  # recipe sections (or plain values) whose change must rerun the stage
    inputs: dict[str, Path]
    outputs: dict[str, Path]
    body: Callable[[], dict]  # does the work, returns metrics
    resources: dict  # what the stage asks for, as recorded in the manifest
    held: Callable[[dict], dict[str, float]] = lambda metrics: {}  # devices held (by resource), from the metrics
    tokens: Callable[[dict], int | None] = lambda metrics: None  # tokens processed, from the metrics
    metrics_file: Path | None = None  # the per-step records the stage appends (training), followed by the trackers


class RunContext(Protocol):
    loaded: LoadedRecipe
    recipe: Recipe
    run_name: str
    run_dir: Path
    force: bool
    manifest: Manifest
    store: RunStore | None
    cluster_info: dict  # set while the run's Ray session is up: its resources and billable CPUs
    corpus: list | None  # the corpus's files, listed once per run (stages.corpus_listing)
    base_dir: Path | None  # the base model's folder in the run, placed once per run (stages.base_model_dir)

    def stage_dir(self, name: str) -> Path: ...

    def checkpoint_of(self, stage_name: str) -> Path: ...

    def model_id(self, stage_name: str) -> str: ...
