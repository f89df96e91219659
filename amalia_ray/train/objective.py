"""What an objective is to the training loop: how it draws a step's rows and turns rows into batches, its loss, and
the optional hooks, with their defaults. The concrete objectives (pretrain, sft, dpo, grpo) subclass `Objective`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from amalia_ray.core.shards import MixtureSampler


class Objective(ABC):
    name: str

    @abstractmethod
    def sampler(self, seed: int, curriculum: dict | None = None) -> MixtureSampler:
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

    def take_metrics(self) -> dict[str, tuple[float, float]]:
        """Objective metrics as (sum, count) over the items since the last call; the loop averages them per step."""
        return {}
