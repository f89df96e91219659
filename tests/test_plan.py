"""`amalia plan`: parameter counts match transformers, the AMALIA-scale recipe validates and fits, a stage that
cannot fit is refused with what to change, and the seeds' GPU-hours give an implied MFU."""

from __future__ import annotations

import re

import pytest
import yaml
from typer.testing import CliRunner

from amalia_ray.cli import app
from amalia_ray.cluster.plan import Dims, parameter_count, plan, plan_stage
from amalia_ray.core.hf_model import recipe_config
from amalia_ray.core.errors import RecipeError
from amalia_ray.core.recipe import load_recipe
from tests.conftest import DEMO_RECIPE, ROOT

AMALIA_9B = ROOT / "recipes" / "amalia-9b.yaml"


def _dims(path):
    loaded = load_recipe(path)
    r = loaded.recipe
    return r, Dims.of(r, recipe_config(r.model, loaded.resolve) if r.model.base else None)


@pytest.mark.parametrize("path", [AMALIA_9B, DEMO_RECIPE])
def test_parameter_count_matches_transformers(path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    r, dims = _dims(path)
    m = r.model
    if m.base:  # the base model's own config.json, shipped beside the recipe
        cfg = AutoConfig.from_pretrained(str(path.parent / m.config_file))
    else:
        cfg = LlamaConfig(vocab_size=r.tokenizer.vocab_size, hidden_size=m.hidden_size,
                          intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                          num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                          tie_word_embeddings=m.tie_word_embeddings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert parameter_count(dims) == (sum(p.numel() for p in model.parameters()), block)


def test_amalia_9b_recipe_fits_and_states_the_mfu_the_seeds_imply():
    r, dims = _dims(AMALIA_9B)
    assert r.model.base == "utter-project/EuroLLM-9B" and r.tokenizer.from_ == "model"
    assert parameter_count(dims)[0] == pytest.approx(9.15e9, rel=0.01)
    stages = {p.stage: p for p in plan(r, recipe_config(r.model, load_recipe(AMALIA_9B).resolve))}
    assert all(p.fits for p in stages.values())
    sft = stages["sft"]
    assert r.train[1].steps == 14_000 and sft.gpus == 64
    # at the recipe's MFU the plan's GPU-hours; the seeds' 4,864 H100-hours for the same work imply a lower MFU
    assert sft.implied_mfu == pytest.approx(r.plan.mfu * sft.gpu_hours / 4864)
    assert stages["dpo"].implied_mfu == pytest.approx(r.plan.mfu * stages["dpo"].gpu_hours / 768)
    assert stages["pretrain"].implied_mfu is None
    assert sft.energy_kwh == pytest.approx(sft.gpu_hours * 0.7) and sft.cost_usd == pytest.approx(sft.gpu_hours * 2.5)
    # an extended vocabulary is planned with its larger embeddings and LM head
    extended = r.model_copy(update={"tokenizer": r.tokenizer.model_copy(update={"add_tokens": 1000})})
    grown = Dims.of(extended, recipe_config(r.model, load_recipe(AMALIA_9B).resolve))
    assert parameter_count(grown)[0] - parameter_count(dims)[0] == 1000 * dims.hidden * (1 if dims.tied else 2)


def test_memory_shards_over_gpus_and_checkpointing_shrinks_activations():
    r, dims = _dims(AMALIA_9B)
    stage = r.train[1].model_copy(update={"shard_size": None})  # FSDP over every GPU
    base = plan_stage(stage, r, dims)
    double = plan_stage(stage.model_copy(update={"num_workers": 128}), r, dims)
    key = "params+grads+adam (sharded)"
    assert double.memory_gb[key] == pytest.approx(base.memory_gb[key] / 2)
    no_ac = plan_stage(stage.model_copy(update={"activation_checkpointing": False}), r, dims)
    assert no_ac.memory_gb["activations"] > 10 * base.memory_gb["activations"]
    # the same model FLOPs either way: recomputation lowers the MFU the recipe states, it is not model FLOPs
    assert no_ac.step_time_s == pytest.approx(base.step_time_s)
    every_4th = plan_stage(stage.model_copy(update={"activation_checkpointing": 4}), r, dims)
    assert base.memory_gb["activations"] < every_4th.memory_gb["activations"] < no_ac.memory_gb["activations"]
    sft = stage.model_copy(update={"activation_checkpointing": False, "micro_batch_size": 3})
    assert "set activation_checkpointing: 3 (one block in 3 recomputed: the least recompute that fits)" in \
        plan_stage(sft, r, dims).advice, "every 2nd block fits too, every 4th does not"
    assert plan_stage(sft.model_copy(update={"activation_checkpointing": 3}), r, dims).fits
    once = plan_stage(stage.model_copy(update={"gradient_sync": "last_micro_batch"}), r, dims)
    assert once.total_memory_gb - base.total_memory_gb > 30, "a 9B model's unsharded fp32 gradients on every GPU"


def _recipe_file(tmp_path, edit) -> str:
    """The 9B recipe with `edit` applied to its data, written where its relative paths still resolve."""
    data = yaml.safe_load(AMALIA_9B.read_text())
    data["model"]["config_file"] = str(AMALIA_9B.parent / data["model"]["config_file"])
    for task in data["eval"]["tasks"]:
        task["path"] = str((AMALIA_9B.parent / task["path"]).resolve())
    edit(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_multi_node_stage_is_told_its_hsdp_group_and_warned_off_tcp(tmp_path):
    """Sharded over all 64 GPUs of 8 nodes, the plan names HSDP's smallest group of whole nodes that fits (8, or 16
    on 30 GB GPUs), which holds 8× (4×) the sharded state; with it set, nothing to say. Nodes linked by TCP only get a
    warning, shown by `amalia plan`; a stage within one node gets neither."""
    r, dims = _dims(AMALIA_9B)
    key = "params+grads+adam (sharded)"
    flat_sft = r.train[1].model_copy(update={"shard_size": None})
    flat = plan_stage(flat_sft, r, dims)
    assert flat.nodes == 8 and len(flat.notes) == 1 and flat.notes[0].startswith("set shard_size: 8 (HSDP"), flat.notes
    hsdp = plan_stage(r.train[1], r, dims)
    assert hsdp.fits and hsdp.notes == () and hsdp.memory_gb[key] == pytest.approx(8 * flat.memory_gb[key])
    small = r.model_copy(update={"plan": r.plan.model_copy(update={"gpu_memory_gb": 30})})
    assert plan_stage(flat_sft, small, dims).notes[0].startswith("set shard_size: 16 (HSDP"), "8 GPUs' shards: 35 GB"
    assert not plan_stage(r.train[1], small, dims).fits
    tcp = r.model_copy(update={"plan": r.plan.model_copy(update={"interconnect": "tcp"})})
    assert plan_stage(r.train[1], tcp, dims).notes[0].startswith("WARNING: 8 nodes linked by TCP")
    assert plan_stage(r.train[1].model_copy(update={"num_workers": 8}), tcp, dims).notes == ()

    def over_tcp(data):
        data["plan"]["interconnect"] = "tcp"
    result = CliRunner().invoke(app, ["plan", _recipe_file(tmp_path, over_tcp)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "pretrain (32 nodes): WARNING: 32 nodes linked by TCP" in " ".join(result.output.split())


def test_a_grpo_stage_is_planned_with_its_rollouts_and_the_gpus_its_engines_hold():
    """GRPO's rollouts are in its step time: each at most a prefill at the stage's MFU and one decoding step per
    completion token bounded by reading the weights and KV cache at the stated bandwidth; engines of their own, and
    served reward models and judges, add their GPUs for the whole stage; an asynchronous rollout overlaps the last
    step on the rollout before it. On-policy DPO's one sampling pass is a note."""
    from amalia_ray.core.config import LoraConfig, train_stage
    from amalia_ray.core.console import figure

    r, dims = _dims(AMALIA_9B)
    params = parameter_count(dims)[0]
    grpo = {"name": "rl", "objective": "grpo", "dataset": "tasks.jsonl", "steps": 100, "num_workers": 8,
            "seq_len": 4096, "activation_checkpointing": True, "global_batch_size": 64, "max_completion_length": 512}
    sft_like = plan_stage(train_stage({**{k: v for k, v in grpo.items() if k != "max_completion_length"},
                                       "objective": "sft"}), r, dims)  # the same steps without rollouts
    one = plan_stage(train_stage(grpo), r, dims)
    # by hand, one engine on one GPU, 64 sequences of 3,584 prompt tokens and 512 completion tokens: the prefill at
    # 40% of 989 TFLOP/s, then 512 steps each reading 2 bytes per parameter and the KV cache (2 · 42 layers · 8 KV
    # heads · 128 · 2 bytes a token, 3,840 tokens on average) at 60% of 3.35 TB/s
    prefill = 2 * params * 64 * 3584 / (989e12 * 0.4)
    decode = 512 * (2 * params + 64 * 3840 * 2 * 42 * 8 * 128 * 2) / (3.35e12 * 0.6)
    assert one.rollout_s == pytest.approx(prefill + decode)
    assert one.step_time_s == pytest.approx(sft_like.step_time_s + one.rollout_s)
    assert one.longest_step_s == pytest.approx(sft_like.step_time_s + one.rollout_s), "what a Slurm stop must allow"
    assert one.gpu_hours == pytest.approx(100 * one.step_time_s * 8 / 3600)
    assert one.notes[0].startswith(f"rollouts: at most {figure(one.rollout_s)} s each on 1 engine(s), one per 1 step(s)")

    two = plan_stage(train_stage({**grpo, "rollout": {"engines": 2}}), r, dims)
    assert one.rollout_s / 2 < two.rollout_s < one.rollout_s, "each engine reads all of its weights every token"
    twice = plan_stage(train_stage({**grpo, "num_iterations": 2}), r, dims)
    assert twice.step_time_s == pytest.approx(sft_like.step_time_s + one.rollout_s / 2)
    # an engine samples whole prompts: 3 prompts of 8 on 2 engines, the first engine samples 16 completions
    odd = {**grpo, "global_batch_size": 24, "num_generations": 8}
    assert plan_stage(train_stage({**odd, "rollout": {"engines": 2}}), r, dims).rollout_s == pytest.approx(
        plan_stage(train_stage({**odd, "global_batch_size": 32, "rollout": {"engines": 2}}), r, dims).rollout_s)

    separate = {"engines": 2, "tensor_parallel": 4, "placement": "separate"}
    apart = plan_stage(train_stage({**grpo, "rollout": separate}), r, dims)
    assert apart.gpu_hours == pytest.approx(100 * apart.step_time_s * (8 + 8) / 3600)
    assert "the engines' 8 GPU(s) of their own are in the GPU-hours" in apart.notes[0]
    # asynchronous: the first rollout waited for, each later one sampled during the last step on the one before
    overlapped = plan_stage(train_stage({**grpo, "rollout": separate, "async_rollout": True}), r, dims)
    train, rollout = sft_like.step_time_s, apart.rollout_s
    assert overlapped.step_time_s == pytest.approx((rollout + 99 * max(train, rollout) + train) / 100)
    assert overlapped.step_time_s < apart.step_time_s
    three = plan_stage(train_stage({**grpo, "rollout": separate, "async_rollout": True, "num_iterations": 3}), r, dims)
    # 34 rollouts: 33 overlapped with the third step on the one before, the last one's single step alone
    assert three.step_time_s == pytest.approx((rollout + 33 * (2 * train + max(train, rollout)) + train) / 100)

    dpo = {"name": "d", "objective": "dpo", "dataset": "tasks.jsonl", "steps": 100, "num_workers": 8,
           "seq_len": 4096, "activation_checkpointing": True}
    on_policy = plan_stage(train_stage({**dpo, "on_policy": True, "rewards": [{"model": "rm"}, "format"]}), r, dims)
    # the sampling pass is a note; the reward model's replica holds a GPU of its own for the whole stage
    assert on_policy.gpu_hours == pytest.approx(plan_stage(train_stage(dpo), r, dims).gpu_hours * (8 + 1) / 8)
    assert on_policy.notes[0].startswith("samples its pairs once before training, about ")
    assert on_policy.notes[1].startswith("the reward models and judges it serves hold 1 GPU(s) of their own")
    # the MFU a past run's hours imply is the training's: what the plan puts on rollouts is taken off first
    reported = r.model_copy(update={"plan": r.plan.model_copy(update={"reported_gpu_hours": {"rl": 2 * one.gpu_hours}})})
    rollout_hours = 100 * one.rollout_s * 8 / 3600
    assert plan_stage(train_stage(grpo), reported, dims).implied_mfu == pytest.approx(
        0.4 * (one.gpu_hours - rollout_hours) / (2 * one.gpu_hours - rollout_hours))
    too_few = r.model_copy(update={"plan": r.plan.model_copy(update={"reported_gpu_hours": {"rl": 0.001}})})
    assert plan_stage(train_stage(grpo), too_few, dims).notes[-1].startswith(
        "the 0.001 GPU-hours reported are no more than the plan's rollouts")
    # a rollout time a past run measured: the decode bandwidth share at which the bound equals it
    def measured(seconds):
        return plan_stage(train_stage(grpo), r.model_copy(update={"plan": r.plan.model_copy(
            update={"reported_rollout_s": {"rl": seconds}})}), dims)
    assert measured(one.rollout_s).implied_decode_utilization == pytest.approx(0.6, rel=1e-6)
    slow = measured(2 * one.rollout_s)
    # the prefill does not slow with the bandwidth: the decoding took more than twice as long
    assert slow.implied_decode_utilization == pytest.approx(0.6 * decode / (2 * one.rollout_s - prefill), rel=1e-6)
    assert slow.rollout_s == one.rollout_s and slow.step_time_s == one.step_time_s, "it informs, it does not plan"
    assert slow.notes[-1].startswith(f"the {figure(2 * one.rollout_s)} s a past run's rollouts took "
                                     f"(plan.reported_rollout_s) imply decoding at "
                                     f"{figure(100 * slow.implied_decode_utilization)}% of memory_tb_per_s")
    fast = measured(one.rollout_s / 10)  # faster than reading the weights at 3.35 TB/s allows
    assert fast.implied_decode_utilization is None and "are less than the plan's bound at the whole of " \
        "memory_tb_per_s" in fast.notes[-1]
    judged = {**grpo, "rewards": [{"judge": {"stage": "sft", "rubric": "r"}}, {"model": "rm"}, {"model": "rm"}]}
    r2 = r.model_copy(update={"serve": r.serve.model_copy(update={"gpus_per_replica": 2, "min_replicas": 2})})
    assert plan_stage(train_stage(judged), r2, dims).gpu_hours == pytest.approx(
        100 * one.step_time_s * (8 + 1 + 2 * 2) / 3600), "one reward model, named twice; a judge of 2 × 2 GPUs"
    # judges that are one checkpoint and a LoRA stage trained on it share that checkpoint's engine
    lora_sft = r2.train[1].model_copy(update={"lora": LoraConfig(r=8, merge=True)})
    r3 = r2.model_copy(update={"train": [r2.train[0], lora_sft, *r2.train[2:]]})
    assert r3.served_engines()["pretrain"] == ["sft"] and r3.engine_serving("sft") == "pretrain"
    shared = {**grpo, "rewards": [{"judge": {"stage": s, "rubric": "r"}} for s in ("pretrain", "sft")]}
    assert plan_stage(train_stage(shared), r3, dims).gpu_hours == pytest.approx(
        100 * one.step_time_s * (8 + 2 * 2) / 3600), "two judges on one engine of 2 × 2 GPUs"
    assert plan_stage(train_stage(shared), r2, dims).gpu_hours == pytest.approx(
        100 * one.step_time_s * (8 + 2 * 2 * 2) / 3600), "trained in full, each judge has its own engine"


def test_plan_and_the_training_loop_count_the_same_model_flops():
    from transformers import LlamaConfig

    from amalia_ray.core.flops import flops_per_token_of, model_flops_per_token

    r, dims = _dims(AMALIA_9B)
    config = LlamaConfig(**recipe_config(r.model, load_recipe(AMALIA_9B).resolve))
    planned = model_flops_per_token(dims.hidden, dims.ffn, dims.layers, dims.heads, dims.kv_heads, dims.head_dim,
                                    dims.vocab, 4096)
    assert planned == flops_per_token_of(config, 4096)
    # torchtitan's count: 6 × (parameters less the input embedding) + 12 · layers · hidden · sequence
    embedding = config.vocab_size * config.hidden_size
    params = parameter_count(dims)[0] - embedding - (2 * config.num_hidden_layers + 1) * config.hidden_size  # norms
    assert planned == 6 * params + 12 * config.num_hidden_layers * config.hidden_size * 4096


def test_a_stage_that_cannot_fit_is_refused_with_what_to_change(tmp_path):
    def without_checkpointing(data):
        data["train"][0]["activation_checkpointing"] = False
    result = CliRunner().invoke(app, ["plan", _recipe_file(tmp_path, without_checkpointing)], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: stage 'pretrain' cannot fit: needs") and "set activation_checkpointing: true" in line


@pytest.mark.parametrize("columns", [80, 200])
def test_the_plan_shows_every_figure_whole_at_any_terminal_width(columns):
    """At 80 columns (a terminal's and a CI log's default) one block of label-value lines per stage, no line wider
    than the terminal; wide enough, the table. Either way every figure whole: nothing cut to "sta…"."""
    from amalia_ray.core.console import figure

    loaded = load_recipe(AMALIA_9B)
    result = CliRunner().invoke(app, ["plan", str(AMALIA_9B)], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "…" not in result.output
    plans = plan(loaded.recipe, recipe_config(loaded.recipe.model, loaded.resolve))
    figures = [f for p in plans for f in (p.stage, str(p.gpus), f"{p.tokens_per_step:,}", f"{p.total_memory_gb:.1f}",
                                           figure(p.step_time_s), figure(p.gpu_hours), figure(p.cost_usd),
                                           figure(p.energy_kwh), *(f"{gb:.1f}" for gb in p.memory_gb.values()))]
    cells = {cell for line in lines for cell in re.split(r"[\s│]+|, ", line)}
    assert set(figures) <= cells, set(figures) - cells
    if columns == 80:
        assert max(map(len, lines)) <= 80 and not any("┃" in line for line in lines)
        block = lines[lines.index("pretrain"):lines.index("sft")]
        assert block[1].split() == ["GPUs", str(plans[0].gpus)] and any(ln.split()[:2] == ["GPU-hours", figure(
            plans[0].gpu_hours)] for ln in block)
    else:
        assert any("┃" in line and "GPU-hours" in line and "implied MFU" in line for line in lines)


@pytest.mark.parametrize("reported, error", [
    ({"reported_gpu_hours": {"rlhf": 100}}, r"reported_gpu_hours names unknown train stage\(s\) \['rlhf'\]"),
    ({"reported_gpu_hours": {"sft": -5}}, r"plan\.reported_gpu_hours\.sft.*greater than 0"),
    ({"reported_rollout_s": {"sft": 30}}, r"reported_rollout_s names train stage\(s\) \['sft'\] that are not GRPO"),
])
def test_reported_figures_must_name_a_stage_that_has_them(tmp_path, reported, error):
    data = yaml.safe_load(AMALIA_9B.read_text())
    data["plan"].update(reported)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=error):
        load_recipe(path)


def test_plan_counts_what_the_attention_kernel_keeps():
    """Packed documents: sdpa gets a seq² boolean mask per sequence, eager also keeps every layer's attention
    probabilities, flash_attention_2 (varlen by position ids) and flex_attention (a block mask) neither."""
    r, dims = _dims(AMALIA_9B)
    sft = r.train[1]  # packed conversations, seq 4096, one sequence per micro-batch, activation checkpointing
    memory = {}
    for kernel in ("flash_attention_2", "flex_attention", "sdpa", "eager"):
        recipe = r.model_copy(update={"model": r.model.model_copy(update={"attn_implementation": kernel})})
        memory[kernel] = plan_stage(sft, recipe, dims).memory_gb
    assert "attention mask" not in memory["flash_attention_2"] and "attention scores" not in memory["sdpa"]
    assert memory["flex_attention"] == memory["flash_attention_2"], "a block mask: nothing of seq² size"
    assert memory["sdpa"]["attention mask"] == pytest.approx(4096 ** 2 / 1024 ** 3)
    assert memory["eager"]["attention scores"] == pytest.approx(32 * 4096 ** 2 * 2 / 1024 ** 3)


# three small stages, each with a different biggest item: activations (no checkpointing), the logits and the loss's
# fp32 chunk (a large vocabulary), the sharded training state (more layers)
MEASURED = [
    {"hidden": 256, "layers": 4, "vocab": 4096, "heads": 4, "kv_heads": 2, "seq": 256, "micro": 4, "ac": False},
    {"hidden": 128, "layers": 2, "vocab": 16384, "heads": 2, "kv_heads": 1, "seq": 512, "micro": 2, "ac": True},
    {"hidden": 384, "layers": 6, "vocab": 2048, "heads": 6, "kv_heads": 2, "seq": 128, "micro": 2, "ac": True},
]


def _peak_of_training(cfg: dict, port: int, out) -> None:
    """Two optimizer steps of the training loop's model, precision and loss on one FSDP2 rank (bf16 compute,
    fp32 state, as on a GPU); writes the growth of the process's peak resident memory over what it held before."""
    import json
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig

    from amalia_ray.train.loss import next_token_loss
    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp

    def train(hidden, layers, vocab, heads, kv_heads, seq, micro, ac, steps):
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
        model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "bf16", ac), init_dir=None, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(steps):
            ids = torch.randint(0, vocab, (micro, seq))
            loss, _ = next_token_loss(model(input_ids=ids, use_cache=False).logits, ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def kb(field: str) -> int:
        return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0])

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    train(64, 1, 512, 2, 1, 64, 1, cfg["ac"], 1)  # kernels and thread pools set up outside the measurement
    Path("/proc/self/clear_refs").write_text("5")
    before = kb("VmRSS")
    train(**cfg, steps=2)
    Path(out).write_text(json.dumps({"peak": (kb("VmHWM") - before) * 1024}))
    dist.destroy_process_group()


def test_the_planned_memory_is_within_a_fifth_of_the_measured_peak(tmp_path, monkeypatch):
    """What `amalia plan` says a worker needs (less its headroom) against the peak a worker's process reaches
    training that stage, for three stages whose biggest item differs: within 20% each."""
    import json
    import multiprocessing

    from amalia_ray.core.config import PackConfig, PretrainStage
    from tests.conftest import free_port

    # freed large blocks go back to the system, so the resident peak shows what is held at once
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    spawn = multiprocessing.get_context("spawn")
    runs = [(cfg, tmp_path / f"{i}.json", spawn.Process(target=_peak_of_training, args=(
        cfg, free_port(), str(tmp_path / f"{i}.json")))) for i, cfg in enumerate(MEASURED)]
    for _, _, process in runs:
        process.start()
    recipe = load_recipe(DEMO_RECIPE).recipe
    ratios = []
    for cfg, out, process in runs:
        process.join(600)
        assert process.exitcode == 0, cfg
        dims = Dims(cfg["hidden"], 4 * cfg["hidden"], cfg["layers"], cfg["heads"], cfg["kv_heads"],
                    cfg["hidden"] // cfg["heads"], cfg["vocab"], False, 4096)
        stage = PretrainStage(name="s", objective="pretrain", steps=2, warmup_steps=0, num_workers=1,
                              micro_batch_size=cfg["micro"], global_batch_size=cfg["micro"],
                              activation_checkpointing=cfg["ac"], document_masking=False)
        packed_at = recipe.model_copy(update={"pack": PackConfig(seq_len=cfg["seq"])})
        planned = plan_stage(stage, packed_at, dims).memory_gb
        planned_bytes = (sum(planned.values()) - planned["headroom"]) * 2**30
        ratios.append(planned_bytes / json.loads(out.read_text())["peak"])
    assert all(0.8 <= r <= 1.2 for r in ratios), ratios


def test_mfu_peaks_are_datasheet_peaks_by_device_name_and_unknown_devices_get_none():
    """What a GPU worker states its MFU against, checked on CPU from the names torch.cuda.get_device_name gives."""
    from amalia_ray.core.flops import datasheet_peak

    assert datasheet_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert datasheet_peak("NVIDIA H100 PCIe", "bf16") == 756e12  # the longer name wins over a shorter match
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert datasheet_peak("NVIDIA GeForce RTX 4090", "bf16") is None  # measured instead

