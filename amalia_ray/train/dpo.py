"""DPO: the objective, and its preference pairs in TRL's format: jsonl rows {prompt, chosen, rejected}, either plain strings
(standard) or lists of {role, content} messages (conversational: prompt = the turns before the answer, chosen /
rejected = the competing assistant turn).

Tokenized the way TRL's DPOTrainer does it, so losses agree: the prompt is rendered with the generation prompt, each
completion is what prompt+completion adds after the prompt's tokens; plain-string completions get the EOS token. A
pair longer than `max_len` keeps its start (TRL's default `keep_start`); a pair whose prompt alone fills `max_len`
is dropped (nothing left to score).
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from amalia_ray.core.shards import MixtureSampler
from amalia_ray.train.completions import pad_completions, token_logps

log = logging.getLogger("amalia_ray.train")


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
    return pad_completions([(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs], pad_id,
                           max_len)


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """Sum of the log-probabilities of each sequence's completion tokens (the policy's or the reference's)."""
    return (token_logps(model, batch) * batch["completion_mask"][:, 1:]).sum(dim=1)


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
        self._sums, self._pairs = torch.zeros(len(self.REWARDS), dtype=torch.float64), 0

    def sampler(self, seed: int, curriculum: dict | None = None) -> MixtureSampler:
        if curriculum:
            raise ValueError("curriculum applies to pretraining sources; a dpo stage reads one preference set")
        return MixtureSampler({"dpo": np.arange(len(self.pairs["train"]))}, self.seq_len, seed)

    def num_validation(self) -> int:
        return len(self.pairs["validation"])

    def _collate(self, rows: np.ndarray, split: str) -> dict:
        return collate([self.pairs[split][i] for i in rows], self.pad_id, self.seq_len)

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
                both = sequence_logps(model, batch).double().cpu()
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
        chosen, rejected = sequence_logps(model, batch).chunk(2)
        chosen_reward = self.beta * (chosen - batch["ref_chosen_logps"])
        rejected_reward = self.beta * (rejected - batch["ref_rejected_logps"])
        losses = -F.logsigmoid(chosen_reward - rejected_reward)
        if model.training:
            with torch.no_grad():
                self._sums += torch.stack([chosen_reward.sum(), rejected_reward.sum(),
                                           (chosen_reward - rejected_reward).sum(),
                                           (chosen_reward > rejected_reward).sum()]).double().cpu()
            self._pairs += len(losses)
        return losses.sum(), len(losses)

    def take_metrics(self) -> dict[str, tuple[float, float]]:
        sums, pairs, self._sums, self._pairs = self._sums, self._pairs, torch.zeros_like(self._sums), 0
        return {name: (value, pairs) for name, value in zip(self.REWARDS, sums.tolist())}
