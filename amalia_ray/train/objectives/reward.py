"""A reward model on preference pairs, as TRL's RewardTrainer trains one: each side of a pair rendered whole
(core/reward_text.py), scored by a sequence classifier with one output, and the Bradley–Terry loss
-log σ(r(chosen) - r(rejected) - margin), plus TRL's optional centering term. A pair with a side longer than
`seq_len` is left out (TRL filters them too: a cut answer is not the answer that was preferred)."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from amalia_ray.core.config import RewardStage
from amalia_ray.core.formats.preference_pairs import read_reward_pairs
from amalia_ray.core.formats.shards import MixtureSampler, one_block
from amalia_ray.core.reward_text import reward_input_ids
from amalia_ray.train.completions import pad_completions
from amalia_ray.train.objectives.base import Objective, StageInputs

log = logging.getLogger("amalia_ray.train")


def sequence_scores(model, batch: dict) -> torch.Tensor:
    """The reward of each sequence of the batch: the score head's one output at its last token that is not
    padding (transformers' sequence classifiers pool there)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return out.logits.squeeze(-1).float()


class Reward(Objective):
    name = "reward"
    config = RewardStage
    head = "score"
    METRICS = ("accuracy", "margin", "mean_reward")
    metrics = frozenset({"val_loss", *METRICS})
    loss_panel = "reward"

    def __init__(self, data_path: Path, tokenizer_dir: Path, seq_len: int,
                 center_rewards_coefficient: float | None = None, validation_fraction: float = 0.05):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.center, self.seq_len = center_rewards_coefficient, seq_len
        self.pairs: dict[str, list[tuple[list[int], list[int], float]]] = {"train": [], "validation": []}
        too_long = 0
        for row in read_reward_pairs(data_path):
            prompt = row.get("prompt")
            chosen = reward_input_ids(self.tok, prompt, row["chosen"])
            rejected = reward_input_ids(self.tok, prompt, row["rejected"])
            if max(len(chosen), len(rejected)) > seq_len:
                too_long += 1
                continue
            key = json.dumps(row, sort_keys=True, ensure_ascii=False).encode()
            split = "validation" if zlib.crc32(key) / 2**32 < validation_fraction else "train"
            self.pairs[split].append((chosen, rejected, float(row.get("margin") or 0.0)))
        if too_long:
            log.warning(f"{data_path}: {too_long} pair(s) with a side longer than seq_len {seq_len} left out")
        if not self.pairs["train"]:
            raise ValueError(f"no preference pair in {data_path} whose sides fit in seq_len {seq_len}")
        self._sums, self._pairs, self._scored = torch.zeros(len(self.METRICS), dtype=torch.float64), 0, 0

    @classmethod
    def from_stage(cls, stage: RewardStage, inputs: StageInputs) -> Reward:
        return cls(inputs.data_dir, inputs.tokenizer_dir, inputs.seq_len, stage.center_rewards_coefficient)

    def model_config(self, hf_config):
        """One output, and the pad id the batches are padded with: the classifier finds each sequence's last token
        by it (TRL sets it from the tokenizer the same way)."""
        hf_config.num_labels = 1
        hf_config.pad_token_id = self.pad_id
        # a composite config (a text_config inside) keeps the classifier's pad id on its text config
        hf_config.get_text_config().pad_token_id = self.pad_id
        return hf_config

    def sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler({"reward": one_block(len(self.pairs["train"]))}, self.seq_len, seed)

    def num_validation(self) -> int:
        return len(self.pairs["validation"])

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        pairs = [self.pairs[split][i] for i in rows]
        # [chosen_0 … chosen_n, rejected_0 … rejected_n], right-padded; each side is whole (no prompt to mask)
        batch = pad_completions([([], p[0]) for p in pairs] + [([], p[1]) for p in pairs], self.pad_id, self.seq_len)
        del batch["completion_mask"]
        batch["margin"] = torch.tensor([p[2] for p in pairs], dtype=torch.float32)
        return batch

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        chosen, rejected = sequence_scores(model, batch).chunk(2)
        losses = -F.logsigmoid(chosen - rejected - batch["margin"])
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        if model.training:
            with torch.no_grad():
                self._sums += torch.stack([(chosen > rejected).sum(), (chosen - rejected).sum(),
                                           (chosen + rejected).sum() / 2]).double().cpu()
            self._pairs += len(losses)
        return losses.sum(), len(losses)

    def take_metrics(self) -> dict[str, tuple[float, float]]:
        sums, pairs, self._sums, self._pairs = self._sums, self._pairs, torch.zeros_like(self._sums), 0
        return {name: (value, pairs) for name, value in zip(self.METRICS, sums.tolist())}
