"""Preference pairs for DPO, in TRL's format: jsonl rows {prompt, chosen, rejected}, either plain strings
(standard) or lists of {role, content} messages (conversational: prompt = the turns before the answer, chosen /
rejected = the competing assistant turn).

Tokenized the way TRL's DPOTrainer does it, so losses agree: the prompt is rendered with the generation prompt, each
completion is what prompt+completion adds after the prompt's tokens; plain-string completions get the EOS token. A
pair longer than `max_len` keeps its start (TRL's default `keep_start`); a pair whose prompt alone fills `max_len`
is dropped (nothing left to score).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    # False when prompt+answer does not tokenize as prompt tokens then answer tokens (a merge across the boundary,
    # e.g. a prompt ending in a space): the split is then approximate, as in TRL, which warns too
    clean_split: bool = True


def read_preferences(path: Path) -> list[dict]:
    """jsonl file(s) of {prompt, chosen, rejected}; a bad row is an error naming file, line and field."""
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.exists() for f in files):
        raise ValueError(f"preference data not found: {path}")
    rows = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{n}: not JSON ({e})") from None
            for field in ("prompt", "chosen", "rejected"):
                value = row.get(field) if isinstance(row, dict) else None
                if not (isinstance(value, str) and value) and not _is_messages(value):
                    raise ValueError(f"{f}:{n}: field '{field}' must be a non-empty string or a list of "
                                     "{role, content} messages")
            if _is_messages(row["prompt"]) != _is_messages(row["chosen"]) or \
                    _is_messages(row["chosen"]) != _is_messages(row["rejected"]):
                raise ValueError(f"{f}:{n}: prompt, chosen and rejected must all be strings or all be messages")
            rows.append(row)
    return rows


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


def encode_pair(tok, row: dict) -> Pair:
    if _is_messages(row["prompt"]):
        prompt = _ids(tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True))
        chosen = _ids(tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=True))
        rejected = _ids(tok.apply_chat_template(row["prompt"] + row["rejected"], tokenize=True))
    else:
        eos = tok.eos_token
        prompt = tok(row["prompt"])["input_ids"]
        chosen = tok(row["prompt"] + _with_eos(row["chosen"], eos))["input_ids"]
        rejected = tok(row["prompt"] + _with_eos(row["rejected"], eos))["input_ids"]
    n = len(prompt)
    clean = list(chosen[:n]) == list(prompt) and list(rejected[:n]) == list(prompt)
    return Pair(list(prompt), list(chosen[n:]), list(rejected[n:]), clean)


def _ids(rendered) -> list[int]:
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def _with_eos(text: str, eos: str) -> str:
    return text if text.endswith(eos) else text + eos


def fits(pair: Pair, max_len: int) -> bool:
    return len(pair.prompt) < max_len


def collate(pairs: list[Pair], pad_id: int, max_len: int) -> dict:
    """[chosen_0 … chosen_n, rejected_0 … rejected_n], right-padded: input_ids, attention_mask, completion_mask."""
    seqs, masks = [], []
    for side in ("chosen", "rejected"):
        for p in pairs:
            completion = getattr(p, side)
            seqs.append((p.prompt + completion)[:max_len])
            masks.append(([0] * len(p.prompt) + [1] * len(completion))[:max_len])
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(seqs), width), dtype=np.int64)
    completion = np.zeros((len(seqs), width), dtype=np.int64)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)], attention[i, :len(s)], completion[i, :len(s)] = s, 1, m
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
            "completion_mask": torch.from_numpy(completion)}


def sequence_logps(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """Sum of the log-probabilities of each sequence's completion tokens (the policy's or the reference's)."""
    logits = logits[:, :-1].float()
    # gather - logsumexp: the log-softmax of the targets only, without a (rows, length, vocab) copy
    per_token = logits.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return (per_token * batch["completion_mask"][:, 1:]).sum(dim=1)
