"""DPO on preference pairs in TRL's format (core/formats/preference_pairs.py), or on pairs the stage's initial model
makes from task prompts (on-policy).

Tokenized the way TRL's DPOTrainer does it, so losses agree: the prompt is rendered with the generation prompt, each
completion is what prompt+completion adds after the prompt's tokens; plain-string completions get the EOS token. A
pair longer than `max_len` keeps its start (TRL's default `keep_start`); a pair whose prompt alone fills `max_len`
is dropped (nothing left to score).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from amalia_ray.core.config import DPOStage
from amalia_ray.core.formats.shards import MixtureSampler, one_block
from amalia_ray.core.formats.jsonl import is_messages
from amalia_ray.core.formats.preference_pairs import read_preferences
from amalia_ray.train.completions import pad_completions, token_logps
from amalia_ray.train.objectives.base import Objective, StageInputs

log = logging.getLogger("amalia_ray.train")
PAIRS = "on-policy-pairs.json"  # in the stage folder: the pairs as token ids, for the run's later attempts


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    # False when prompt+answer does not tokenize as prompt tokens then answer tokens (a merge across the boundary,
    # e.g. a prompt ending in a space): the split is then approximate, as in TRL, which warns too
    clean_split: bool = True


def encode_pair(tok, row: dict) -> Pair:
    if is_messages(row["prompt"]):
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


class DPO(Objective):
    """Direct preference optimization (sigmoid loss with β) on {prompt, chosen, rejected} pairs. The reference
    log-probabilities come from their own pass over every pair with the stage's initial weights (TRL's
    `precompute_ref_log_probs`), so no second model is held during training; a resumed attempt recomputes them from
    the same initial weights before restoring the checkpoint."""

    name = "dpo"
    config = DPOStage
    REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    metrics = frozenset({"val_loss", *REWARDS})
    loss_panel = "dpo"

    def __init__(self, data_path: Path, tokenizer_dir: Path, seq_len: int, beta: float,
                 validation_fraction: float = 0.05):
        self._setup(tokenizer_dir, seq_len, beta)
        for row in read_preferences(data_path):
            pair = encode_pair(self.tok, row)
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

    @classmethod
    def from_stage(cls, stage: DPOStage, inputs: StageInputs) -> DPO:
        if stage.on_policy:
            return cls.from_policy(inputs.data_dir, inputs.tokenizer_dir, inputs.seq_len, stage, inputs.work_dir,
                                   inputs.seed, inputs.use_gpu, reward_apps=inputs.reward_apps,
                                   judge_servers=inputs.judge_servers, run_id=inputs.run_id)
        return cls(inputs.data_dir, inputs.tokenizer_dir, inputs.seq_len, stage.beta)

    def _setup(self, tokenizer_dir: Path, seq_len: int, beta: float) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.seq_len, self.beta = seq_len, beta
        self.pairs: dict[str, list] = {"train": [], "validation": []}
        self.dropped = 0
        self.reference: dict[str, torch.Tensor] = {}
        self._sums, self._pairs = torch.zeros(len(self.REWARDS), dtype=torch.float64), 0
        self.on_policy: dict | None = None

    @classmethod
    def from_policy(cls, tasks_path: Path, tokenizer_dir: Path, seq_len: int, stage: DPOStage, work_dir: Path,
                    seed: int, use_gpu: bool = False, validation_fraction: float = 0.05,
                    reward_apps: dict[str, str] | None = None, judge_servers: dict[str, dict] | None = None,
                    run_id: str = "") -> DPO:
        """AMALIA-style on-policy DPO: the pairs are made in `prepare` by the stage's initial model (the previous
        stage's checkpoint) — `num_generations` completions per task prompt sampled through the vLLM rollout engine,
        scored by the stage's rewards; the best becomes chosen and the worst rejected (ties give no pair). They are
        kept in the stage folder for `run_id`: a later attempt of the same run (resumed after a failure) trains on
        the same pairs instead of sampling and scoring again, which would give others (engines and judges are not
        deterministic) under a data order restored for these."""
        from amalia_ray.core.formats.rl_tasks import read_tasks
        from amalia_ray.train.reward_scoring import RewardScorer
        from amalia_ray.train.rollout_fleet import encode_prompt

        self = cls.__new__(cls)
        self._setup(tokenizer_dir, seq_len, stage.beta)
        tasks = list(read_tasks(tasks_path))
        prompts = [encode_prompt(self.tok, t["prompt"]) for t in tasks]
        keep = [i for i, p in enumerate(prompts) if len(p) + stage.max_completion_length <= seq_len]
        self.dropped = len(tasks) - len(keep)
        if self.dropped:
            log.warning(f"{tasks_path}: {self.dropped} prompt(s) leave no room for {stage.max_completion_length} "
                        f"completion tokens in seq_len {seq_len}: skipped")
        self.on_policy = {"tasks": [tasks[i] for i in keep], "prompts": [prompts[i] for i in keep],
                          "scorer": RewardScorer(stage.reward_sources, stage.variety_model, reward_apps=reward_apps,
                                                 judge_servers=judge_servers),
                          "engine": stage.rollout.for_length(seq_len),
                          "stage": stage, "tokenizer_dir": tokenizer_dir, "work_dir": work_dir, "seed": seed,
                          "use_gpu": use_gpu, "validation_fraction": validation_fraction, "source": tasks_path,
                          "run_id": run_id}
        if not keep:
            raise ValueError(f"no task in {tasks_path} whose prompt leaves room for "
                             f"{stage.max_completion_length} completion tokens in seq_len {seq_len}")
        return self

    def _make_pairs(self, model) -> None:
        """Rank 0 samples and ranks candidates, or reads those an earlier attempt of this run made; every rank gets
        the same pairs. Also written to on-policy-pairs.jsonl in the stage folder, decoded, for inspection."""
        from amalia_ray.train.parallel import rank0_group
        from amalia_ray.train.rollout_fleet import fleet_on_model, sample_and_score

        cfg, stage = self.on_policy, self.on_policy["stage"]
        n = stage.num_generations
        kept = self._kept_pairs() if dist.get_rank() == 0 else None
        reuse = [kept is not None]  # the decision first (every rank starts a fleet or none), the pairs once below
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(reuse, src=0)
        if reuse[0]:
            payload = [kept]
            log.info(f"on-policy DPO: the pairs an earlier attempt of this run sampled ({cfg['work_dir'] / PAIRS})")
        else:
            fleet = fleet_on_model(model, cfg["tokenizer_dir"], cfg["work_dir"], cfg["engine"], cfg["seed"],
                                   cfg["use_gpu"], len(cfg["prompts"]) * n,
                                   max(map(len, cfg["prompts"])) + stage.max_completion_length,
                                   weight_sync=False, per_prompt=n)  # it samples once, with the weights it starts from
            payload = [self._sample_pairs(fleet, sample_and_score) if dist.get_rank() == 0 else None]
        if dist.get_world_size() > 1:  # the others wait while rank 0 samples: past the step collectives' timeout
            dist.broadcast_object_list(payload, src=0, group=rank0_group())
        pairs, ties, missing = payload[0]
        if not pairs:
            raise ValueError(f"on-policy DPO on {cfg['source']}: every prompt's {stage.num_generations} "
                             "candidates scored the same, so there is no preference to learn; use rewards that "
                             "separate them, more generations or a higher temperature")
        log.info(f"on-policy DPO: {len(pairs)} pairs from {len(cfg['prompts'])} prompts ({ties} ties or prompts "
                 f"with fewer than two graded candidates skipped; {missing} candidates without a judge's grade)")
        for i, pair in enumerate(pairs):
            key = json.dumps([pair.prompt, i]).encode()
            split = "validation" if zlib.crc32(key) / 2**32 < cfg["validation_fraction"] else "train"
            self.pairs[split].append(pair)
        if not self.pairs["train"]:
            self.pairs = {"train": self.pairs["validation"], "validation": []}

    def _pairs_key(self) -> str | None:
        """What the kept pairs must have been made for: this run (config, inputs and code: its fingerprint) and
        these prompts; None outside a named run (nothing is kept)."""
        cfg = self.on_policy
        if not cfg["run_id"]:
            return None
        return hashlib.sha256(json.dumps([cfg["run_id"], cfg["prompts"]]).encode()).hexdigest()

    def _kept_pairs(self) -> tuple | None:
        """(pairs, ties, missing) an earlier attempt of this run kept, else None (none, another run's, unreadable)."""
        path, key = self.on_policy["work_dir"] / PAIRS, self._pairs_key()
        if key is None or not path.is_file():
            return None
        try:
            kept = json.loads(path.read_text())
            if kept.get("key") != key:
                return None
            return ([Pair(*(list(map(int, side)) for side in p[:3])) for p in kept["pairs"]], int(kept["ties"]),
                    int(kept["missing"]))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning(f"{path}: unreadable ({type(e).__name__}): sampling the pairs again")
            return None

    def _sample_pairs(self, fleet, sample_and_score) -> tuple:
        """Rank 0: sample, score and pair the candidates; keep them for a later attempt of this run."""
        cfg, stage = self.on_policy, self.on_policy["stage"]
        n = stage.num_generations
        try:
            items, scores = sample_and_score(fleet, self.tok, cfg["prompts"], cfg["tasks"], cfg["scorer"], n,
                                             stage.max_completion_length, stage.temperature, cfg["seed"])
        finally:
            fleet.shutdown()
        totals = cfg["scorer"].totals(scores).view(-1, n)
        pairs, ties, missing = [], 0, int(totals.isnan().sum())
        for i, group in enumerate(totals):
            # a candidate a judge gave no grade is neither chosen nor rejected
            best = int(torch.where(group.isnan(), -torch.inf, group).argmax())
            worst = int(torch.where(group.isnan(), torch.inf, group).argmin())
            if int((~group.isnan()).sum()) < 2 or group[best] == group[worst]:
                ties += 1
                continue
            prompt = items[i * n][0]
            pairs.append(Pair(prompt, items[i * n + best][1], items[i * n + worst][1]))
        if (key := self._pairs_key()) is not None:  # written whole, then renamed: an attempt killed meanwhile
            partial = cfg["work_dir"] / (PAIRS + ".partial")  # leaves no half file for the next one to read
            partial.write_text(json.dumps({"key": key, "ties": ties, "missing": missing,
                                           "pairs": [[p.prompt, p.chosen, p.rejected] for p in pairs]}))
            os.replace(partial, cfg["work_dir"] / PAIRS)
        with (cfg["work_dir"] / "on-policy-pairs.jsonl").open("w", encoding="utf-8") as f:
            for p in pairs:
                f.write(json.dumps({"prompt": self.tok.decode(p.prompt), "chosen": self.tok.decode(p.chosen),
                                    "rejected": self.tok.decode(p.rejected)}, ensure_ascii=False) + "\n")
        return pairs, ties, missing

    def sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler({"dpo": one_block(len(self.pairs["train"]))}, self.seq_len, seed)

    def num_validation(self) -> int:
        return len(self.pairs["validation"])

    def _collate(self, rows: np.ndarray, split: str) -> dict:
        return collate([self.pairs[split][i] for i in rows], self.pad_id, self.seq_len)

    @torch.no_grad()
    def prepare(self, model, micro: int, rank: int, world: int, device: torch.device, frozen_copy=None) -> None:
        if self.on_policy and not self.pairs["train"]:
            self._make_pairs(model)
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
