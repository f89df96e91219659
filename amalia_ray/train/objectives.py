"""The objectives the one training loop runs (the interface is `train/objective.py`): packed pretraining and SFT
here, DPO and GRPO in their own files; `build_objective` picks one by the stage's `objective`."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

from amalia_ray.core.shards import (MixtureSampler, PackedSplit, document_positions, load_hook, one_block,
                                    phase_schedule)
from amalia_ray.core.storage import jsonl_rows
from amalia_ray.train.chat import encode_conversation, pack_conversations
from amalia_ray.train.dpo import DPO
from amalia_ray.train.loss import next_token_loss
from amalia_ray.train.grpo import GRPO
from amalia_ray.train.objective import Objective


class Pretrain(Objective):
    """Packed causal LM over fixed-length token sequences (documents joined by EOS), sources mixed by a sampler."""

    name = "pretrain"

    def __init__(self, data_dir: Path, document_masking: bool = True):
        self.train = PackedSplit.read(data_dir / "train")
        self.validation = PackedSplit.read(data_dir / "validation")
        self.document_masking = document_masking

    def sampler(self, seed: int, curriculum: dict | None = None) -> MixtureSampler:
        schedule = None
        if curriculum and curriculum.get("hook"):
            schedule = load_hook(curriculum["hook"])
        elif curriculum and curriculum.get("phases"):
            schedule = phase_schedule(curriculum["phases"])
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

    @staticmethod
    def logits(model, batch: dict) -> torch.Tensor:
        # no KV cache: transformers only reads restarting position_ids as packed documents without one
        return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        ids = batch["input_ids"]
        return next_token_loss(self.logits(model, batch), ids)


class SFT(Objective):
    """Supervised fine-tuning on conversations (jsonl rows with `messages`): rendered with the tokenizer's chat
    template, loss on assistant tokens only, conversations packed best-fit-decreasing into `seq_len` rows with
    positions restarting per conversation (so attention stays within one)."""

    name = "sft"

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

    def sampler(self, seed: int, curriculum: dict | None = None) -> MixtureSampler:
        if curriculum:
            raise ValueError("curriculum applies to pretraining sources; an sft stage reads one conversation set")
        return MixtureSampler({"sft": one_block(len(self.train.input_ids))}, self.train.input_ids.shape[1], seed)

    def num_validation(self) -> int:
        return len(self.validation.input_ids)

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        return {"input_ids": torch.from_numpy(data.input_ids[rows]), "labels": torch.from_numpy(data.labels[rows]),
                "position_ids": torch.from_numpy(data.position_ids[rows]), "lengths": torch.from_numpy(data.lengths[rows])}

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        return next_token_loss(Pretrain.logits(model, batch), batch["labels"])


def read_conversations(path: Path) -> list[list[dict]]:
    """jsonl file(s) with a `messages` list per row; a bad row is an error naming file and line."""
    out = []
    for f, n, row in jsonl_rows(path, "conversations"):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise ValueError(f"{f}:{n}: not a JSON object with 'messages' (a list of {{role, content}})")
        out.append(row["messages"])
    return out


def build_objective(stage: dict, data_dir: Path, tokenizer_dir: Path | None = None, seq_len: int | None = None,
                    work_dir: Path | None = None, seed: int = 0, use_gpu: bool = False,
                    step_transient=None) -> Objective:
    name = stage["objective"]  # one of these four: the recipe's stage models allow no other
    if name == "sft":
        return SFT(data_dir, tokenizer_dir, seq_len)
    if name == "dpo" and stage.get("on_policy"):
        return DPO.from_policy(data_dir, tokenizer_dir, seq_len, stage, work_dir, seed, use_gpu)
    if name == "dpo":
        return DPO(data_dir, tokenizer_dir, seq_len, stage.get("beta", 0.1))
    if name == "grpo":
        return GRPO(data_dir, tokenizer_dir, seq_len, stage, work_dir, seed, use_gpu, step_transient)
    return Pretrain(data_dir, document_masking=stage.get("document_masking", True))
