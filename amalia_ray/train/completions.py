"""Batches of prompt + completion sequences (DPO's pairs, GRPO's rollouts): right-padded with a mask of the
completion tokens, and the per-token log-probabilities a model gives them."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from amalia_ray.train.loss import target_logps


def pad_completions(items: list[tuple[list[int], list[int]]], pad_id: int, max_len: int) -> dict:
    """(prompt ids, completion ids) per row -> input_ids, attention_mask, completion_mask; rows longer than
    `max_len` keep their start."""
    seqs = [(p + c)[:max_len] for p, c in items]
    masks = [([0] * len(p) + [1] * len(c))[:max_len] for p, c in items]
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(seqs), width), dtype=np.int64)
    completion = np.zeros((len(seqs), width), dtype=np.int64)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], attention[i, :len(s)], completion[i, :len(s)] = s, 1, m
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
            "completion_mask": torch.from_numpy(completion)}


def token_logps(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """(rows, length - 1): log-probability of each next token, under the model's distribution at `temperature` (the
    one a rollout sampled from, as TRL's GRPOTrainer and veRL score it); weigh by batch["completion_mask"][:, 1:]."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    # the targets shifted, not the logits (a slice of the logits would be copied), the last position dropped after
    targets = F.pad(batch["input_ids"][:, 1:], (0, 1))
    return target_logps(logits, targets, temperature=temperature)[:, :-1]
