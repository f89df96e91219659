"""Objectives plug into the one training loop: how a batch is built from the stage's data, and what the loss is.

`loss` returns (sum of per-token losses, number of target tokens) so the loop can normalize over the whole global
batch, however it is split into micro-batches and workers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from amalia_ray.core.errors import NotImplementedYet
from amalia_ray.core.shards import MixtureSampler, PackedSplit, load_hook, phase_schedule


class Pretrain:
    """Packed causal LM over fixed-length token sequences (documents joined by EOS), sources mixed by a sampler."""

    name = "pretrain"

    def __init__(self, data_dir: Path):
        self.train = PackedSplit.read(data_dir / "train")
        self.validation = PackedSplit.read(data_dir / "validation")

    def sampler(self, seed: int, curriculum: dict | None = None) -> MixtureSampler:
        schedule = None
        if curriculum and curriculum.get("hook"):
            schedule = load_hook(curriculum["hook"])
        elif curriculum and curriculum.get("phases"):
            schedule = phase_schedule(curriculum["phases"])
        return MixtureSampler(self.train.rows_by_source(), self.train.tokens.shape[1], seed, schedule)

    def num_validation(self) -> int:
        return len(self.validation.tokens)

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        return {"input_ids": torch.from_numpy(data.tokens[rows])}

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        ids = batch["input_ids"]
        logits = model(input_ids=ids).logits[:, :-1].float()
        targets = ids[:, 1:]
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
        return loss_sum, targets.numel()


OBJECTIVES = {"pretrain": Pretrain}


def build_objective(name: str, data_dir: Path):
    if name not in OBJECTIVES:
        raise NotImplementedYet(f"training objective '{name}'", 4)
    return OBJECTIVES[name](data_dir)
