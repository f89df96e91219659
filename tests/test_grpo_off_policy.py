"""GRPO when the policy is no longer the one that sampled: several optimizer steps on one rollout (`num_iterations`)
and one-step-off-policy rollouts (`async_rollout`). The clipped loss of the first two steps on one rollout equals
TRL's GRPOTrainer on the same completions, run through our training loop's own step; the async schedule samples each
rollout with the weights of the step before the one that trains on it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from amalia_ray.train.objectives import grpo as grpo_module
from amalia_ray.train.objectives.grpo import GRPO, policy_loss


def test_the_clip_holds_the_ratio_on_the_side_the_advantage_pushes():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]])).requires_grad_()
    advantages = torch.tensor([1.0])
    loss, kl, clipped = policy_loss(logps, advantages, old_logps=old, epsilon=0.2, epsilon_high=0.28)
    # A > 0: the ratio is held below 1.28 (1.5 clipped, no gradient), above it is free (0.5 keeps its gradient)
    assert torch.allclose(loss, -torch.tensor([[1.28, 0.5, 1.1, 1.28]])) and kl is None
    assert clipped.tolist() == [[True, False, False, True]]
    loss.sum().backward()
    assert torch.allclose(logps.grad, torch.tensor([[0.0, -0.5, -1.1, 0.0]]))
    loss, _, clipped = policy_loss(logps.detach(), -advantages, old_logps=old, epsilon=0.2)
    assert torch.allclose(loss, torch.tensor([[1.5, 0.8, 1.1, 1.5]])) and clipped.tolist() == [[False, True, False,
                                                                                                  False]]
    # the KL term is weighted by the ratio (TRL's use_bias_correction_kl): plain k3 at ratio 1, twice it at 2
    ref = torch.tensor([[-1.0, -1.0]])
    at = torch.tensor([[-1.0, -2.0]])
    loss, kl, _ = policy_loss(at, torch.tensor([0.0]), ref, 0.1)
    assert torch.allclose(loss, 0.1 * kl) and kl[0, 0] == 0 and kl[0, 1] > 0
    loss, kl, _ = policy_loss(at, torch.tensor([0.0]), ref, 0.1, old_logps=at - torch.log(torch.tensor(2.0)))
    assert torch.allclose(loss, 0.2 * kl)


def _equal_length_prompts(tok, count: int) -> list[str]:
    by_length: dict[int, list[str]] = {}
    for i in range(200):
        text = f"Quanto é {i} + {i + 1}?"
        by_length.setdefault(len(tok(text, add_special_tokens=False)["input_ids"]), []).append(text)
    return next(texts[:count] for texts in sorted(by_length.values(), key=len, reverse=True))


def test_two_steps_on_one_rollout_give_trl_grpo_trainers_losses(tmp_path, monkeypatch):
    """TRL 1.13's GRPOTrainer with num_iterations=2, clip-higher, a KL penalty and temperature 0.7, on 3 prompts × 4
    completions given to both (its generation replaced by the same completions), and our GRPO objective through the
    loop's `train_step` (FSDP2, three micro-batches): the losses of both steps agree within 1e-5 — the second one
    against the log-probabilities our first step kept, after one AdamW step on each side."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from amalia_ray.core.config import train_stage
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.train.loop import LoopConfig, Training, train_step
    from amalia_ray.train.model import build
    from amalia_ray.train.objectives.base import StageInputs
    from amalia_ray.train.parallel import apply_fsdp
    from tests.test_grpo import _tiny_tokenizer

    G, n_prompts, lr, temperature, beta = 4, 3, 3e-2, 0.7, 0.04
    folder = tmp_path / "model"
    tok = AutoTokenizer.from_pretrained(str(_tiny_tokenizer(tmp_path)))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)).save_pretrained(folder)
    tok.save_pretrained(folder)
    prompts = _equal_length_prompts(tok, n_prompts)  # TRL pads prompts on the left: equal lengths need none
    draw = random.Random(0)
    special = set(tok.all_special_ids)
    ordinary = [i for i in range(len(tok)) if i not in special]
    completions = [[draw.choice(ordinary) for _ in range(draw.randint(3, 8))] for _ in range(G * n_prompts)]

    def reward(completions, completion_ids, **kwargs):
        return [float(sum(ids) % 7) / 7 for ids in completion_ids]

    trl_losses, served = [], []
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=G, per_device_train_batch_size=G * n_prompts,
                      gradient_accumulation_steps=1, max_completion_length=8, num_iterations=2, beta=beta,
                      epsilon=0.2, epsilon_high=0.28, temperature=temperature, learning_rate=lr,
                      lr_scheduler_type="constant", warmup_steps=0, max_steps=2, weight_decay=0.0, adam_beta1=0.9,
                      adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, report_to=[], use_cpu=True,
                      bf16=False, logging_steps=1, save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=[reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))

    def given(prompt_ids, images, multimodal_fields, has_tool_images=False):
        served.extend(zip([list(p) for p in prompt_ids], completions))
        return [list(c) for c in completions[:len(prompt_ids)]], None

    trainer._generate_single_turn = given
    compute = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: trl_losses.append(compute(model, inputs)) or trl_losses[-1]
    trainer.train()
    assert len(served) == G * n_prompts, "one rollout for both steps"
    assert len(trl_losses) == 2

    tasks = tmp_path / "tasks.jsonl"
    write_tasks([{"prompt": p, "answer": "0"} for p in prompts], tasks)
    stage = train_stage({"name": "rl", "objective": "grpo", "dataset": str(tasks), "steps": 2,
                         "global_batch_size": G * n_prompts, "micro_batch_size": 4, "num_generations": G,
                         "max_completion_length": 8, "temperature": temperature, "kl_coef": beta, "lr": lr,
                         "warmup_steps": 0, "schedule": "constant", "betas": [0.9, 0.999], "weight_decay": 0.0,
                         "grad_clip": 1.0, "num_iterations": 2, "epsilon": 0.2, "epsilon_high": 0.28,
                         "rewards": ["has_number"]})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        config = AutoConfig.from_pretrained(folder)
        model = build(config, cpu, lambda m: apply_fsdp(m, "fp32", False), init_dir=Path(folder), seed=0)
        objective = GRPO.from_stage(stage, StageInputs(tasks, folder, 64, tmp_path / "stage", 0))
        objective.reference = build(config, cpu, lambda m: apply_fsdp(m, "fp32", False), init_dir=Path(folder),
                                    seed=0).requires_grad_(False).eval()
        rollouts = []

        def share(prompt_rows, sampled):  # the same completions, rewards and advantages TRL trained on
            rollouts.append(prompt_rows)
            rewards = torch.tensor(reward(None, [c for _, c in served]))
            advantages = grpo_module.group_advantages(rewards, G).tolist()
            objective.buffer = [(p, c, a, None) for (p, c), a in zip(served, advantages)]
            objective._rollout_stats = {}

        objective._share = share
        objective._start_sampling = lambda sampler, prompts: (sampler.next_rows(prompts), None)
        monkeypatch.setattr(grpo_module, "push_weights", lambda *args: None)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.999),
                                      eps=1e-8, weight_decay=0.0)
        run = LoopConfig(stage=stage, hf_config=config.to_dict(), data_dir=tasks, tokenizer_dir=folder,
                         stage_dir=tmp_path / "stage", export_dir=tmp_path / "export", seed=0, checkpoint_key="k")
        t = Training(run, 0, 1, cpu, "fp32", config, model, optimizer, objective, objective.sampler(0), 0, False,
                     1.0, "test", 0.0, [None], None)
        records = [train_step(t, step)[0] for step in range(2)]
    finally:
        dist.destroy_process_group()
    assert len(rollouts) == 1, "num_iterations: 2 — both steps train on one rollout"
    ours = [r["loss"] for r in records]
    theirs = [float(x) for x in trl_losses]
    assert abs(ours[0] - theirs[0]) < 1e-5 and abs(ours[1] - theirs[1]) < 1e-5, (ours, theirs)
    assert abs(ours[1] - ours[0]) > 1e-3, "the second step's policy has moved: the comparison means something"
    assert records[0]["clip_ratio"] == 0 and records[1]["clip_ratio"] > 0, "the clip acts on the second step only"
    assert records[0]["kl"] < 1e-7 < records[1]["kl"]


class _Fleet:
    """A stand-in for the rollout fleet: records the weights each rollout was sampled with."""

    def __init__(self):
        self.weights, self.asked, self.slept = None, [], 0

    def submit(self, prompts, n, max_tokens, temperature, logprobs, seeds):
        assert len(seeds) == len(prompts)
        self.asked.append(self.weights)
        ids = [[5 + self.weights, 6]] * n
        return [[(c, [-0.5, -0.25]) for c in ids] if logprobs else ids for _ in prompts]

    @staticmethod
    def collect(pending):
        return pending

    def sleep(self):
        self.slept += 1


def _objective(tmp_path, monkeypatch, **fields):
    import torch.distributed as dist

    from amalia_ray.core.config import train_stage
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.train.objectives.base import StageInputs
    from tests.test_grpo import _tiny_tokenizer

    tasks = tmp_path / "tasks.jsonl"
    write_tasks([{"prompt": f"Quanto é {i} + 1?", "answer": str(i + 1)} for i in range(8)], tasks)
    stage = train_stage({"name": "rl", "objective": "grpo", "dataset": str(tasks), "steps": 6, "global_batch_size": 4,
                         "micro_batch_size": 2, "num_generations": 2, "max_completion_length": 8, "warmup_steps": 0,
                         "rewards": ["has_number"], **fields})
    tok_dir = _tiny_tokenizer(tmp_path)
    objective = GRPO.from_stage(stage, StageInputs(tasks, tok_dir, 64, tmp_path / "stage", 0))
    objective.fleet = _Fleet()
    monkeypatch.setattr(grpo_module, "push_weights", lambda model, fleet, dtype: setattr(fleet, "weights",
                                                                                         model.version))
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    return objective


@pytest.mark.parametrize("iterations", [1, 2])
def test_an_async_rollout_is_sampled_by_the_weights_of_the_step_before_the_one_that_trains_on_it(
        tmp_path, monkeypatch, iterations):
    import torch.distributed as dist

    objective = _objective(tmp_path, monkeypatch, async_rollout=True, num_iterations=iterations)
    model = type("Model", (), {"version": 0})()
    sampler = objective.sampler(0)
    trained_on = []
    try:
        for step in range(6):
            model.version = step  # the weights this step starts from
            rows = objective.step_rows(model, sampler, 4)
            trained_on.append(objective.buffer[rows[0]][1][0] - 5)  # the weights its completions were sampled by
            batch = objective.batch(rows)
    finally:
        dist.destroy_process_group()
    if iterations == 1:  # the first rollout is sampled on the spot; every later one while the step before trained
        assert trained_on == [0, 0, 1, 2, 3, 4]
    else:  # two steps a rollout: the next one starts at the second, with that step's weights
        assert trained_on == [0, 0, 1, 1, 3, 3]
    assert objective.fleet.slept == 0, "an async engine stays awake: it samples while the trainer steps"
    assert len(objective.fleet.asked) == 6 // iterations, "no rollout sampled after the stage's last step"
    # the engine's log-probabilities sit where token_logps scores each completion token
    mask = batch["completion_mask"][:, 1:].bool()
    assert torch.equal(batch["sampling_logps"][mask], torch.tensor([-0.5, -0.25] * 4))
    assert torch.all(batch["sampling_logps"][~mask] == 0)


def test_a_sync_rollout_samples_with_the_weights_it_trains(tmp_path, monkeypatch):
    import torch.distributed as dist

    objective = _objective(tmp_path, monkeypatch, num_iterations=2)
    model = type("Model", (), {"version": 0})()
    sampler = objective.sampler(0)
    trained_on = []
    try:
        for step in range(4):
            model.version = step
            rows = objective.step_rows(model, sampler, 4)
            trained_on.append(objective.buffer[rows[0]][1][0] - 5)
            assert "sampling_logps" not in objective.batch(rows)
    finally:
        dist.destroy_process_group()
    assert trained_on == [0, 0, 2, 2] and objective.fleet.asked == [0, 2]
    assert objective.fleet.slept == 2, "a sync engine gives its memory back while the trainer steps"


def test_an_async_engine_sharing_a_gpu_with_the_trainer_is_refused(tmp_path, monkeypatch):
    """Awake while the trainer steps, a colocated engine would need memory it was not sized for: refused before it
    starts (and before anything is exported for it)."""
    import torch.distributed as dist

    objective = _objective(tmp_path, monkeypatch, async_rollout=True)
    dist.destroy_process_group()
    objective.use_gpu = True
    with pytest.raises(ValueError, match="rollout.placement: separate"):
        objective.prepare(None, 2, 0, 1, torch.device("cuda"))
    assert not (tmp_path / "stage" / "rollout-init").exists()


def test_off_policy_settings_are_checked_when_the_recipe_loads():
    from pydantic import ValidationError

    from amalia_ray.core.config import train_stage

    fields = {"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 20}
    stage = train_stage({**fields, "num_iterations": 2, "epsilon_high": 0.28, "async_rollout": True})
    assert (stage.num_iterations, stage.epsilon, stage.epsilon_high, stage.async_rollout) == (2, 0.2, 0.28, True)
    assert "clip_ratio" in GRPO.reported(stage) and "clip_ratio" not in GRPO.reported(train_stage(fields))
    for bad in ({"num_iterations": 0}, {"epsilon": 1.0}, {"epsilon_high": 0}):
        with pytest.raises(ValidationError):
            train_stage({**fields, **bad})


@pytest.mark.parametrize("async_rollout,iterations", [(True, 1), (True, 2), (False, 2)])
def test_a_resumed_stage_trains_on_the_rollouts_of_one_never_stopped(tmp_path, monkeypatch, async_rollout,
                                                                      iterations):
    """A stage stopped after its third step and resumed from that checkpoint's state (through JSON, as stored)
    trains on the same completions with the same advantages as one never stopped, samples each later rollout with
    the same weights, and draws every prompt once: the checkpoint kept the rollout still being trained on (two steps
    a rollout: mid-way), with every rank's log-probabilities from its first step, and the async rollout being
    sampled, waited for."""  # the loop's own save and restore of this state: tests/test_checkpoint_files.py
    import json

    import torch.distributed as dist

    def steps(objective, sampler, numbers):
        trained = []
        for step in numbers:
            model.version = step
            rows = objective.step_rows(model, sampler, 4)
            trained.append(json.loads(json.dumps([objective.buffer[i] for i in rows])))
        return trained

    fields = {"async_rollout": async_rollout, "num_iterations": iterations}
    model = type("Model", (), {"version": 0})()
    folders = [tmp_path / name for name in ("whole", "stopped", "resumed")]
    for folder in folders:
        folder.mkdir()
    try:
        whole = _objective(folders[0], monkeypatch, **fields)
        expected = steps(whole, whole.sampler(0), range(6))
        stopped = _objective(folders[1], monkeypatch, **fields)
        sampler = stopped.sampler(0)
        trained = steps(stopped, sampler, range(3))
        kept = {1: torch.tensor([-0.5, -0.125]), 2: torch.tensor([-1.0, -2.0])}  # as a first step's loss keeps them
        stopped._old_logps = dict(kept)
        state, data = json.loads(json.dumps(stopped.state_dict())), json.loads(json.dumps(sampler.state_dict()))
        resumed = _objective(folders[2], monkeypatch, **fields)
        resumed.load_state_dict(state)
        restored_logps = {k: v.tolist() for k, v in resumed._old_logps.items()}
        sampler = resumed.sampler(0)
        sampler.load_state_dict(data)
        trained += steps(resumed, sampler, range(3, 6))
    finally:
        dist.destroy_process_group()
    assert trained == expected
    assert stopped.fleet.asked + resumed.fleet.asked == whole.fleet.asked, "each rollout sampled by the same weights"
    assert len(whole.fleet.asked) == 6 // iterations
    if iterations == 2 and not async_rollout:  # stopped mid-rollout: its next step is against what the first kept
        assert restored_logps == {k: v.tolist() for k, v in kept.items()}
        assert resumed.fleet.slept == 1 + whole.fleet.slept - stopped.fleet.slept, "it trains beside a sleeping engine"
    else:  # one step a rollout, or async: the engine's own log-probabilities are the old policy
        assert restored_logps == {}
