"""Post-training base models end to end (every family with AMALIA_TEST_FAMILIES=all): 2 FSDP2 workers on Ray
Train run SFT steps from a random checkpoint written as the hub publishes it (its own tokenizer and chat template),
the first step's loss equals a single-process transformers forward on the same batch, every export loads in
transformers with the base's architecture, chat template, generation settings and dtype, and answers over HTTP from
Ray Serve + vLLM; GRPO continues a base of another family with vLLM rolling out its architecture."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from amalia_ray.core.config import GRPOStage, ModelConfig, SFTStage, TrainStageConfig
from tests.base_models import FAMILIES, FAQ, make_base_model
from tests.conftest import free_port, read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not FAQ.exists(), reason="make corpus")]
SEED = 7
# A family trains through Ray Train in about 30 s here and a vLLM engine per served model costs about 45 s, so the
# suite trains and serves a Gemma 3 (tied embeddings, its own turns; the Llama architecture is trained and served by
# every other end-to-end test) and GRPO continues a Qwen 3 base (ChatML) with vLLM's Qwen 3 as its rollout engine
# (R1-Zero: reinforcement learning straight from a base model). AMALIA_TEST_FAMILIES=all trains and serves all six.
# Each family's chat template as SFT targets: test_sft.py; loading, a forward pass and the export of every family
# under FSDP2: test_base_model.py.
EVERY = os.environ.get("AMALIA_TEST_FAMILIES") == "all"
TRAINED = list(FAMILIES) if EVERY else ["gemma3_text"]
SERVED = TRAINED if EVERY else ["gemma3_text"]


@pytest.fixture(scope="module")
def trained(ray_cluster, tmp_path_factory):
    from amalia_ray.data.posttrain.faq_chats import write_faq_conversations
    from amalia_ray.train.train_stage import run_train_stage

    tmp = tmp_path_factory.mktemp("families")
    chats = tmp / "faq-chat.jsonl"
    write_faq_conversations(FAQ, chats)
    stage = SFTStage(name="sft", objective="sft", dataset=str(chats), steps=2, seq_len=256,
                     global_batch_size=4, micro_batch_size=2, num_workers=2, warmup_steps=0, lr=1e-3,
                     checkpoint_every=2, log_every=1)
    out = {}
    for family in TRAINED:
        base = make_base_model(tmp / "bases" / family, family)
        model = ModelConfig.model_validate({"from": str(base)})
        metrics = run_train_stage(stage, model, data_dir=chats, tokenizer_dir=base, init_hf_dir=base, base_dir=base,
                                  stage_dir=tmp / family, ray_run_name=f"sft-{family}", seed=SEED, use_gpu=False,
                                  progress=False)
        out[family] = (base, tmp / family, metrics)
    return stage, chats, out


def _first_step_loss(base: Path, chats: Path, stage: TrainStageConfig) -> float:
    """The loss of the first step's global batch from one process: transformers' own model, the same rows."""
    from transformers import AutoModelForCausalLM

    from amalia_ray.train.loss import next_token_loss
    from amalia_ray.train.objectives.sft import SFT

    objective = SFT(chats, base, stage.seq_len)
    rows = objective.sampler(SEED).next_rows(stage.global_batch_size)
    batch = objective.batch(rows)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss_sum, count = next_token_loss(logits, batch["labels"])
    return loss_sum.item() / count


@pytest.mark.parametrize("family", TRAINED)
def test_sft_from_a_base_model_matches_transformers_and_exports_its_architecture(trained, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stage, chats, runs = trained
    base, stage_dir, metrics = runs[family]
    history = read_jsonl(stage_dir / "metrics.jsonl")
    assert [h["step"] for h in history] == [1, 2] and all(h["world_size"] == 2 for h in history)
    assert math.isfinite(metrics["loss"])
    assert abs(history[0]["loss"] - _first_step_loss(base, chats, stage)) < 1e-5
    export = stage_dir / "hf"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == json.loads((base / "config.json").read_text())["model_type"]
    assert AutoTokenizer.from_pretrained(str(export)).chat_template == AutoTokenizer.from_pretrained(
        str(base)).chat_template
    model = AutoModelForCausalLM.from_pretrained(str(export))
    assert model.dtype == torch.bfloat16, "exported in the base model's own dtype"
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == 2


# full weights: slow (make test-all), as the LoRA run covers the same rollout path and more — its engine is streamed
# every weight too (merged), and the frozen KL reference of full-weight GRPO is tests/test_grpo.py's. The LoRA run
# is also one step off-policy with two steps a rollout; the full-weight run is on-policy.
@pytest.mark.parametrize("lora", [pytest.param(None, marks=pytest.mark.slow),
                                  {"r": 8, "alpha": 16, "merge": True}], ids=["full", "lora"])
def test_r1_zero_grpo_from_a_base_model_rolls_out_with_vllm_of_its_architecture(trained, tmp_path, lora):
    """The R1-Zero recipe: GRPO straight from a base model — a Qwen 3 (its own chat template renders the prompts)
    — on generated Portuguese arithmetic, completions sampled every step by vLLM's Qwen 3 with the weights pushed
    into it in place (with LoRA: the merged weights), weighted rule rewards and an LLM judge reached over HTTP from
    the training worker (a scripted OpenAI-compatible judge here, grading every completion), group advantages, k3
    KL to the base (with LoRA: the policy with its adapters off); the first step's policy is its reference, and the
    export keeps the base's architecture. With LoRA, async on two engines: the second rollout is sampled while the
    second step trains on the first one again, and is the third step's."""
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from amalia_ray.train.train_stage import run_train_stage
    from tests.scripted_judge import scripted_judge

    _, chats, _ = trained
    base = make_base_model(chats.parent / "bases" / "qwen3", "qwen3")
    tasks = tmp_path / "arithmetic.jsonl"
    write_tasks(arithmetic_tasks(32, seed=0), tasks)
    with scripted_judge("Nota: 3") as judge:
        # with LoRA: async, and a fleet of two engines (one beside each worker) sampling half the prompts each
        off_policy = {"async_rollout": True, "num_iterations": 2, "rollout": {"engines": 2}} if lora else {}
        steps = 3 if lora else 2
        stage = GRPOStage(name="grpo", objective="grpo", dataset=str(tasks), steps=steps, seq_len=128,
                          global_batch_size=4, micro_batch_size=2, num_workers=2, warmup_steps=0, lr=1e-4,
                          checkpoint_every=2, log_every=1, num_generations=4, max_completion_length=12,
                          kl_coef=0.05, lora=lora, rewards=[
                              "format", "exact_answer", {"name": "has_number", "weight": 0.2},
                              {"judge": {"base_url": judge.url, "model": "juiz", "retries": 0}, "weight": 0.5}],
                          **off_policy)
        run_train_stage(stage, ModelConfig.model_validate({"from": str(base)}), data_dir=tasks, tokenizer_dir=base,
                        init_hf_dir=base, base_dir=base, stage_dir=tmp_path / "grpo", ray_run_name="grpo-qwen3",
                        seed=SEED, use_gpu=False, progress=False)
    assert len(judge.asked) == 2 * 4 and all("Resposta de referência" in text for text in judge.asked), \
        "every completion of both rollouts graded, with the task's answer as the reference"
    history = read_jsonl(tmp_path / "grpo" / "metrics.jsonl")
    assert [h["step"] for h in history] == list(range(1, steps + 1)) and all(h["world_size"] == 2 for h in history)
    if off_policy:  # the clip watches every step: the engine's log-probabilities are the old policy
        assert all(0 <= h["clip_ratio"] <= 1 for h in history)
        assert history[0]["reward"] == history[1]["reward"], "the second step trains on the first rollout again"
    # the first step waits for a whole rollout (sampled and judged), and no step waits longer than it takes
    assert history[0]["rollout_wait_s"] > 0 and all(0 <= h["rollout_wait_s"] < h["step_time_s"] for h in history)
    for h in history:
        assert math.isfinite(h["loss"]) and h["kl"] >= 0 and 0 < h["completion_length"] <= 12
        assert all(0 <= h[f"rewards/{r}"] <= 1 for r in ("format", "exact_answer", "has_number")) and "reward_std" in h
        assert h["rewards/judge:juiz"] == 0.5 and h["rewards/missing"] == 0, "grade 3 of 5 -> (3 - 1) / 4"
    assert history[0]["kl"] < 1e-6, "the first rollout's policy is the reference"
    assert json.loads((tmp_path / "grpo" / "hf" / "config.json").read_text())["model_type"] == "qwen3"
    if lora:
        assert (tmp_path / "grpo" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.reliability
def test_every_family_export_is_served_by_vllm_over_http(trained, other_team, tmp_path):
    """`amalia serve EXPORT... --address` on the shared cluster, where another team's Serve application runs: the
    exports side by side in one application of their own (two at a time: each vLLM engine on CPU reserves its share
    of RAM), joined on that Serve's port (not the one asked for), the URL that answers printed; each model answers
    a completion and a chat turn rendered with its own chat template; `--stop --app` deletes only that application,
    and the other team's answers throughout. Beside the first exports, a model vLLM's CPU attention loads but cannot
    run (heads of 24: its engine dies on the first request): with --keep-going it is named with the engine's own
    reason in one line and the others are served (without it, the start fails: test_cli_errors.py)."""
    import ray
    from ray import serve

    from tests.conftest import OTHER_TEAM_REPLY

    _, _, runs = trained
    exports = [(f"{family}-sft", runs[family][1] / "hf") for family in SERVED]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    cli = [sys.executable, "-m", "amalia_ray.cli", "serve"]
    url = other_team.rsplit("/", 1)[0] + "/v1"
    unservable = {"heads-24": make_base_model(tmp_path / "heads-24", "llama", hidden=96, shard_size=None)}
    for i in range(0, len(exports), 2):
        models = dict(exports[i:i + 2])
        extra = unservable if i == 0 else {}
        names = [arg for model_id in [*models, *extra] for arg in ("--name", model_id)]
        deployed = subprocess.run([*cli, *map(str, [*models.values(), *extra.values()]), *names, "--app",
                                   "amalia-families", "--port", str(free_port()), *(["--keep-going"] if extra else [])],
                                  env=env, capture_output=True, text=True, timeout=900)
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-3000:]
        printed = " ".join(deployed.stdout.split())
        assert f"deployed {', '.join(models)} at {url} as Serve application 'amalia-families'" in printed, printed
        if extra:  # the engine's own reason, not the "EngineDeadError" that only says it died
            [line] = [ln for ln in deployed.stdout.splitlines() if "cannot serve" in ln]
            assert line.startswith("cannot serve heads-24: ") and "head_dim=24" in line and "EngineDead" not in line
        try:
            assert {m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]} == {*models, *extra}
            for model_id in models:
                r = httpx.post(f"{url}/completions", timeout=120,
                               json={"model": model_id, "prompt": "O Debian é", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, (model_id, r.text[:300])
                assert r.json()["usage"]["completion_tokens"] >= 1
                r = httpx.post(f"{url}/chat/completions", timeout=120, json={
                    "model": model_id, "messages": [{"role": "user", "content": "O que é o Debian?"}],
                    "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, (model_id, r.text[:300])
                assert r.json()["usage"]["prompt_tokens"] > 5, "the prompt went through the chat template"
            assert httpx.get(other_team, timeout=30).text == OTHER_TEAM_REPLY
        finally:
            stopped = subprocess.run([*cli, "--stop", "--app", "amalia-families"], env=env, capture_output=True,
                                     text=True, timeout=300)
        assert stopped.returncode == 0 and "deleted" in stopped.stdout, stopped.stdout + stopped.stderr
        assert set(serve.status().applications) == {"other-team"}
        assert httpx.get(other_team, timeout=30).text == OTHER_TEAM_REPLY
