"""Objectives plug into the one training loop: how a batch is built from the stage's data, and what the loss is.

`loss` returns (sum of per-item losses, number of items: target tokens, or pairs for DPO) so the loop can normalize
over the whole global batch, however it is split into micro-batches and workers. Optional hooks: `prepare(model,
micro, rank, world, device)` runs once on the initial weights before a checkpoint is restored (DPO's reference pass);
`take_metrics()` returns sums over the items counted since the last call (the loop averages them over the step).
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from amalia_ray.core.errors import NotImplementedYet
from amalia_ray.core.shards import MixtureSampler, PackedSplit, load_hook, phase_schedule
from amalia_ray.train.chat import encode_conversation, pack_conversations
from amalia_ray.train.preferences import collate, encode_pair, fits, read_preferences, sequence_logps

log = logging.getLogger("amalia_ray.train")


class Pretrain:
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
        return MixtureSampler(self.train.rows_by_source(), self.train.tokens.shape[1], seed, schedule)

    def num_validation(self) -> int:
        return len(self.validation.tokens)

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        batch = {"input_ids": torch.from_numpy(data.tokens[rows])}
        if self.document_masking:
            batch["position_ids"] = torch.from_numpy(data.position_ids(rows))
        return batch

    @staticmethod
    def logits(model, batch: dict) -> torch.Tensor:
        # no KV cache: transformers only reads restarting position_ids as packed documents without one
        return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        ids = batch["input_ids"]
        logits = self.logits(model, batch)[:, :-1].float()
        targets = ids[:, 1:]
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
        return loss_sum, targets.numel()


class SFT:
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
        return MixtureSampler({"sft": np.arange(len(self.train.input_ids))}, self.train.input_ids.shape[1], seed)

    def num_validation(self) -> int:
        return len(self.validation.input_ids)

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        data = self.train if split == "train" else self.validation
        return {"input_ids": torch.from_numpy(data.input_ids[rows]), "labels": torch.from_numpy(data.labels[rows]),
                "position_ids": torch.from_numpy(data.position_ids[rows]), "lengths": torch.from_numpy(data.lengths[rows])}

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        logits = Pretrain.logits(model, batch)[:, :-1].float()
        targets = batch["labels"][:, 1:]
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                                   reduction="sum")
        return loss_sum, int((targets != -100).sum())


class DPO:
    """Direct preference optimization (sigmoid loss with β) on {prompt, chosen, rejected} pairs. The reference
    log-probabilities come from their own pass over every pair with the stage's initial weights (TRL's
    `precompute_ref_log_probs`), so no second model is held during training; a resumed attempt recomputes them from
    the same initial weights before restoring the checkpoint."""

    name = "dpo"
    REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")

    def __init__(self, data_path: Path, tokenizer_dir: Path, seq_len: int, beta: float,
                 validation_fraction: float = 0.05):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.seq_len, self.beta = seq_len, beta
        self.pairs: dict[str, list] = {"train": [], "validation": []}
        self.dropped = 0
        for row in read_preferences(data_path):
            pair = encode_pair(tok, row)
            if not fits(pair, seq_len):
                self.dropped += 1
                continue
            key = json.dumps(row, sort_keys=True, ensure_ascii=False).encode()
            self.pairs["validation" if zlib.crc32(key) / 2**32 < validation_fraction else "train"].append(pair)
        if not self.pairs["train"]:
            raise ValueError(f"no preference pair in {data_path} whose prompt fits in seq_len {seq_len}")
        unclean = sum(not p.clean_split for split in self.pairs.values() for p in split)
        if unclean:
            log.warning(f"{data_path}: {unclean} pair(s) where prompt+answer does not tokenize as prompt then answer "
                        "(e.g. a prompt ending in a space); their prompt/answer split is approximate")
        self.reference: dict[str, torch.Tensor] = {}
        self._sums = torch.zeros(len(self.REWARDS), dtype=torch.float64)

    def sampler(self, seed: int, curriculum: dict | None = None) -> MixtureSampler:
        if curriculum:
            raise ValueError("curriculum applies to pretraining sources; a dpo stage reads one preference set")
        return MixtureSampler({"dpo": np.arange(len(self.pairs["train"]))}, self.seq_len, seed)

    def num_validation(self) -> int:
        return len(self.pairs["validation"])

    def _collate(self, rows: np.ndarray, split: str) -> dict:
        return collate([self.pairs[split][i] for i in rows], self.pad_id, self.seq_len)

    @staticmethod
    def _logps(model, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return sequence_logps(logits, batch)

    @torch.no_grad()
    def prepare(self, model, micro: int, rank: int, world: int, device: torch.device) -> None:
        model.eval()
        for split, pairs in self.pairs.items():
            n = len(pairs)
            logps = torch.zeros(n, 2, dtype=torch.float64)
            mine = np.arange(rank, n, world)
            # every rank runs the same number of forward passes: FSDP all-gathers are collectives
            for i in range(0, -(-n // world), micro):
                rows = mine[i:i + micro]
                batch = {k: v.to(device) for k, v in self._collate(rows if len(rows) else np.arange(1), split).items()}
                both = self._logps(model, batch).double().cpu()
                if len(rows):
                    logps[rows, 0], logps[rows, 1] = both[:len(rows)], both[len(rows):]
            if world > 1:
                dist.all_reduce(logps)
            self.reference[split] = logps
        model.train()

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        batch = self._collate(rows, split)
        reference = self.reference[split][rows].float()
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = reference[:, 0], reference[:, 1]
        return batch

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        chosen, rejected = self._logps(model, batch).chunk(2)
        chosen_reward = self.beta * (chosen - batch["ref_chosen_logps"])
        rejected_reward = self.beta * (rejected - batch["ref_rejected_logps"])
        losses = -F.logsigmoid(chosen_reward - rejected_reward)
        if model.training:
            with torch.no_grad():
                self._sums += torch.stack([chosen_reward.sum(), rejected_reward.sum(),
                                           (chosen_reward - rejected_reward).sum(),
                                           (chosen_reward > rejected_reward).sum()]).double().cpu()
        return losses.sum(), len(losses)

    def take_metrics(self) -> dict[str, float]:
        sums, self._sums = self._sums, torch.zeros_like(self._sums)
        return dict(zip(self.REWARDS, sums.tolist()))


def read_conversations(path: Path) -> list[list[dict]]:
    """jsonl file(s) with a `messages` list per row; a bad row is an error naming file and line."""
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                messages = json.loads(line)["messages"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{f}:{n}: not a JSON object with 'messages' ({e})") from None
            out.append(messages)
    return out


OBJECTIVES = {"pretrain": Pretrain, "sft": SFT, "dpo": DPO}


def build_objective(stage: dict, data_dir: Path, tokenizer_dir: Path | None = None, seq_len: int | None = None):
    name = stage["objective"]
    if name not in OBJECTIVES:
        raise NotImplementedYet(f"training objective '{name}'", 4)
    if name == "sft":
        return SFT(data_dir, tokenizer_dir, seq_len)
    if name == "dpo":
        return DPO(data_dir, tokenizer_dir, seq_len, stage.get("beta", 0.1))
    return Pretrain(data_dir, document_masking=stage.get("document_masking", True))
