"""Objectives plug into the one training loop: how a batch is built from the stage's data, and what the loss is.

`loss` returns (sum of per-token losses, number of target tokens) so the loop can normalize over the whole global
batch, however it is split into micro-batches and workers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F

from amalia_ray.core.errors import NotImplementedYet


class Pretrain:
    """Packed causal LM over fixed-length token sequences (documents joined by EOS)."""

    name = "pretrain"

    def __init__(self, data_dir: Path):
        self.train = self._read(data_dir / "train")
        self.validation = self._read(data_dir / "validation")

    @staticmethod
    def _read(split_dir: Path) -> np.ndarray:
        files = sorted(split_dir.rglob("*.parquet")) if split_dir.exists() else []
        if not files:
            return np.zeros((0, 0), dtype=np.int64)
        arrays = []
        for f in files:
            column = pq.read_table(f, columns=["input_ids"]).column("input_ids").combine_chunks()
            seq_len = column.type.list_size
            arrays.append(column.values.to_numpy(zero_copy_only=False).reshape(-1, seq_len))
        return np.concatenate(arrays).astype(np.int64)

    def num_examples(self) -> int:
        return len(self.train)

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        return {"input_ids": torch.from_numpy(data[rows])}

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
