"""The recipe's `objective` -> the objective class, which names its stage model (`config`), the metrics its stages
report (`reported`, what a sweep may optimize) and the report panel its curve goes on. The loop builds objectives
here; the sweep and the run report read what they report here. The names are the recipe's stage models' own
(`objective: Literal[...]`): a test holds this table and the recipe's `train` union to the same objectives."""

from __future__ import annotations

from amalia_ray.core.config import TrainStageConfig
from amalia_ray.train.objectives.base import Objective, StageInputs
from amalia_ray.train.objectives.dpo import DPO
from amalia_ray.train.objectives.grpo import GRPO
from amalia_ray.train.objectives.pretrain import Pretrain
from amalia_ray.train.objectives.reward import Reward
from amalia_ray.train.objectives.sft import SFT

OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (Pretrain, SFT, DPO, GRPO, Reward)}


def objective_of(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise ValueError(f"no objective '{name}': the objectives are {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def build_objective(stage: TrainStageConfig, inputs: StageInputs) -> Objective:
    """The objective a training stage runs, built from its own stage model."""
    cls = objective_of(stage.objective)
    if not isinstance(stage, cls.config):
        raise TypeError(f"train stage '{stage.name}' is a {type(stage).__name__}; a {stage.objective} objective is "
                        f"built from a {cls.config.__name__}")
    return cls.from_stage(stage, inputs)
