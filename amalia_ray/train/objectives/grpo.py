"""GRPO (DeepSeek-R1): for each prompt, G completions sampled by the rollout engine (vLLM) with the current weights,
scored by the stage's rewards (rules, LLM judges: train/reward_scoring.py), advantages normalized within each
prompt's group, and TRL's GRPOTrainer loss: the PPO-clipped policy ratio times the advantage, with an optional k3 KL
penalty to the initial model weighted by the same ratio (TRL's `use_bias_correction_kl`), log-probabilities taken at
the sampling temperature, averaged over every completion token of the step (TRL's default `dapo` normalization).

Each rollout is trained on for `num_iterations` optimizer steps. On its first the policy is the one that sampled, so
the ratio is 1 and the clip never acts; the log-probabilities of that first pass are kept per completion and are the
"old" policy of the later passes, whose ratio the clip holds to [1 - epsilon, 1 + epsilon_high].

With `async_rollout` the next rollout is sampled while the last step on the current one trains, by the weights that
step starts from (one step off-policy: the schedule of veRL's one-step-off-policy recipe), so sampling overlaps the
trainer's step. The engine returns the log-probabilities of what it sampled, and they are the "old" policy of every step on that
rollout (as TRL's async GRPO), so the ratio is clipped from its first step on."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from amalia_ray.core.formats.shards import MixtureSampler, one_block
from amalia_ray.train.completions import pad_completions, token_logps
from amalia_ray.core.config import GRPOStage
from amalia_ray.train.lora import adapters_off
from amalia_ray.train.objectives.base import Objective, StageInputs
from amalia_ray.core.formats.rl_tasks import read_tasks
from amalia_ray.train.reward_scoring import RewardScorer, reward_labels
from amalia_ray.train.rollout_fleet import (encode_prompt, fleet_on_model, prompt_seeds, push_weights,
                                            score_completions)

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
                kl_coef: float = 0.0, *, old_logps: torch.Tensor | None = None, epsilon: float = 0.2,
                epsilon_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token loss -min(r·A, clip(r, 1 - epsilon, 1 + epsilon_high)·A) with r = exp(logp - old_logp) (old_logp
    None: the policy sampled, r = 1 in value and ∇log p in gradient), + kl_coef · r · k3 KL to the reference, as
    TRL's GRPOTrainer writes it. Returns the loss, the per-token k3 KL (None without a reference) and where the clip
    acted (the ratio past its bound on the side the advantage pushes it)."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logps - (logps.detach() if old_logps is None else old_logps))
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + high)
    a = advantages.unsqueeze(1)
    loss = -torch.min(ratio * a, clipped_ratio * a)
    kl = None
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        loss = loss + kl_coef * kl * ratio
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + high) & (a > 0))
    return loss, kl, clipped


class Sampled:
    """A rollout's completions already collected from the fleet (kept in a checkpoint, or waited for to be)."""

    def __init__(self, completions: list) -> None:
        self.completions = completions


class GRPO(Objective):
    name = "grpo"
    config = GRPOStage
    metrics = frozenset({"reward", "reward_std", "completion_length", "kl"})
    loss_panel = "grpo"

    @classmethod
    def from_stage(cls, stage: GRPOStage, inputs: StageInputs) -> GRPO:
        return cls(inputs.data_dir, inputs.tokenizer_dir, inputs.seq_len, stage, inputs.work_dir, inputs.seed,
                   inputs.use_gpu, inputs.step_transient, inputs.reward_apps, inputs.judge_servers)

    @classmethod
    def reported(cls, stage: GRPOStage, sources=()) -> set[str]:
        return (super().reported(stage) | {f"rewards/{label}" for label in reward_labels(stage.reward_sources)}
                | {"rewards/missing"} | ({"clip_ratio"} if stage.num_iterations > 1 or stage.async_rollout else set()))

    def __init__(self, data_path: Path, tokenizer_dir: Path, seq_len: int, stage: GRPOStage, work_dir: Path,
                 seed: int, use_gpu: bool = False, step_transient=None, reward_apps: dict[str, str] | None = None,
                 judge_servers: dict[str, dict] | None = None):
        from transformers import AutoTokenizer

        self.step_transient = step_transient  # tokens of a sequence -> bytes a step adds: left free beside the engine
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.tokenizer_dir, self.work_dir, self.seed, self.use_gpu = tokenizer_dir, work_dir, seed, use_gpu
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.seq_len = seq_len
        self.G, self.max_new = stage.num_generations, stage.max_completion_length
        self.temperature, self.kl_coef = stage.temperature, stage.kl_coef
        self.num_iterations, self.epsilon, self.epsilon_high = stage.num_iterations, stage.epsilon, stage.epsilon_high
        self.async_rollout = stage.async_rollout
        # async: the rollout being sampled (prompt rows, what rank 0 collects: the fleet's ref, or `Sampled`)
        self._next: tuple[np.ndarray, object] | None = None
        self.engine_config = stage.rollout.for_length(seq_len)
        # the base is the policy with its adapters off, unless modules_to_save train in place beside them
        self.lora = bool(stage.lora) and stage.lora.adapters_only
        self.engine_dtype = getattr(torch, self.engine_config.resolved_dtype(use_gpu))
        self.sequences = stage.global_batch_size
        self.scorer = RewardScorer(stage.reward_sources, stage.variety_model, reward_apps=reward_apps,
                                   judge_servers=judge_servers)
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
        self.fleet = self.reference = None
        # (prompt ids, completion ids, advantage, the engine's log-probabilities of the completion or None)
        self.buffer: list[tuple[list[int], list[int], float, list[float] | None]] = []
        self._stats: dict[str, tuple[float, float]] = {}
        self._rollout_stats: dict[str, tuple[float, float]] = {}
        # (sum, tokens) of the step's k3 KL and clipped tokens, kept on the device: no host sync per micro-batch
        self._kl, self._clipped = [0.0, 0], [0.0, 0]
        self._steps_on_rollout = 0  # optimizer steps taken on the current rollout so far
        self._steps_left = stage.steps  # async: no rollout is started after the stage's last step
        self.device: torch.device | None = None
        # a completion's log-probabilities under the policy that sampled it, from its rollout's first step
        self._old_logps: dict[int, torch.Tensor] = {}

    def sampler(self, seed: int) -> MixtureSampler:
        return MixtureSampler({"grpo": one_block(len(self.tasks))}, self.seq_len, seed)

    def num_validation(self) -> int:
        return 0

    def prepare(self, model, micro: int, rank: int, world: int, device: torch.device, frozen_copy=None) -> None:
        """Start the rollout engine on the initial weights (exported once as a HF folder it can load), and build
        the frozen reference from that export when a KL penalty is asked for: `frozen_copy(folder)` shards it over
        the workers like the policy, so no GPU holds a whole copy. With LoRA adapters only, the reference is the
        policy with its adapters switched off: no second model."""
        if self.async_rollout and self.use_gpu and self.engine_config.placement == "colocated":
            # a colocated engine is sized for the trainer's step beside it only while it sleeps through that step;
            # awake all the time it would also need the KL reference and any unsharded gradients
            raise ValueError("async_rollout samples while the trainer steps, so on GPU its engine needs a GPU of its "
                             "own: set rollout.placement: separate (or async_rollout: false)")
        self.device = device
        longest = max(map(len, self.prompts)) + self.max_new  # what a step's sequences are padded to
        step = self.step_transient(longest) if self.step_transient else 0
        self.fleet = fleet_on_model(model, self.tokenizer_dir, self.work_dir, self.engine_config, self.seed,
                                    self.use_gpu, self.sequences, longest, step, per_prompt=self.G)
        if self.kl_coef > 0 and not self.lora:
            self.reference = frozen_copy(self.work_dir / "rollout-init")

    def step_rows(self, model, sampler: MixtureSampler, global_batch_size: int) -> np.ndarray:
        """The step's rows are completions: every `num_iterations` steps a rollout, global_batch_size / G prompts
        drawn and G completions sampled for each with the current weights (pushed to the engine first); the steps
        between train on the same completions again. Every rank gets the same completions. Async, the rollout is the
        one sampled while the previous step trained, and the last step on a rollout starts the next one (with the
        weights it starts from) before it trains. A resumed stage goes on with the rollouts its checkpoint kept
        (`state_dict`). Records `rollout_wait_s`: how long rank 0 spent on the rollout in the step (weights
        pushed, completions sampled or, async, what was left of their sampling, scored, and async the next rollout
        started), part of `step_time_s`; about 0 on a step that trains on a rollout again."""
        started = time.perf_counter()
        prompts, at = global_batch_size // self.G, self._steps_on_rollout % self.num_iterations
        pushed = sampled = prompt_rows = None
        if at == 0:
            if self._next is None:  # sync, or the first step of an async stage: sample now
                push_weights(model, self.fleet, self.engine_dtype)
                pushed = True
                self._next = self._start_sampling(sampler, prompts)
            (prompt_rows, sampling), self._next = self._next, None
            sampled = self._collect(sampling)
            if sampled is not None and not self.async_rollout:
                self.fleet.sleep()  # colocated on GPU: the memory is the trainer's while it steps
        self._steps_left -= 1
        if self.async_rollout and at == self.num_iterations - 1 and self._steps_left > 0:
            if not pushed:
                push_weights(model, self.fleet, self.engine_dtype)
            self._next = self._start_sampling(sampler, prompts)
        if at == 0:  # scored while the next rollout samples
            self._share(prompt_rows, sampled)
            self._old_logps = {}
        self._steps_on_rollout += 1
        # every step on a rollout reports the rollout's rewards: they are those of the completions it trains on
        self._stats = dict(self._rollout_stats)
        self._stats["rollout_wait_s"] = (time.perf_counter() - started, 1) if dist.get_rank() == 0 else (0.0, 0)
        return np.arange(len(self.buffer))

    def _collect(self, sampling) -> list | None:
        """Rank 0: the completions of a rollout (waited for); None on other ranks."""
        if sampling is None:
            return None
        return sampling.completions if isinstance(sampling, Sampled) else self.fleet.collect(sampling)

    def state_dict(self) -> dict:
        """Where the stage stands between rollouts, so that a resumed stage trains on what this one would have: the
        rollout still being trained on (its completions with their advantages and reward statistics and, sync, every
        rank's log-probabilities of them from its first step, the policy that sampled them) and, async, the next
        rollout, waited for here (the step after a checkpoint does not overlap its sampling) and kept with its
        prompts. Without them a resumed stage would sample again, with other weights, and skip the prompts the lost
        rollout had drawn."""
        mid_rollout = self._steps_on_rollout % self.num_iterations != 0
        old_logps = None
        if mid_rollout and not self.async_rollout:  # each rank holds those of its own micro-batches
            mine = {str(k): v.float().tolist() for k, v in self._old_logps.items()}
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            old_logps = {k: v for part in gathered or () for k, v in part.items()}
        if dist.get_rank() != 0:
            return {}
        state = {"steps_left": self._steps_left, "steps_on_rollout": self._steps_on_rollout, "rollout": None,
                 "next": None}
        if mid_rollout:
            state["rollout"] = {"buffer": self.buffer, "stats": self._rollout_stats, "old_logps": old_logps}
        if self._next is not None:
            prompt_rows, sampling = self._next
            self._next = (prompt_rows, Sampled(self._collect(sampling)))
            state["next"] = {"prompt_rows": prompt_rows.tolist(), "completions": self._next[1].completions}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._steps_left, self._steps_on_rollout = state["steps_left"], state["steps_on_rollout"]
        if rollout := state["rollout"]:
            self.buffer = [tuple(item) for item in rollout["buffer"]]
            stats = {k: tuple(v) for k, v in rollout["stats"].items()}
            self._rollout_stats = stats if dist.get_rank() == 0 else {k: (0.0, 0) for k in stats}
            self._old_logps = {int(k): torch.tensor(v, device=self.device)
                               for k, v in (rollout["old_logps"] or {}).items()}
            if self.fleet is not None and not self.async_rollout:
                self.fleet.sleep()  # the steps left on this rollout train as they did: beside a sleeping engine
        if nxt := state["next"]:
            self._next = (np.asarray(nxt["prompt_rows"], dtype=np.int64),
                          Sampled(nxt["completions"]) if dist.get_rank() == 0 else None)

    def _share(self, prompt_rows: np.ndarray, sampled: list | None) -> None:
        """Rank 0 scores the completions and normalizes the rewards within each group; every rank gets the
        completions with their advantages (and, async, the engine's log-probabilities) into its buffer."""
        payload = [None]
        if dist.get_rank() == 0:
            logps = [lp for per_prompt in sampled for _, lp in per_prompt] if self.async_rollout else None
            if self.async_rollout:
                sampled = [[ids for ids, _ in per_prompt] for per_prompt in sampled]
            items, per_fn = score_completions(self.tok, [self.prompts[i] for i in prompt_rows],
                                              [self.tasks[i] for i in prompt_rows], sampled, self.scorer)
            rewards = self.scorer.totals(per_fn)
            advantages = group_advantages(rewards, self.G)
            stats = {"reward": _present_sum(rewards), "reward_std": _group_std_sum(rewards, self.G),
                     "completion_length": (float(sum(len(c) for _, c in items)), len(items)),
                     # completions left out of the advantages because a judge gave no grade (a count per step)
                     "rewards/missing": (float(rewards.isnan().sum()), 1),
                     **{f"rewards/{label}": _present_sum(per_fn[:, k]) for k, label in enumerate(self.scorer.labels)}}
            payload = [([(p, c, a, lp) for (p, c), a, lp in zip(items, advantages.tolist(),
                                                                logps or [None] * len(items))], stats)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        self.buffer, stats = payload[0]
        self._rollout_stats = stats if dist.get_rank() == 0 else {k: (0.0, 0) for k in stats}

    def _start_sampling(self, sampler: MixtureSampler, prompts: int) -> tuple[np.ndarray, object]:
        """Draw the next rollout's prompts; rank 0 asks the fleet for G completions of each, seeded by the prompt's
        position in the stage's prompt stream (what `collect` waits on; None on other ranks)."""
        first = sampler.cursors["grpo"]
        prompt_rows = sampler.next_rows(prompts)
        if dist.get_rank() != 0:
            return prompt_rows, None
        return prompt_rows, self.fleet.submit([self.prompts[i] for i in prompt_rows], self.G, self.max_new,
                                              self.temperature, self.async_rollout,
                                              prompt_seeds(self.seed, first, len(prompt_rows), self.G))

    def batch(self, rows: np.ndarray, split: str = "train") -> dict:
        chosen = [self.buffer[i] for i in rows]
        batch = pad_completions([(p, c) for p, c, _, _ in chosen], self.pad_id, self.seq_len)
        batch["advantages"] = torch.tensor([a for _, _, a, _ in chosen], dtype=torch.float32)
        batch["rows"] = torch.as_tensor(np.asarray(rows, dtype=np.int64))  # which completions: their old logps
        if self.async_rollout:  # the engine's log-probability of each completion token, where token_logps has it
            width = batch["input_ids"].size(1) - 1
            sampling = torch.zeros(len(chosen), width)
            for i, (p, _, _, lp) in enumerate(chosen):
                at = lp[:max(0, width - (len(p) - 1))]
                sampling[i, len(p) - 1:len(p) - 1 + len(at)] = torch.tensor(at, dtype=torch.float32)
            batch["sampling_logps"] = sampling
        return batch

    def _sampling_logps(self, rows: torch.Tensor, logps: torch.Tensor) -> torch.Tensor | None:
        """The log-probabilities these completions had under the policy that sampled them: kept from their rollout's
        first step (where that policy is the one being trained, so None: the ratio is 1) for its later steps."""
        if self.num_iterations == 1:
            return None
        keys = rows.tolist()
        if not all(k in self._old_logps for k in keys):
            for k, row in zip(keys, logps.detach()):
                self._old_logps.setdefault(k, row)
            return None
        width = logps.size(1)
        return torch.stack([F.pad(self._old_logps[k][:width], (0, max(0, width - len(self._old_logps[k]))))
                            for k in keys])

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        logps = token_logps(model, batch, self.temperature)
        mask = batch["completion_mask"][:, 1:].to(logps.dtype)
        ref = None
        if self.kl_coef > 0:
            with torch.no_grad(), adapters_off(model) if self.lora else nullcontext():
                ref = token_logps(model if self.lora else self.reference, batch, self.temperature)
            if not self.lora:
                self.reference.reshard()  # FSDP2 keeps the root module gathered after a forward without backward
        old = batch["sampling_logps"] if self.async_rollout else self._sampling_logps(batch["rows"], logps)
        if old is not None:  # the old policy where there is a completion token; elsewhere the ratio is 1
            old = torch.where(mask.bool(), old, logps.detach())
        per_token, kl, clipped = policy_loss(logps, batch["advantages"], ref, self.kl_coef, old_logps=old,
                                             epsilon=self.epsilon, epsilon_high=self.epsilon_high)
        if kl is not None:
            self._kl = [self._kl[0] + (kl.detach() * mask).sum(), self._kl[1] + mask.sum()]
        if self.num_iterations > 1 or self.async_rollout:
            self._clipped = [self._clipped[0] + (clipped * mask).sum(), self._clipped[1] + mask.sum()]
        return (per_token * mask).sum(), int(mask.sum())

    def take_metrics(self) -> dict[str, tuple[float, float]]:
        out = dict(self._stats)
        if self.kl_coef > 0:
            out["kl"] = tuple(float(x) for x in self._kl)  # the mean k3, not weighted by the ratio
        if self.num_iterations > 1 or self.async_rollout:
            out["clip_ratio"] = tuple(float(x) for x in self._clipped)  # share of tokens whose ratio it held
        self._stats, self._kl, self._clipped = {k: (0.0, 0) for k in self._stats}, [0.0, 0], [0.0, 0]
        return out
