"""Supervised fine-tuning on conversations: jsonl rows with `messages`, rendered with the tokenizer's chat template,
loss on the assistant's tokens only."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

from amalia_ray.core.config import SFTStage
from amalia_ray.core.formats.shards import MixtureSampler, one_block
from amalia_ray.core.formats.conversations import read_conversations
from amalia_ray.train.chat import encode_conversation, pack_conversations
from amalia_ray.train.loss import next_token_loss
from amalia_ray.train.objectives.base import Objective, StageInputs
from amalia_ray.train.objectives.pretrain import logits


class SFT(Objective):
    """Supervised fine-tuning on conversations (jsonl rows with `messages`): rendered with the tokenizer's chat
    template, loss on assistant tokens only, conversations packed best-fit-decreasing into `seq_len` rows with
    positions restarting per conversation (so attention stays within one)."""

    name = "sft"
    config = SFTStage
    metrics = frozenset({"val_loss"})

    def __init__(self, data_path: Path, tokenizer_dir: Path, seq_len: int, validation_fraction: float = 0.05):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        train, validation = [], []
        for conversation in read_conversations(data_path):
            key = json.dumps(conversation, sort_keys=True, ensure_ascii=False).encode()
            (validation if zlib.crc32(key) / 2**32 < validation_fraction else train).append(
                encode_conversation(tok, conversation))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.train = pack_conversations(train, seq_len, pad)
        self.validation = pack_conversations(validation, seq_len, pad)
        if not len(self.train.input_ids):
            raise ValueError(f"no training conversation with an assistant turn in {data_path}")

    @classmethod
    def from_stage(cls, stage: SFTStage, inputs: StageInputs) -> SFT:
        return cls(inputs.data_dir, inputs.tokenizer_dir, inputs.seq_len)

    def sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler({"sft": one_block(len(self.train.input_ids))}, self.train.input_ids.shape[1], seed)

    def num_validation(self) -> int:
        return len(self.validation.input_ids)

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        return {"input_ids": torch.from_numpy(data.input_ids[rows]), "labels": torch.from_numpy(data.labels[rows]),
                "position_ids": torch.from_numpy(data.position_ids[rows]), "lengths": torch.from_numpy(data.lengths[rows])}

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        return next_token_loss(logits(model, batch), batch["labels"])

