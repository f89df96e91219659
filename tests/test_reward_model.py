"""Reward models (`objective: reward`): TRL's RewardTrainer and our objective through the loop's own `train_step`
give the same losses on the same pairs; the export is a transformers sequence classifier scoring as the trained
model does; a causal LM's checkpoint starts one; reward stages branch off the policy in a recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def _pairs(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = i + 2, 3 * i + 1
        rows.append({"prompt": f"Quanto é {a} + {b}?", "chosen": f" É {a + b}.",
                     "rejected": " Não sei." if i % 2 else f" Talvez {a * b}, ou {a - b}."})
    return rows


def _models(tmp_path, tok):
    """A tiny causal LM, and the reward model transformers makes of it (a score head drawn from seed 0)."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    torch.manual_seed(1)
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=1,
                                                            pad_token_id=tok.pad_token_id)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    return tmp_path / "lm", tmp_path / "rm"


def test_two_steps_give_trl_reward_trainers_losses_and_the_export_scores_like_its_model(tmp_path):
    """TRL 1.13's RewardTrainer (centering 0.01, one batch of 8 pairs a step) and our reward objective through the
    loop's `train_step` (FSDP2, two micro-batches) from the same sequence classifier: both steps' losses agree
    within 1e-5, and our export, loaded by transformers, scores the pairs as TRL's trained model does."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from amalia_ray.core.config import train_stage
    from amalia_ray.core.formats.jsonl import write_rows
    from amalia_ray.core.formats.preference_pairs import validate_reward_pair
    from amalia_ray.train.hf_weights import export_hf
    from amalia_ray.train.loop import LoopConfig, Training, train_step
    from amalia_ray.train.model import build
    from amalia_ray.train.objectives.reward import Reward, sequence_scores
    from amalia_ray.train.parallel import apply_fsdp
    from tests.test_grpo import _tiny_tokenizer

    lr, center, n = 3e-3, 0.01, 8
    tok = AutoTokenizer.from_pretrained(str(_tiny_tokenizer(tmp_path)))
    _, folder = _models(tmp_path, tok)
    rows = _pairs(n)

    trl_losses = []
    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
                        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=2, weight_decay=0.0,
                        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, report_to=[],
                        use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
                        center_rewards_coefficient=center, max_length=None)
    trainer = RewardTrainer(model=str(folder), args=args, processing_class=tok,
                            train_dataset=Dataset.from_list(rows))
    compute = trainer.compute_loss

    def recorded(model, inputs, *a, **kw):
        loss = compute(model, inputs, *a, **kw)
        trl_losses.append(float(loss))
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    assert len(trl_losses) == 2

    data = tmp_path / "pairs.jsonl"
    write_rows(rows, data, validate_reward_pair)
    stage = train_stage({"name": "rm", "objective": "reward", "dataset": str(data), "steps": 2,
                         "global_batch_size": n, "micro_batch_size": 4, "lr": lr, "warmup_steps": 0,
                         "schedule": "constant", "betas": [0.9, 0.999], "weight_decay": 0.0, "grad_clip": 1.0,
                         "center_rewards_coefficient": center})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        cpu = torch.device("cpu")
        objective = Reward(data, folder, 64, center, validation_fraction=0.0)
        config = objective.model_config(AutoConfig.from_pretrained(folder))
        model = build(config, cpu, lambda m: apply_fsdp(m, "fp32", False), init_dir=Path(folder), seed=0,
                      head=objective.head)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        run = LoopConfig(stage=stage, hf_config=config.to_dict(), data_dir=data, tokenizer_dir=folder,
                         stage_dir=tmp_path / "stage", export_dir=tmp_path / "export", seed=0, checkpoint_key="k")
        t = Training(run, 0, 1, cpu, "fp32", config, model, optimizer, objective, objective.sampler(0), 0, False,
                     1.0, "test", 0.0, [None], None)
        records = [train_step(t, step)[0] for step in range(2)]
        export_hf(model, config, tmp_path / "export", folder)
        batch = objective.batch(torch.arange(n).numpy())
        with torch.no_grad():
            ours = sequence_scores(model, batch)
    finally:
        dist.destroy_process_group()
    losses = [r["loss"] for r in records]
    assert abs(losses[0] - trl_losses[0]) < 1e-5 and abs(losses[1] - trl_losses[1]) < 1e-5, (losses, trl_losses)
    assert abs(losses[1] - losses[0]) > 1e-3, "the second step's model has moved: the comparison means something"
    assert 0 <= records[0]["accuracy"] <= 1 and "margin" in records[0] and "mean_reward" in records[0]

    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        loaded = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        theirs = trainer.model.eval()(input_ids=batch["input_ids"],
                                      attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    assert torch.allclose(loaded, ours, atol=1e-5), (loaded, ours)
    assert torch.allclose(loaded, theirs, atol=1e-4), (loaded, theirs)


def test_a_causal_lms_checkpoint_starts_a_reward_model_without_its_lm_head(tmp_path):
    """The decoder's weights come from the causal LM, its LM head is left out, and the new score head is drawn
    from the seed: the same seed the same head."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp
    from tests.test_grpo import _tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(str(_tiny_tokenizer(tmp_path)))
    lm, _ = _models(tmp_path, tok)
    stored = load_file(str(lm / "model.safetensors"))
    config = AutoConfig.from_pretrained(lm)
    config.num_labels, config.pad_token_id = 1, tok.pad_token_id
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        heads = []
        for seed in (3, 3, 4):
            model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", False), init_dir=lm,
                          seed=seed, head="score")
            state = {k: v.full_tensor() for k, v in model.state_dict().items()}
            heads.append(state["score.weight"])
        assert "lm_head.weight" not in state and "lm_head.weight" in stored
        assert torch.equal(state["model.layers.1.mlp.up_proj.weight"], stored["model.layers.1.mlp.up_proj.weight"])
    finally:
        dist.destroy_process_group()
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert 0.005 < float(heads[0].std()) < 0.05  # transformers' initializer_range, 0.02


def test_reward_pairs_may_leave_out_the_prompt_and_carry_a_margin_and_bad_ones_are_named(tmp_path):
    from amalia_ray.core.formats.preference_pairs import read_reward_pairs

    good = tmp_path / "good.jsonl"
    good.write_text('{"chosen": "Sim, é verdade.", "rejected": "Não.", "margin": 1.5}\n'
                    '{"prompt": [{"role": "user", "content": "Olá"}], "chosen": [{"role": "assistant", '
                    '"content": "Olá!"}], "rejected": [{"role": "assistant", "content": "?"}]}\n')
    assert len(read_reward_pairs(good)) == 2
    for row, why in [('{"chosen": "a", "rejected": "b", "margin": "big"}', "margin"),
                     ('{"prompt": "p", "chosen": "a"}', "rejected"),
                     ('{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}',
                      "all be strings")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"chosen": "x", "rejected": "y"}\n' + row + "\n")
        with pytest.raises(ValueError, match=rf"bad.jsonl.*2.*{why}|{why}.*bad.jsonl"):
            read_reward_pairs(bad)


def test_a_margin_moves_the_loss_as_trls_does():
    import torch.nn.functional as F

    from amalia_ray.train.objectives.reward import Reward

    objective = Reward.__new__(Reward)
    objective.center, objective._sums, objective._pairs = None, torch.zeros(3, dtype=torch.float64), 0

    class Scores(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache):
            return type("Out", (), {"logits": input_ids[:, :1].float()})()

    batch = {"input_ids": torch.tensor([[3], [1], [2], [2]]), "attention_mask": torch.ones(4, 1, dtype=torch.long),
             "margin": torch.tensor([0.0, 0.5])}
    loss, pairs = objective.loss(Scores().train(), batch)
    expected = -F.logsigmoid(torch.tensor([3.0 - 2.0 - 0.0, 1.0 - 2.0 - 0.5])).sum()
    assert pairs == 2 and torch.isclose(loss, expected)
    assert objective.take_metrics()["accuracy"] == (1.0, 2)


def test_a_reward_stage_branches_off_the_policy_in_a_recipe():
    """The stage after a reward stage starts from the policy before it; the eval stage serves no reward model; a
    reward given by model names an earlier reward stage."""
    from amalia_ray.core.config import Recipe

    base = {"data": {"sources": [{"name": "web", "paths": ["corpus"]}]}}
    stages = [{"name": "sft", "objective": "sft", "dataset": "chat.jsonl", "steps": 10},
              {"name": "rm", "objective": "reward", "dataset": "pairs.jsonl", "steps": 10},
              {"name": "dpo", "objective": "dpo", "dataset": "prefs.jsonl", "steps": 10}]
    recipe = Recipe.model_validate({**base, "train": stages})
    assert [recipe.previous_policy(i) for i in range(3)] == [None, 0, 0]
    assert [s.name for s in recipe.policy_stages] == ["sft", "dpo"]
    assert not recipe.starts_from_checkpoint(0) and recipe.starts_from_checkpoint(1) and recipe.starts_from_checkpoint(2)
    with pytest.raises(ValueError, match="LoRA on a reward stage"):
        Recipe.model_validate({**base, "train": [{**stages[1], "lora": {}}]})
    with pytest.raises(ValueError, match="nothing to evaluate"):
        Recipe.model_validate({**base, "train": [stages[1]], "eval": {"tasks": [{"name": "t", "path": "t.jsonl"}]}})


def test_a_served_reward_model_scores_a_rollout_in_batches_as_transformers_does(ray_cluster, tmp_path):
    """The reward server (Ray Serve, no HTTP route) gets a rollout's completions as separate requests at once,
    gathers them into batches, and scores each as transformers' own classifier does alone; a stage's scorer reaches
    it by its application name, and refuses a reward model it was not given."""
    from ray import serve
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from amalia_ray.core.config import RewardConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.reward_text import reward_input_ids
    from amalia_ray.serve import app as serve_app
    from amalia_ray.serve import reward_server
    from amalia_ray.train.reward_scoring import RewardScorer
    from tests.test_grpo import _tiny_tokenizer

    tok = AutoTokenizer.from_pretrained(str(_tiny_tokenizer(tmp_path)))
    _, folder = _models(tmp_path, tok)
    rows = _pairs(12)
    prompts = [[{"role": "user", "content": r["prompt"]}] if i % 2 else r["prompt"] for i, r in enumerate(rows)] * 2
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    name = reward_server.app_name("test", 0)
    reward_server.start(folder, name, use_gpu=False)
    try:
        assert serve_app.running_serve()["applications"][name]["route_prefix"] is None, "handles only"
        sources = [RewardConfig(model="rm", weight=1.0)]
        scores = RewardScorer(sources, reward_apps={"rm": name}).score(prompts, completions, [{}] * len(prompts))
        stats = serve.get_app_handle(name).stats.remote().result()
    finally:
        serve_app.stop(name)
    assert name not in (serve_app.running_serve() or {}).get("applications", {})
    assert stats["requests"] == len(completions) and stats["largest_batch"] > 1, stats
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        alone = [float(model(input_ids=torch.tensor([reward_input_ids(tok, p, c)])).logits[0, 0])
                 for p, c in zip(prompts, completions)]
    assert torch.allclose(scores[:, 0], torch.tensor(alone), atol=1e-5), (scores[:, 0], alone)
    with pytest.raises(AmaliaError, match="not served"):
        RewardScorer(sources)
    # a replica that cannot be placed (a GPU asked of a cluster without one): an error within the timeout, and no
    # application left waiting (serve.run waited for it with no limit)
    stuck = reward_server.app_name("test", 1)
    with pytest.raises(AmaliaError, match=r"could not be served: DEPLOYING after [56] s \(.*it asks a GPU per replica"):
        reward_server.start(folder, stuck, use_gpu=True, timeout_s=5)
    assert stuck not in (serve_app.running_serve() or {}).get("applications", {})


def test_a_stage_finds_its_reward_models_and_a_gpu_cluster_too_small_for_them_is_refused(tmp_path):
    """A reward named by a stage is that stage's export, another a folder relative to the recipe; each replica
    needs a GPU of its own beside the workers (and separate rollout engines, each over tensor_parallel GPUs) on a
    GPU cluster."""
    from types import SimpleNamespace

    from amalia_ray.core.config import Recipe
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.pipeline.stages import check_gpus_beside_workers, reward_models

    recipe = Recipe.model_validate({
        "data": {"sources": [{"name": "web", "paths": ["corpus"]}]},
        "train": [{"name": "rm", "objective": "reward", "dataset": "pairs.jsonl", "steps": 10},
                  {"name": "rl", "objective": "grpo", "dataset": "tasks.jsonl", "steps": 10, "rewards": [
                      "format", {"model": "rm", "weight": 0.5}, {"model": "models/judge-rm"}],
                   "rollout": {"placement": "separate", "engines": 2, "tensor_parallel": 2}, "num_workers": 2}]})
    p = SimpleNamespace(recipe=recipe, checkpoint_of=lambda name: tmp_path / name / "hf",
                        loaded=SimpleNamespace(resolve=lambda path: tmp_path / path))
    assert reward_models(p, recipe.train[1]) == {"rm": tmp_path / "rm" / "hf",
                                                 "models/judge-rm": tmp_path / "models/judge-rm"}
    assert reward_models(p, recipe.train[0]) == {}
    check_gpus_beside_workers(recipe.train[1], 2, 8)
    with pytest.raises(AmaliaError, match=r"separate rollout engines \(4 GPUs\).*need 8 GPUs; the cluster has 7"):
        check_gpus_beside_workers(recipe.train[1], 2, 7)
    with pytest.raises(ValueError, match="not a reward stage before it"):
        Recipe.model_validate({**recipe.model_dump(mode="json", by_alias=True, exclude_unset=True),
                               "train": [recipe.train[1].model_dump(mode="json", exclude_unset=True),
                                         recipe.train[0].model_dump(mode="json", exclude_unset=True)]})


def test_serving_a_reward_model_for_chat_is_refused_with_the_reason(tmp_path):
    import json

    from amalia_ray.core.config import ServeConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.serve.app import llm_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForSequenceClassification"]}))
    with pytest.raises(AmaliaError, match="is a reward model .* does not generate"):
        llm_config("rm", tmp_path, ServeConfig(), use_gpu=False)


def test_a_stages_reward_models_are_stopped_in_reverse_so_the_one_that_started_serve_shuts_it_down(
        tmp_path, monkeypatch):
    from types import SimpleNamespace

    from amalia_ray.core.config import Recipe
    from amalia_ray.pipeline import stages

    recipe = Recipe.model_validate({
        "data": {"sources": [{"name": "web", "paths": ["corpus"]}]},
        "train": [{"name": "rl", "objective": "grpo", "dataset": "tasks.jsonl", "steps": 10,
                   "rewards": [{"model": "a"}, {"model": "b"}]}]})
    p = SimpleNamespace(recipe=recipe, run_name="run", checkpoint_of=lambda name: tmp_path / name,
                        loaded=SimpleNamespace(resolve=lambda path: tmp_path / path))
    calls = []
    monkeypatch.setattr(stages.reward_server, "start",
                        lambda folder, name, gpu, timeout_s: calls.append(("start", name)) or name)
    monkeypatch.setattr(stages.serve_app, "stop", lambda name: calls.append(("stop", name)))
    with stages.serving_rewards(p, recipe.train[0], gpu=False) as (apps, judges):
        assert list(apps) == ["a", "b"] and judges == {}
    first, second = apps["a"], apps["b"]
    assert calls == [("start", first), ("start", second), ("stop", second), ("stop", first)]


def test_a_folder_named_as_a_reward_model_must_be_a_one_output_classifier(tmp_path):
    import json

    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.serve.reward_server import check_checkpoint

    for config, why in [({"architectures": ["LlamaForCausalLM"]}, "no sequence classifier"),
                        ({"architectures": ["LlamaForSequenceClassification"]}, "2 outputs"),
                        ({"architectures": ["LlamaForSequenceClassification"],
                          "id2label": {"0": "bad", "1": "good"}}, "2 outputs")]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(AmaliaError, match=why):
            check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                      "id2label": {"0": "LABEL_0"}}))
    check_checkpoint(tmp_path)
    with pytest.raises(AmaliaError, match="no config.json"):
        check_checkpoint(tmp_path / "missing")


def _sampled_recipe(rewards, extra_stages=(), **rl):
    from amalia_ray.core.config import Recipe

    return Recipe.model_validate({
        "data": {"sources": [{"name": "web", "paths": ["corpus"]}]},
        "train": [{"name": "sft", "objective": "sft", "dataset": "chat.jsonl", "steps": 10}, *extra_stages,
                  {"name": "rl", "objective": "grpo", "dataset": "tasks.jsonl", "steps": 10, "rewards": rewards, **rl}]})


def test_a_judge_served_from_an_earlier_stage_is_checked_when_the_recipe_loads():
    recipe = _sampled_recipe(["format", {"judge": {"stage": "sft"}, "weight": 0.5}])
    judge = recipe.train[1].reward_sources[1]
    assert judge.judge.stage == "sft" and judge.label == "judge:sft"
    for judge, why in [({"stage": "sft", "model": "x"}, "leave model and api_key_env out"),
                       ({"base_url": "http://127.0.0.1:9/v1"}, "names its model"),
                       ({"base_url": "http://127.0.0.1:9/v1", "model": "m", "stage": "sft"}, "exactly one"),
                       ({"stage": "rl"}, "not an earlier stage that generates"),
                       ({"stage": "base"}, "not an earlier stage that generates")]:
        with pytest.raises(ValueError, match=why):
            _sampled_recipe([{"judge": judge}])
    with pytest.raises(ValueError, match="not an earlier stage that generates"):
        _sampled_recipe([{"judge": {"stage": "rm"}}],
                        [{"name": "rm", "objective": "reward", "dataset": "pairs.jsonl", "steps": 10}])
    # a LoRA stage that judges is served as the eval stage would serve it: its adapter, or its merged weights
    chat = {"name": "chat", "objective": "sft", "dataset": "chat.jsonl", "steps": 10, "lora": {}}
    judged = {"init_from": "scratch"}  # rl starts afresh: a LoRA stage it started from would have to merge anyway
    assert _sampled_recipe([{"judge": {"stage": "chat"}}], [chat], **judged).served_engines() == {
        "sft": ["chat"], "rl": []}
    for lora, why in [({"modules_to_save": ["lm_head"]}, "cannot serve an adapter with modules_to_save "
                                                          r"\(it judges stage\(s\) rl\)"),
                      ({}, "its adapters train on random initial weights")]:
        unservable = {**chat, "lora": lora, **({} if lora else {"init_from": "scratch"})}
        with pytest.raises(ValueError, match=why):
            _sampled_recipe([{"judge": {"stage": "chat"}}], [unservable], **judged)
        merged = {**unservable, "lora": {**lora, "merge": True}}
        assert _sampled_recipe([{"judge": {"stage": "chat"}}], [merged], **judged).served_engines()["chat"] == []
        _sampled_recipe(["format"], [unservable], **judged)  # served by nothing: neither evaluated nor judging


def test_a_stage_judged_by_an_earlier_stage_serves_it_first_and_reaches_it_with_the_serve_key(
        tmp_path, monkeypatch):
    """The judged-by stage is served as the eval stage would serve it (here a LoRA stage: its adapter on the engine
    of the weights it trained from) before the reward models, which join that Serve; the scorer reaches the judge at
    the served URL with the stage's model id and the recipe's serve key; everything is stopped in reverse."""
    from types import SimpleNamespace

    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.pipeline import stages
    from amalia_ray.serve.app import Served
    from amalia_ray.train.reward_scoring import RewardScorer

    recipe = _sampled_recipe([{"judge": {"stage": "chat"}}, {"model": "rm"}], [
        {"name": "chat", "objective": "sft", "dataset": "chat.jsonl", "steps": 10, "lora": {}},
        {"name": "rm", "objective": "reward", "dataset": "pairs.jsonl", "steps": 10, "init_from": "scratch"}],
        init_from="scratch")
    p = SimpleNamespace(recipe=recipe, run_name="run", model_id=lambda name: f"run-{name}",
                        stage_dir=lambda name: tmp_path / name, checkpoint_of=lambda name: tmp_path / name / "hf",
                        loaded=SimpleNamespace(resolve=lambda path: tmp_path / path))
    calls = []

    def serve_start(models, cfg, gpu, name, adapters=None, keep_going=False):
        calls.append(("start", name, dict(models), adapters))
        return Served("http://127.0.0.1:8000/v1")

    monkeypatch.setenv("AMALIA_API_KEY", "k")
    monkeypatch.setattr(stages.serve_app, "start", serve_start)
    monkeypatch.setattr(stages.reward_server, "start",
                        lambda folder, name, gpu, timeout_s: calls.append(("rm", name)) or name)
    monkeypatch.setattr(stages.serve_app, "stop", lambda name: calls.append(("stop", name)))
    rl = recipe.train[-1]
    assert stages.judge_checkpoint(p, "chat") == tmp_path / "chat" / "adapter"
    with stages.serving_rewards(p, rl, gpu=False) as (apps, judges):
        assert judges == {"chat": {"base_url": "http://127.0.0.1:8000/v1", "model": "run-sft:chat",
                                   "api_key_env": "AMALIA_API_KEY"}}
        scorer = RewardScorer(rl.reward_sources, reward_apps=apps, judge_servers=judges)
        assert scorer.judges[0].base_url == "http://127.0.0.1:8000/v1" and scorer.judges[0].model == "run-sft:chat"
    (_, judge_app, engines, adapters), (_, rm_app) = calls[0], calls[1]
    assert engines == {"run-sft": tmp_path / "sft" / "hf"} and adapters == {"run-sft": {"chat": tmp_path / "chat" /
                                                                                        "adapter"}}
    assert calls[2:] == [("stop", rm_app), ("stop", judge_app)]
    p.cluster_info = {"billable_cpus": 999}  # billed while the stage trains: the one engine the adapter rides on
    assert stages._judges_held(p, rl, gpu=True) == {"CPU": 1, "GPU": 1}
    with pytest.raises(AmaliaError, match="stage 'chat' is not served"):
        RewardScorer(rl.reward_sources, reward_apps=apps)


def test_a_reward_replica_given_a_gpu_that_torch_cannot_use_says_so(tmp_path):
    """On a GPU cluster each replica holds a GPU; where CUDA is unavailable to torch (a CPU build, a wrong driver)
    the replica fails naming it instead of scoring on the CPU."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.serve.reward_server import RewardModel

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(AmaliaError, match="given a GPU that torch .* cannot use"):
        RewardModel(str(tmp_path), use_gpu=True)


def test_a_bf16_reward_models_scores_keep_fp32_resolution():
    """On a GPU the reward model runs in bf16 but its score head in fp32: scores closer than bf16's step near their
    value stay apart (a GRPO group's advantages need them to)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from amalia_ray.serve.reward_server import score_head_in_fp32

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    model = LlamaForSequenceClassification(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    ids = torch.randint(1, 64, (64, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits[:, 0]
        score_head_in_fp32(model)
        after = model(input_ids=ids).logits[:, 0]
    assert before.dtype == torch.bfloat16 and after.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16, "only the head is upcast"
    assert (after.to(torch.bfloat16).float() != after).float().mean() > 0.9, "finer than bf16's steps"
    assert torch.allclose(after, before.float(), atol=0.1 * after.abs().max().item())
