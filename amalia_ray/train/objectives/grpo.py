"""GRPO (DeepSeek-R1): for each prompt, G completions sampled by the rollout engine (vLLM) with the current weights,
scored by the stage's rewards (rules, LLM judges: train/reward_scoring.py), advantages normalized within each
prompt's group, policy-gradient loss with an optional k3 KL penalty to the initial model. Losses are averaged over
every completion token of the step (TRL's default `dapo` normalization). One optimizer step per rollout (TRL's
`num_iterations=1`): the sampling policy is the one being updated, so the policy ratio is 1 and PPO's clip never
acts; it is left out rather than offered as a setting that changes nothing."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from amalia_ray.core.formats.shards import MixtureSampler, one_block
from amalia_ray.train.completions import pad_completions, token_logps
from amalia_ray.core.config import GRPOStage
from amalia_ray.train.lora import adapters_off
from amalia_ray.train.objectives.base import Objective, StageInputs
from amalia_ray.core.formats.rl_tasks import read_tasks
from amalia_ray.train.reward_scoring import RewardScorer, reward_labels
from amalia_ray.train.rollout import encode_prompt, engine_on_model, push_weights, sample_and_score

log = logging.getLogger("amalia_ray.train")


def group_advantages(rewards: torch.Tensor, group: int, scale: bool = True) -> torch.Tensor:
    """(reward - mean of its group) / (std of its group + 1e-4), std with Bessel's correction, as TRL. A missing
    reward (NaN: a judge gave no grade) is left out of its group's mean and std and gets advantage 0: no policy
    gradient from it (it still counts in the step's token average and, with a KL penalty, in the KL term)."""
    grouped = rewards.view(-1, group)
    present = ~torch.isnan(grouped)
    if present.all():
        advantages = grouped - grouped.mean(dim=1, keepdim=True)
        if scale:
            advantages = advantages / (grouped.std(dim=1, keepdim=True) + 1e-4)
        return advantages.reshape(-1)
    n = present.sum(dim=1, keepdim=True)
    centered = torch.where(present, grouped - torch.where(present, grouped, 0.0).sum(dim=1, keepdim=True)
                           / n.clamp(min=1), 0.0)
    if scale:
        std = ((centered ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centered = centered / (std + 1e-4)
    return centered.reshape(-1)


def _present_sum(values: torch.Tensor) -> tuple[float, int]:
    """(sum, count) of the values that are not missing (NaN)."""
    present = ~values.isnan()
    return values[present].sum().item(), int(present.sum())


def _group_std_sum(rewards: torch.Tensor, group: int) -> tuple[float, int]:
    """(sum, count) of the groups' reward std (Bessel), over the groups with two rewards or more present."""
    stds = [g[~g.isnan()].std().item() for g in rewards.view(-1, group) if int((~g.isnan()).sum()) >= 2]
    return float(sum(stds)), len(stds)


def policy_loss(logps: torch.Tensor, advantages: torch.Tensor, ref_logps: torch.Tensor | None = None,
                kl_coef: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Per-token loss -r·A with r = exp(logp - logp.detach()) (1 in value, ∇log p in gradient, as TRL writes it)
    (+ kl_coef · k3 KL to the reference), and the per-token KL."""
    ratio = torch.exp(logps - logps.detach())
    loss = -ratio * advantages.unsqueeze(1)
    kl = None
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        loss = loss + kl_coef * kl
    return loss, kl


class GRPO(Objective):
    name = "grpo"
    config = GRPOStage
    metrics = frozenset({"reward", "reward_std", "completion_length", "kl"})
    loss_panel = "grpo"

    @classmethod
    def from_stage(cls, stage: GRPOStage, inputs: StageInputs) -> GRPO:
        return cls(inputs.data_dir, inputs.tokenizer_dir, inputs.seq_len, stage, inputs.work_dir, inputs.seed,
                   inputs.use_gpu, inputs.step_transient)

    @classmethod
    def reported(cls, stage: GRPOStage, sources=()) -> set[str]:
        return super().reported(stage) | {f"rewards/{label}" for label in reward_labels(stage.reward_sources)} | {
            "rewards/missing"}

    def __init__(self, data_path: Path, tokenizer_dir: Path, seq_len: int, stage: GRPOStage, work_dir: Path,
                 seed: int, use_gpu: bool = False, step_transient=None):
        from transformers import AutoTokenizer

        self.step_transient = step_transient  # tokens of a sequence -> bytes a step adds: left free beside the engine
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.tokenizer_dir, self.work_dir, self.seed, self.use_gpu = tokenizer_dir, work_dir, seed, use_gpu
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.seq_len = seq_len
        self.G, self.max_new = stage.num_generations, stage.max_completion_length
        self.temperature, self.kl_coef = stage.temperature, stage.kl_coef
        self.engine_config = stage.rollout.for_length(seq_len)
        # the base is the policy with its adapters off, unless modules_to_save train in place beside them
        self.lora = bool(stage.lora) and stage.lora.adapters_only
        self.engine_dtype = getattr(torch, self.engine_config.resolved_dtype(use_gpu))
        self.sequences = stage.global_batch_size
        self.scorer = RewardScorer(stage.reward_sources, stage.variety_model)
        self.tasks, self.prompts, dropped = [], [], 0
        for row in read_tasks(data_path):
            ids = encode_prompt(self.tok, row["prompt"])
            if len(ids) + self.max_new > seq_len:
                dropped += 1
                continue
            self.tasks.append(row)
            self.prompts.append(ids)
        if not self.tasks:
            raise ValueError(f"no task in {data_path} whose prompt leaves room for {self.max_new} completion tokens "
                             f"in seq_len {seq_len}")
        if dropped:
            log.warning(f"{data_path}: {dropped} task(s) dropped: prompt + max_completion_length > seq_len {seq_len}")
        self.engine = self.reference = None
        self.buffer: list[tuple[list[int], list[int], float]] = []
        self._stats: dict[str, tuple[float, float]] = {}
        self._kl = [0.0, 0]

    def sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler({"grpo": one_block(len(self.tasks))}, self.seq_len, seed)

    def num_validation(self) -> int:
        return 0

    def prepare(self, model, micro: int, rank: int, world: int, device: torch.device, frozen_copy=None) -> None:
        """Start the rollout engine on the initial weights (exported once as a HF folder it can load), and build
        the frozen reference from that export when a KL penalty is asked for: `frozen_copy(folder)` shards it over
        the workers like the policy, so no GPU holds a whole copy. With LoRA adapters only, the reference is the
        policy with its adapters switched off: no second model."""
        longest = max(map(len, self.prompts)) + self.max_new  # what a step's sequences are padded to
        step = self.step_transient(longest) if self.step_transient else 0
        self.engine = engine_on_model(model, self.tokenizer_dir, self.work_dir, self.engine_config, self.seed, self.use_gpu,
                                      self.sequences, longest, step)
        if self.kl_coef > 0 and not self.lora:
            self.reference = frozen_copy(self.work_dir / "rollout-init")

    def step_rows(self, model, sampler: MixtureSampler, global_batch_size: int) -> np.ndarray:
        """The step's rows are completions: global_batch_size / G prompts drawn, G completions sampled for each."""
        return self.rollout(model, sampler.next_rows(global_batch_size // self.G))

    def rollout(self, model, prompt_rows: np.ndarray) -> np.ndarray:
        """Push the current weights to the engine, sample G completions per prompt, score and normalize within each
        group; every rank gets the same completions. Returns the rows (completions) of this step."""
        push_weights(model, self.engine, self.engine_dtype)
        payload = [None]
        if dist.get_rank() == 0:
            prompts = [self.prompts[i] for i in prompt_rows]
            items, per_fn = sample_and_score(self.engine, self.tok, prompts, [self.tasks[i] for i in prompt_rows],
                                             self.scorer, self.G, self.max_new, self.temperature)
            rewards = self.scorer.totals(per_fn)
            advantages = group_advantages(rewards, self.G)
            stats = {"reward": _present_sum(rewards), "reward_std": _group_std_sum(rewards, self.G),
                     "completion_length": (float(sum(len(c) for _, c in items)), len(items)),
                     # completions left out of the advantages because a judge gave no grade (a count per step)
                     "rewards/missing": (float(rewards.isnan().sum()), 1),
                     **{f"rewards/{label}": _present_sum(per_fn[:, k]) for k, label in enumerate(self.scorer.labels)}}
            payload = [([(p, c, a) for (p, c), a in zip(items, advantages.tolist())], stats)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        self.buffer, stats = payload[0]
        self._stats = stats if dist.get_rank() == 0 else {k: (0.0, 0) for k in stats}
        return np.arange(len(self.buffer))

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        chosen = [self.buffer[i] for i in rows]
        batch = pad_completions([(p, c) for p, c, _ in chosen], self.pad_id, self.seq_len)
        batch["advantages"] = torch.tensor([a for _, _, a in chosen], dtype=torch.float32)
        return batch

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        logps = token_logps(model, batch)
        mask = batch["completion_mask"][:, 1:].to(logps.dtype)
        ref = None
        if self.kl_coef > 0:
            with torch.no_grad(), adapters_off(model) if self.lora else nullcontext():
                ref = token_logps(model if self.lora else self.reference, batch)
            if not self.lora:
                self.reference.reshard()  # FSDP2 keeps the root module gathered after a forward without backward
        per_token, kl = policy_loss(logps, batch["advantages"], ref, self.kl_coef)
        if kl is not None:
            self._kl = [self._kl[0] + (kl * mask).sum().item(), self._kl[1] + int(mask.sum())]
        return (per_token * mask).sum(), int(mask.sum())

    def take_metrics(self) -> dict[str, tuple[float, float]]:
        out = dict(self._stats)
        if self.kl_coef > 0:
            out["kl"] = tuple(self._kl)
        self._stats, self._kl = {k: (0.0, 0) for k in self._stats}, [0.0, 0]
        return out
