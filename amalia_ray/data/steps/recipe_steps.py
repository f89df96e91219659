"""The document steps a recipe's `data` section runs, in order, built from it, and how Ray Data runs a list of
them. Two runs of steps frame the web-page decisions (one capture per page, site boilerplate), which look across
documents: before them, what makes two captures of a page comparable (cleaning, normalization, the minimum length,
the capture keys); after them, what scores and filters each document on its own (language and variety, heuristic
quality, a learned quality model, decontamination)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ray

from amalia_ray.core.config import DataConfig
from amalia_ray.core.ngrams import ItemIndex
from amalia_ray.core.variety_model import model_for_workers
from amalia_ray.data.steps.base import DocumentStep
from amalia_ray.data.steps.cleaning import Clean, Normalize
from amalia_ray.data.steps.decontaminate import Decontaminate
from amalia_ray.data.steps.language import LanguageID, VarietyTag
from amalia_ray.data.steps.quality import HeuristicScore, MinLength, quality_steps
from amalia_ray.data.steps.quality_model import QualityModelScore
from amalia_ray.data.web.captures import CaptureKeys


def before_pages(cfg: DataConfig) -> list[DocumentStep]:
    """Cleaning, normalization, the minimum length and each document's capture keys (URL and date)."""
    return [Clean(cfg.cleaning), Normalize(cfg.normalization), MinLength(cfg.min_chars),
            CaptureKeys({s.name: (s.url_field, s.date_field) for s in cfg.sources})]


def after_pages(cfg: DataConfig, resolve: Callable[[str], Path], index: ItemIndex | None) -> list[DocumentStep]:
    """Language and variety, the heuristic quality filters and score (or the learned quality model), and
    decontamination against `index` (the benchmarks' items) when the recipe asks for it."""
    steps: list[DocumentStep] = [*([LanguageID(cfg.language)] if cfg.language else [])]
    if cfg.variety:
        steps.append(VarietyTag(cfg.variety, model_for_workers(cfg.variety.model, resolve) if cfg.variety.model
                                else None))
    steps += quality_steps(cfg.quality)
    if cfg.quality_model:
        steps.append(QualityModelScore(str(resolve(cfg.quality_model)), cfg.quality_threshold))
    elif cfg.quality:
        steps.append(HeuristicScore(cfg.quality.language))
    if index is not None:
        steps.append(Decontaminate(index, cfg.decontaminate.min_overlap, cfg.decontaminate.action))
    return steps


def run_steps(docs: ray.data.Dataset, steps: list[DocumentStep]) -> ray.data.Dataset:
    """The steps over the dataset's blocks, lazily: in tasks, or in a pool of actors (one per CPU at most) for a
    step that loads a model once per process."""
    for step in steps:
        if step.in_actors:
            cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
            docs = docs.map_batches(type(step), fn_constructor_args=step.init_args, batch_format="pyarrow",
                                    batch_size=1024, compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cpus))
        else:
            docs = docs.map_batches(step, batch_format="pyarrow")
    return docs
