"""What an objective is to the training loop: how it draws a step's rows and turns rows into batches, its loss, and
the optional hooks, with their defaults. Each concrete objective (pretrain.py, sft.py, dpo.py, grpo.py, reward.py) subclasses
`Objective`, names the recipe's stage model it is built from (`config`) and the metrics its records carry; the
registry (registry.py) maps the recipe's `objective` to it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from amalia_ray.core.config import TrainStageConfig
from amalia_ray.core.formats.shards import MixtureSampler

# what every stage's step records carry that is worth optimizing or plotting (a sweep's metric must be one of what
# its stage reports)
LOOP_METRICS = frozenset({"loss", "grad_norm", "tokens_per_s", "mfu"})


@dataclass(frozen=True)
class StageInputs:
    """What an objective reads besides its stage's config: the files, and where and how it runs."""
    data_dir: Path  # the packed corpus (pretraining) or the stage's own dataset file or folder
    tokenizer_dir: Path
    seq_len: int  # the stage's sequence length, else the model's positions (packed rows keep their own)
    work_dir: Path  # the stage's folder: rollout exports, on-policy pairs
    seed: int
    use_gpu: bool = False
    # tokens of a sequence -> bytes a training step adds above the sharded state (`amalia plan`'s arithmetic):
    # what a colocated rollout engine leaves free on the device
    step_transient: Callable[[int], int] | None = None
    # a reward model (`rewards: [{model: …}]`, as the recipe names it) -> the Serve application scoring with it
    reward_apps: dict[str, str] = field(default_factory=dict)
    # a judge reward's stage (`judge: {stage: …}`) -> where the pipeline serves it: {base_url, model, api_key_env}
    judge_servers: dict[str, dict] = field(default_factory=dict)
    # the training run this attempt is one of (Ray Train's run name, which holds the stage's fingerprint): what an
    # earlier attempt of the same run sampled once is the same data, and is reused rather than sampled again
    run_id: str = ""


class Objective(ABC):
    name: ClassVar[str]  # the recipe's `objective`
    config: ClassVar[type[TrainStageConfig]]  # the recipe's stage model for it
    metrics: ClassVar[frozenset[str]] = frozenset()  # what its step records carry beyond LOOP_METRICS
    loss_panel: ClassVar[str] = "cross-entropy"  # the run report's panel its curve goes on
    head: ClassVar[str] = "lm"  # what the model has on top of its decoder (train/heads.py)

    @classmethod
    @abstractmethod
    def from_stage(cls, stage: TrainStageConfig, inputs: StageInputs) -> Objective:
        """The objective of a recipe stage (validated as `cls.config`)."""

    @classmethod
    def reported(cls, stage: TrainStageConfig, sources: Iterable[str] = ()) -> set[str]:
        """The metrics a stage of this objective reports, of a corpus with these sources."""
        return set(LOOP_METRICS | cls.metrics)

    def model_config(self, hf_config):
        """The transformers config of the model this objective trains, from the stage's (a reward model sets its
        one output and pad id)."""
        return hf_config

    @abstractmethod
    def sampler(self, seed: int) -> MixtureSampler:
        """The seeded, resumable order in which the stage reads its training rows."""

    @abstractmethod
    def batch(self, rows: np.ndarray, split: str = "train") -> dict[str, torch.Tensor]:
        """Tensors of these rows of a split ("train" or "validation")."""

    @abstractmethod
    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        """(sum of per-item losses, number of items: target tokens, or pairs for DPO): the loop normalizes over the
        whole global batch, however it is split into micro-batches and workers."""

    @abstractmethod
    def num_validation(self) -> int:
        """Rows in the validation split (0: no validation loss)."""

    def validation_groups(self) -> dict[str, np.ndarray]:
        """Validation rows by group; the loop reports a loss per named group (packed pretraining: per source)."""
        return {"": np.arange(self.num_validation())}

    def prepare(self, model, micro: int, rank: int, world: int, device: torch.device,
                frozen_copy: Callable[[Path], torch.nn.Module] | None = None) -> None:
        """Runs once on the stage's initial weights, before a checkpoint is restored (DPO's reference pass, the
        rollout engine's start). `frozen_copy(hf_folder)` builds a gradient-free copy sharded like the policy."""

    def step_rows(self, model, sampler: MixtureSampler, global_batch_size: int) -> np.ndarray:
        """The rows of one optimizer step. On-policy objectives sample them now, from the current weights."""
        return sampler.next_rows(global_batch_size)

    def state_dict(self) -> dict:
        """What a resumed stage needs beyond the weights, the optimizer and the read position to go on as if never
        stopped (JSON: it is stored beside the train state and signed with it). A collective: every rank calls it
        when a checkpoint is taken, and rank 0's is saved. Empty: nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Every rank, after the checkpoint is restored: rank 0's `state_dict` of that step."""

    def take_metrics(self) -> dict[str, tuple[float, float]]:
        """Objective metrics as (sum, count) over the items since the last call; the loop averages them per step."""
        return {}
