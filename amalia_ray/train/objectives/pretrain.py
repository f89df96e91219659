"""Packed causal language modelling: the pack stage's fixed-length rows, sources mixed by a seeded sampler (the
stage's curriculum, if any, schedules the mix over training tokens)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from amalia_ray.core.config import CurriculumConfig, PretrainStage
from amalia_ray.core.formats.shards import MixtureSampler, PackedSplit, document_positions, load_hook, phase_schedule
from amalia_ray.train.loss import next_token_loss
from amalia_ray.train.objectives.base import Objective, StageInputs


class Pretrain(Objective):
    """Packed causal LM over fixed-length token sequences (documents joined by EOS), sources mixed by a sampler."""

    name = "pretrain"
    config = PretrainStage
    metrics = frozenset({"val_loss"})

    def __init__(self, data_dir: Path, document_masking: bool = True, curriculum: CurriculumConfig | None = None):
        self.train = PackedSplit.read(data_dir / "train")
        self.validation = PackedSplit.read(data_dir / "validation")
        self.document_masking, self.curriculum = document_masking, curriculum

    @classmethod
    def from_stage(cls, stage: PretrainStage, inputs: StageInputs) -> Pretrain:
        return cls(inputs.data_dir, stage.document_masking, stage.curriculum)

    @classmethod
    def reported(cls, stage: PretrainStage, sources: Iterable[str] = ()) -> set[str]:
        return super().reported(stage) | {f"val_loss/{s}" for s in sources}  # packed validation rows keep their source

    def sampler(self, seed: int) -> MixtureSampler:
        schedule = None
        if self.curriculum and self.curriculum.hook:
            schedule = load_hook(self.curriculum.hook)
        elif self.curriculum and self.curriculum.phases:
            schedule = phase_schedule([p.model_dump() for p in self.curriculum.phases])
        return MixtureSampler(self.train.blocks, self.train.seq_len, seed, schedule)

    def num_validation(self) -> int:
        return len(self.validation)

    def validation_groups(self) -> dict[str, np.ndarray]:
        return self.validation.rows_by_source()

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        tokens, doc_starts = data.take(rows)
        batch = {"input_ids": torch.from_numpy(tokens)}
        if self.document_masking:
            batch["position_ids"] = torch.from_numpy(document_positions(doc_starts, data.seq_len))
        return batch

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        return next_token_loss(logits(model, batch), batch["input_ids"])


def logits(model, batch: dict) -> torch.Tensor:
    """The model's logits over packed rows: restarting `position_ids` mark the documents (conversations) in a row.
    No KV cache: transformers only reads restarting position_ids as packed documents without one."""
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits
