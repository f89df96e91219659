"""`amalia plan`: parameter counts match transformers, the AMALIA-scale recipe validates and fits, a stage that
cannot fit is refused with what to change, and the seeds' GPU-hours give an implied MFU."""

from __future__ import annotations

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
    stage = r.train[1]
    base = plan_stage(stage, r, dims)
    double = plan_stage(stage.model_copy(update={"num_workers": 128}), r, dims)
    key = "params+grads+adam (sharded)"
    assert double.memory_gb[key] == pytest.approx(base.memory_gb[key] / 2)
    no_ac = plan_stage(stage.model_copy(update={"activation_checkpointing": False}), r, dims)
    assert no_ac.memory_gb["activations"] > 10 * base.memory_gb["activations"]
    assert no_ac.step_time_s == pytest.approx(base.step_time_s * 6 / 8, rel=0.05)  # no forward recompute


def test_a_stage_that_cannot_fit_is_refused_with_what_to_change(tmp_path):
    data = yaml.safe_load(AMALIA_9B.read_text())
    data["train"][0]["activation_checkpointing"] = False
    data["model"]["config_file"] = str(AMALIA_9B.parent / data["model"]["config_file"])
    for task in data["eval"]["tasks"]:
        task["path"] = str((AMALIA_9B.parent / task["path"]).resolve())
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["plan", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: stage 'pretrain' cannot fit: needs") and "set activation_checkpointing: true" in line


def test_reported_hours_must_name_a_stage(tmp_path):
    data = yaml.safe_load(AMALIA_9B.read_text())
    data["plan"]["reported_gpu_hours"] = {"rlhf": 100}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"reported_gpu_hours names unknown train stage\(s\) \['rlhf'\]"):
        load_recipe(path)


def test_plan_counts_what_the_attention_kernel_keeps():
    """Packed documents: sdpa gets a seq² boolean mask per sequence, eager also keeps every layer's attention
    probabilities, flash_attention_2 neither (varlen by position ids)."""
    r, dims = _dims(AMALIA_9B)
    sft = r.train[1]  # packed conversations, seq 4096, one sequence per micro-batch, activation checkpointing
    memory = {}
    for kernel in ("flash_attention_2", "sdpa", "eager"):
        recipe = r.model_copy(update={"model": r.model.model_copy(update={"attn_implementation": kernel})})
        memory[kernel] = plan_stage(sft, recipe, dims).memory_gb
    assert "attention mask" not in memory["flash_attention_2"] and "attention scores" not in memory["sdpa"]
    assert memory["sdpa"]["attention mask"] == pytest.approx(4096 ** 2 / 1024 ** 3)
    assert memory["eager"]["attention scores"] == pytest.approx(32 * 4096 ** 2 * 2 / 1024 ** 3)
