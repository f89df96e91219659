"""The search space of `amalia sweep` (a YAML file): which fields of a training stage vary, how trials are drawn,
what they are scored on, and when weak ones stop. Checked against the stage it sweeps before any trial starts, so
an unknown field, an empty range or a value of the wrong type fails in a second, naming the parameter.

    metric: val_loss          # what the trials report at every validation; mode min or max
    mode: min
    search: random            # grid: every combination of `values` (× num_samples, default 1); random: num_samples
    num_samples: 4            #   draws (default 4)
    scheduler: {type: asha, grace_period: 1, reduction_factor: 2}   # in validations; type none runs all to the end
    parameters:
      lr: {distribution: loguniform, low: 0.0003, high: 0.01}
      schedule: {values: [cosine, wsd]}
      global_batch_size: {values: [8, 16]}
      mix.debian-faq-pt: {values: [0.5, 1, 2]}     # a data source's sampling weight (pretraining)
      lora.r: {values: [8, 16, 32]}                # a LoRA stage's adapters (lora.alpha, .dropout, .target_modules)
    benchmark: {task: pt-mc-sample, top: 2}        # also serve the best finished trials and score them over HTTP
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from amalia_ray.core.config import TASK_REFERENCE, Strict, TrainStageConfig, train_stage
from amalia_ray.core.errors import AmaliaError

# never swept: they name or wire the stage rather than tune it
FIXED_FIELDS = {"name", "objective", "dataset", "init_from", "proxy", "rollout", "curriculum", "rewards"}
MIX = "mix."  # mix.<source>: that data source's sampling weight
LORA = "lora."  # lora.<field>: a field of the stage's LoRA adapters
LORA_TUNABLE = ("r", "alpha", "dropout", "target_modules")


def with_values(stage: dict, values: dict[str, Any]) -> dict:
    """A stage's fields (model_dump) with swept values put in: `lora.<field>` into its lora section; the data
    mix (`mix.*`) is the curriculum's business, left out here."""
    out = dict(stage)
    for name, value in values.items():
        if name.startswith(LORA):
            out["lora"] = {**(out.get("lora") or {}), name[len(LORA):]: value}
        elif not name.startswith(MIX):
            out[name] = value
    return out


class Parameter(Strict):
    values: list[Any] | None = Field(None, description="the choices (grid search walks them all)")
    distribution: Literal["uniform", "loguniform", "randint"] | None = None
    low: float | None = None
    high: float | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> Parameter:
        if (self.values is None) == (self.distribution is None):
            raise ValueError("give either values: [...] or distribution with low and high")
        if self.values is not None and not self.values:
            raise ValueError("values is empty")
        if self.distribution:
            if self.low is None or self.high is None:
                raise ValueError(f"distribution {self.distribution} needs low and high")
            if not self.low < self.high:
                raise ValueError(f"empty range: low {self.low} is not below high {self.high}")
            if self.distribution == "loguniform" and self.low <= 0:
                raise ValueError(f"loguniform needs low > 0, got {self.low}")
        return self

    def edges(self) -> list[Any]:
        """Values that stand for the whole parameter when checking it against the stage."""
        if self.values is not None:
            return list(self.values)
        if self.distribution == "randint":
            return [int(self.low), int(math.ceil(self.high)) - 1]
        return [self.low, self.high]


class Scheduler(Strict):
    type: Literal["asha", "none"] = "asha"
    grace_period: int = Field(1, ge=1, description="validations every trial gets before it can be stopped")
    reduction_factor: float = Field(2, gt=1, description="ASHA keeps the best 1/reduction_factor at each rung")


class Benchmark(Strict):
    task: str = Field(..., description=f"the task the best trials are scored on: {TASK_REFERENCE.split('; or ')[0]}")
    top: int = Field(2, ge=1, description="serve the best trials that ran to the end, this many, and score them")


def adapters_servable(stage: TrainStageConfig, has_start: bool = True) -> bool:
    """Whether a sweep's LoRA trials are benchmarked as adapters on one engine of the stage's starting checkpoint:
    vLLM serves their adapters (TrainStageConfig.adapter_servable) and the trials train the full-size model."""
    return stage.adapter_servable(has_start) and not stage.proxy.model


class SweepSpace(Strict):
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    search: Literal["grid", "random"] = "random"
    num_samples: int | None = Field(None, ge=1, description="random: trials drawn (default 4); grid: times the "
                                    "whole grid is run (default 1)")
    max_concurrent_trials: int | None = Field(None, ge=1, description="default: as many as the cluster fits")
    seed: int = 0
    scheduler: Scheduler = Scheduler()
    parameters: dict[str, Parameter] = Field(..., min_length=1, description="stage fields, mix.<source> for the "
                                             "sampling weight of a data source (pretraining), or lora.r, "
                                             "lora.alpha, lora.dropout, lora.target_modules")
    benchmark: Benchmark | None = Field(None, description="also score the best finished trials on an eval task, "
                                        "served over HTTP")

    @model_validator(mode="after")
    def _grid_needs_values(self) -> SweepSpace:
        if self.search == "grid":
            if drawn := [k for k, p in self.parameters.items() if p.values is None]:
                raise ValueError(f"grid search walks `values`; parameters {drawn} give a distribution (use "
                                 "search: random, or list values)")
        return self

    def check_against(self, stage: TrainStageConfig, sources: list[str], has_start: bool = True) -> None:
        """Every parameter is a tunable field of the stage (or the weight of one of the recipe's data `sources`) and
        each of its values makes a valid stage. `has_start`: the stage starts from a checkpoint (not random
        weights)."""
        if self.benchmark and stage.lora and not stage.lora.merge and not adapters_servable(stage, has_start):
            raise AmaliaError(f"benchmark: the trials' LoRA adapters of train stage '{stage.name}' cannot run on its "
                              "starting checkpoint's engine (modules_to_save, a proxy model or random initial "
                              "weights); set lora.merge: true to serve their merged weights")
        for name, param in self.parameters.items():
            if name.startswith(MIX):
                _check_mix(name, param, stage, sources)
                continue
            if name.startswith(LORA):
                if stage.lora is None:
                    raise AmaliaError(f"parameters.{name}: train stage '{stage.name}' trains no LoRA adapters "
                                      "(give it a lora: section)")
                if name[len(LORA):] not in LORA_TUNABLE:
                    raise AmaliaError(f"parameters.{name}: tunable LoRA fields: "
                                      f"{', '.join(LORA + f for f in LORA_TUNABLE)}")
            elif name not in (fields := type(stage).model_fields) or name in FIXED_FIELDS:
                tunable = sorted(set(fields) - FIXED_FIELDS)
                raise AmaliaError(f"parameters.{name}: not a tunable field of train stage '{stage.name}'; "
                                  f"tunable: {', '.join(tunable)}")
            for value in param.edges():
                try:
                    train_stage(with_values(stage.model_dump(), {name: value}))
                except ValidationError as e:
                    problem = "; ".join(f"{'.'.join(map(str, err['loc'])) or name}: {err['msg']}" for err in e.errors())
                    raise AmaliaError(f"parameters.{name}: value {value!r} does not fit train stage "
                                      f"'{stage.name}' ({problem})") from None

    def mix_weights(self, config: dict, defaults: dict[str, float]) -> dict[str, float] | None:
        """The trial's source weights: the recipe's, with the swept ones replaced; None when no mix is swept."""
        swept = {k[len(MIX):]: float(v) for k, v in config.items() if k.startswith(MIX)}
        return {**defaults, **swept} if swept else None

    @property
    def samples(self) -> int:
        return self.num_samples or (1 if self.search == "grid" else 4)

    def tune_space(self) -> dict:
        from ray import tune

        space = {}
        for name, p in self.parameters.items():
            if p.values is not None:
                space[name] = tune.grid_search(p.values) if self.search == "grid" else tune.choice(p.values)
            elif p.distribution == "randint":
                space[name] = tune.randint(int(p.low), int(math.ceil(p.high)))
            else:
                space[name] = getattr(tune, p.distribution)(p.low, p.high)
        return space


def _check_mix(name: str, param: Parameter, stage: TrainStageConfig, sources: list[str]) -> None:
    source = name[len(MIX):]
    if stage.objective != "pretrain":
        raise AmaliaError(f"parameters.{name}: source weights are a pretraining parameter; stage '{stage.name}' is "
                          f"{stage.objective}")
    if source not in sources:
        raise AmaliaError(f"parameters.{name}: no data source '{source}'; sources: {', '.join(sources)}")
    if bad := [v for v in param.edges() if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0]:
        raise AmaliaError(f"parameters.{name}: a source weight is a number >= 0, got {bad}")


def load_space(path: Path) -> SweepSpace:
    if not path.is_file():
        raise AmaliaError(f"search space file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise AmaliaError(f"{path}: not YAML ({e})") from None
    try:
        return SweepSpace.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise AmaliaError(f"{path}: {problems}") from None
