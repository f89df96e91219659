"""The slice end to end, all real: Ray Data → tokenizer → pack → Ray Train FSDP2 (2 workers) → HF export →
Ray Serve + vLLM → log-likelihood eval over HTTP → report. One Ray cluster for the whole test session."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.runner import Pipeline
from tests.conftest import S3_SECRET, STEPS, free_port, read_jsonl, write_recipe

pytestmark = pytest.mark.e2e

def test_every_stage_completes_and_is_recorded(demo_run):
    pipeline, _ = demo_run
    manifest = json.loads((pipeline.run_dir / "manifest.json").read_text())
    stages = manifest["stages"]
    assert list(stages) == ["data", "tokenizer", "pack", "pretrain", "eval"]
    for name, rec in stages.items():
        assert rec["status"] == "completed", name
        # the corpus is named by its listing (path, size, mtime) in the data stage's config, not hashed before it
        assert (rec["inputs"] or name == "data") and rec["outputs"] and rec["config_hash"] and rec["wall_time_s"] > 0
        assert all(h.startswith("sha256:") for h in rec["inputs"].values())
    data = stages["data"]["metrics"]
    assert data["documents_kept"] > 500 and data["documents_in"] > data["documents_kept"]
    import pyarrow.parquet as pq

    read = pq.read_table(pipeline.run_dir / "data" / "inputs.parquet").to_pylist()
    assert data["input_files"] == len({r["path"] for r in read}) >= 2 and data["input_bytes"] == sum(
        r["bytes"] for r in read) and all(r["sha256"].startswith("sha256:") for r in read), "what was read, hashed"
    kept = list((pipeline.run_dir / "data" / "kept").glob("*.parquet"))
    assert kept, "curated corpus is written as Parquet"
    # accounting: what each stage held × its wall time, the tokens it processed, energy
    cost = {name: rec["cost"] for name, rec in stages.items()}
    assert all(c["device_hours"]["CPU"] > 0 and c["energy_kwh"] > 0 for c in cost.values())
    assert cost["pretrain"]["held"] == {"CPU": 2}, "2 workers × 1 CPU, no GPU on this machine"
    assert cost["pretrain"]["device_hours"]["CPU"] == pytest.approx(2 * stages["pretrain"]["wall_time_s"] / 3600)
    assert cost["pretrain"]["tokens"] == STEPS * 8 * 256 and cost["pretrain"]["tokens_per_joule"] > 0
    assert cost["pack"]["tokens"] % 256 == 0 and cost["pack"]["tokens"] > 0
    assert cost["eval"]["tokens"] > 0, "prompt + completion tokens, as the server counted them"
    assert cost["data"]["held"]["CPU"] <= (os.cpu_count() or 1), "logical CPUs above the core count are not billed"
    pretrain = stages["pretrain"]["metrics"]
    assert pretrain["placement"] == "PACK" and pretrain["worker_nodes"] == 1 and pretrain["mean_world_size"] == 2
    assert pretrain["sharding"] == "FSDP over 2" and pretrain["transport"] == "gloo (TCP) on 1 node(s)"
    assert "| 2 on 1 node(s), PACK, FSDP over 2, gloo (TCP) on 1 node(s) |" in \
        (pipeline.run_dir / "report.md").read_text(), "the report says how the stage's collectives ran"


def test_mlflow_store_holds_the_run_and_a_nested_run_per_stage(demo_run):
    """What `mlflow ui --backend-store-uri sqlite:///runs/<name>/mlruns/mlflow.db` shows after the demo run."""
    from mlflow.tracking import MlflowClient

    from amalia_ray.pipeline.tracking import default_mlflow_uri

    pipeline, report = demo_run
    client = MlflowClient(tracking_uri=default_mlflow_uri(pipeline.run_dir))
    experiment = client.get_experiment_by_name(pipeline.run_name)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags][:1]
    stages = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert list(stages) == ["data", "tokenizer", "pack", "pretrain", "eval"]
    assert all(r.info.status == "FINISHED" for r in [parent, *stages.values()])
    assert parent.data.params["train.0.lr"] == str(pipeline.recipe.train[0].lr)
    pretrain = stages["pretrain"]
    assert pretrain.data.params["stage.steps"] == str(STEPS) and "model.hidden_size" in pretrain.data.params
    losses = client.get_metric_history(pretrain.info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1)), "every step's loss"
    logged = [json.loads(ln)["loss"] for ln in (pipeline.run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines() if ln]
    assert [m.value for m in sorted(losses, key=lambda m: m.step)] == pytest.approx(logged)
    assert pretrain.data.metrics["cost.energy_kwh"] > 0 and stages["data"].data.metrics["documents_kept"] > 500
    scored = {k for k in stages["eval"].data.metrics if k.startswith("results.") and k.endswith(".n")}
    assert len(scored) == len(pipeline.recipe.eval.tasks), "an item count per task and model, beside its scores"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"recipe.yaml", report.name} <= artifacts


def test_loss_falls_and_checkpoints_are_dcp(demo_run):
    pipeline, _ = demo_run
    history = read_jsonl(pipeline.run_dir / "pretrain" / "metrics.jsonl")
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert all(h["world_size"] == 2 for h in history)
    first, last = history[0]["loss"], sum(h["loss"] for h in history[-5:]) / 5
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"
    checkpoints = sorted(p for p in (pipeline.run_dir / "pretrain" / "ray").rglob("checkpoint_*") if p.is_dir())
    assert checkpoints and all((c / ".metadata").exists() for c in checkpoints)
    assert {p.name for p in checkpoints[-1].glob("__*_0.distcp")} == {"__0_0.distcp", "__1_0.distcp"}


def test_exported_checkpoint_loads_in_transformers(demo_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pipeline, _ = demo_run
    ckpt = pipeline.checkpoint_of("pretrain")
    assert (ckpt / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    ids = tok("O sistema Debian", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert math.isfinite(out.loss.item()) and out.loss.item() < 8.0


def test_eval_over_http_scores_every_item(demo_run):
    pipeline, report = demo_run
    result = json.loads((pipeline.run_dir / "eval" / "e2e-pretrain" / "pt-mc-sample.json").read_text())
    assert result["n"] == 20 and len(result["items"]) == 20
    # eval.contamination_of: [this_run]: each item checked against the run's curated corpus
    assert result["contamination_of"] == [str(pipeline.run_dir)] and all("seen" in it for it in result["items"])
    assert result["n_seen"] + result["n_clean"] == 20 and "Items seen in the training text" in report.read_text()
    assert result["base_url"].startswith("http://127.0.0.1:")
    assert 0.0 <= result["scores"]["acc"] <= 1.0
    for item in result["items"]:
        assert len(item["logprobs"]) == 4 and all(lp < 0 and math.isfinite(lp) for lp in item["logprobs"])
    every = {t.stem: json.loads(t.read_text()) for t in (pipeline.run_dir / "eval" / "e2e-pretrain").glob("*.json")}
    assert set(every) == {"pt-mc-sample", "pheb-sample", "saudade-sample", "cloze-sample", "variety-sample"}
    assert every["saudade-sample"]["scores"]["chance"] == 0.5 and every["pheb-sample"]["by_subject"]
    assert every["cloze-sample"]["method"] == "generate" and all(
        "generation" in it for it in every["cloze-sample"]["items"])
    assert {it["label"] for it in every["variety-sample"]["items"]} <= {"pt-PT", "pt-BR", "unknown"}
    text = report.read_text()
    assert "## Evaluation" in text and "| saudade-sample | acc |" in text and "![loss curve](loss.png)" in text
    assert "![evaluation](eval.png)" in text and "| variety-sample | pt_pt |" in text
    assert "## Cost" in text and "| **total** |" in text and "2 on 1 node(s), PACK" in text
    assert (pipeline.run_dir / "loss.png").stat().st_size > 10_000
    assert (pipeline.run_dir / "eval.png").stat().st_size > 5_000


@pytest.mark.reliability
def test_on_a_shared_serve_ours_come_and_go_and_another_teams_app_keeps_serving(demo_run, other_team):
    """Another team's application ran on the cluster before ours. The eval stage joined that Serve on its proxy's
    port (not the recipe's), under an application of the run's own name, and deleted only that; a start that does
    not come up in time leaves no application and no replica behind. The other team's app answers throughout.
    (`amalia serve --address` beside it, and `--stop --app`: test_e2e_base_models.py, serving the families.)"""
    import httpx
    from ray import serve
    from ray.util.state import list_actors

    from amalia_ray.core.config import ServeConfig
    from amalia_ray.serve import app as serve_app
    from tests.conftest import OTHER_TEAM_REPLY

    def other_answers() -> bool:
        return httpx.get(other_team, timeout=30).text == OTHER_TEAM_REPLY

    pipeline, _ = demo_run
    shared_port = int(other_team.split(":")[2].split("/")[0])
    assert pipeline.manifest.stages["eval"].metrics["base_url"] == f"http://127.0.0.1:{shared_port}/v1"
    assert other_answers() and set(serve.status().applications) == {"other-team"}

    cfg = ServeConfig(port=free_port(), startup_timeout_s=2)
    with pytest.raises(AmaliaError, match="serving did not come up within 2s"):
        serve_app.start({"slow": pipeline.checkpoint_of("pretrain")}, cfg, use_gpu=False, name="amalia-slow")
    assert set(serve.status().applications) == {"other-team"}

    def replicas_left() -> list[str]:
        return [a.name for a in list_actors(filters=[("state", "=", "ALIVE")]) if "amalia-slow" in (a.name or "")]

    deadline = time.monotonic() + 60  # a replica killed mid-start takes a moment to be reported dead
    while replicas_left() and time.monotonic() < deadline:
        time.sleep(1)
    assert not replicas_left(), replicas_left()
    assert other_answers()


def test_second_run_skips_unchanged_stages(demo_run, recipe_path, capsys):
    pipeline, _ = demo_run
    before = json.loads((pipeline.run_dir / "manifest.json").read_text())["stages"]
    Pipeline(load_recipe(recipe_path)).run()
    out = capsys.readouterr().out
    after = json.loads((pipeline.run_dir / "manifest.json").read_text())["stages"]
    for name in before:
        assert after[name]["attempts"] == before[name]["attempts"] == 1, name
        assert after[name]["finished_at"] == before[name]["finished_at"], name
    assert out.count("skipped") == len(before)


def test_sft_then_on_policy_dpo_continue_from_the_previous_checkpoints(post_training):
    """pretrain -> LoRA sft on conversations made from the Debian FAQ -> a reward model -> AMALIA-style on-policy
    dpo: the pairs are sampled from the sft checkpoint by two vLLM engines and ranked by rule rewards and the
    reward model, trained from sft by Ray Train and served by Ray Serve while dpo samples. Each policy stage starts
    from the previous one's export — dpo from the LoRA stage's merged weights, past the reward model, which
    branches off sft and is not served for evaluation —, sft trains adapters on assistant tokens
    only and checkpoints nothing else, its PEFT adapter folder on the pretrained export gives the merged export's
    logits, dpo starts at exactly ln 2 (the policy is its own reference before the first update), and both export
    HF checkpoints and TensorBoard events. (That DPO learns, and that its loss equals TRL's, is shown without Ray in
    test_dpo.py; LoRA's parity with PEFT in test_lora.py; full SFT runs in the demo run.)"""
    from transformers import AutoConfig

    from amalia_ray.pipeline.stages import served_models

    pipeline = Pipeline(load_recipe(post_training))
    pipeline.run(until="dpo")
    stages = pipeline.manifest.stages
    assert stages["pretrain"].attempts == 1 and stages["sft"].attempts == 1, "pretrain and sft unchanged: skipped"
    for name in ("sft", "rm", "dpo"):
        rec = stages[name]
        assert rec.status == "completed" and "init_checkpoint" in rec.inputs and "dataset" in rec.inputs
        assert (pipeline.checkpoint_of(name) / "model.safetensors").exists()
        assert list((pipeline.run_dir / name / "tensorboard").glob("events.out.tfevents.*"))
    assert stages["rm"].inputs["init_checkpoint"] == stages["dpo"].inputs["init_checkpoint"], "both from sft"
    assert "reward_model:rm" in stages["dpo"].inputs, "the reward model's weights decide whether dpo reruns"
    kept = json.loads((pipeline.run_dir / "dpo" / "on-policy-pairs.json").read_text())
    assert kept["pairs"] and len(kept["key"]) == 64, "the pairs a resumed attempt of this run trains on"
    rm = read_jsonl(pipeline.run_dir / "rm" / "metrics.jsonl")
    assert [h["step"] for h in rm] == [1, 2, 3, 4] and all(math.isfinite(h["loss"]) and 0 <= h["accuracy"] <= 1
                                                           for h in rm)
    rm_config = AutoConfig.from_pretrained(pipeline.checkpoint_of("rm"))
    assert rm_config.architectures == ["LlamaForSequenceClassification"] and rm_config.num_labels == 1
    assert pipeline.model_id("rm") not in served_models(pipeline, paths=False)[0], "a reward model is not served"
    sft = read_jsonl(pipeline.run_dir / "sft" / "metrics.jsonl")
    assert [h["step"] for h in sft] == list(range(1, 9))
    assert all(math.isfinite(h["loss"]) for h in sft) and sft[-1]["loss_items"] < 8 * 512
    assert all(0 < h["mfu"] < 1.5 and h["memory_gb"] > 0 for h in sft)
    _adapters_only_and_merged(pipeline)
    pairs = read_jsonl(pipeline.run_dir / "dpo" / "on-policy-pairs.jsonl")
    assert pairs and all(p["chosen"] != p["rejected"] for p in pairs)
    dpo = read_jsonl(pipeline.run_dir / "dpo" / "metrics.jsonl")
    assert [h["step"] for h in dpo] == list(range(1, 5)) and all(h["loss_items"] == 8 for h in dpo)
    assert abs(dpo[0]["loss"] - math.log(2)) < 1e-4 and abs(dpo[0]["rewards/margins"]) < 1e-4
    assert all(math.isfinite(h["loss"]) and 0 <= h["rewards/accuracies"] <= 1 for h in dpo)
    assert abs(dpo[-1]["rewards/chosen"]) > 1e-3, "the policy moved away from its reference"


def _adapters_only_and_merged(pipeline) -> None:
    """The LoRA sft stage's checkpoints hold adapters (and their optimizer state) only, and its adapter folder on
    the stage's starting weights gives its merged export's logits."""
    import torch
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    metadata = [dcp.FileSystemReader(str(m.parent)).read_metadata()
                for m in (pipeline.run_dir / "sft" / "ray").rglob(".metadata")]
    assert metadata, "the sft stage checkpointed"
    for meta in metadata:
        weights = [k for k in meta.state_dict_metadata if k.startswith("model.")]
        assert weights and all(".lora_" in k for k in weights), weights[:4]
    base = AutoModelForCausalLM.from_pretrained(str(pipeline.checkpoint_of("pretrain")), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(pipeline.run_dir / "sft" / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(pipeline.checkpoint_of("sft")), dtype=torch.float32)
    ids = torch.arange(64).view(2, 32) * 37 % 4000
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)


@pytest.mark.slow
def test_a_base_model_continued_with_a_grown_vocabulary_then_served_beside_its_stage(demo_run, recipe_path):
    """The demo's pretrained export as a Hugging Face base model (model.from, tokenizer.from: model): its tokenizer
    is extended by tokens learned from the corpus and packs it; continued pretraining starts from its weights (the
    embeddings grown; post-training from a base of every family: test_e2e_base_models.py); the eval stage serves
    the base beside the stage and the report states each task's change against the base. The curated corpus is the
    demo run's (its manifest record and folder carried over), so only what the base model changes runs again."""
    from transformers import AutoTokenizer

    demo, _ = demo_run
    base = demo.checkpoint_of("pretrain")
    data = yaml.safe_load(recipe_path.read_text())
    data["run"]["name"] = "e2e-base"
    data["model"] = {"from": str(base)}
    data["tokenizer"] = {"from": "model", "add_tokens": 24}  # extended by tokens learned from the corpus
    data["train"] = [{"name": "pretrain", "objective": "pretrain", "lr": 0.001, "steps": 2, "global_batch_size": 8,
                      "micro_batch_size": 4, "warmup_steps": 0, "num_workers": 2, "checkpoint_every": 2}]
    data["eval"]["tasks"] = [t for t in data["eval"]["tasks"] if t["format"] == "mcq"]
    path = recipe_path.parent / "base.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = demo.run_dir.parent / "e2e-base"
    shutil.copytree(demo.run_dir / "data", run_dir / "data")
    manifest = json.loads((demo.run_dir / "manifest.json").read_text())
    manifest.update(run_name="e2e-base", stages={"data": manifest["stages"]["data"]})
    (run_dir / "manifest.json").write_text(json.dumps(manifest))

    pipeline = Pipeline(load_recipe(path))
    report = pipeline.run()
    stages = pipeline.manifest.stages
    assert stages["data"].attempts == manifest["stages"]["data"]["attempts"], "the corpus was not curated again"
    assert stages["tokenizer"].metrics["from"] == str(base) and "base:tokenizer.json" in stages["tokenizer"].inputs
    assert stages["tokenizer"].metrics["tokens_added"] == 24 and "corpus" in stages["tokenizer"].inputs
    assert stages["pretrain"].inputs["init_checkpoint"] == stages["eval"].inputs["model:e2e-base-base"]
    pretrain = read_jsonl(pipeline.run_dir / "pretrain" / "metrics.jsonl")
    assert [h["step"] for h in pretrain] == [1, 2] and all(math.isfinite(h["loss"]) for h in pretrain)
    demo_end = read_jsonl(demo.run_dir / "pretrain" / "metrics.jsonl")[-1]["loss"]
    assert pretrain[0]["loss"] < demo_end + 1.0, "continued from the base's weights, not from random ones"
    results = stages["eval"].metrics["results"]
    assert stages["eval"].metrics["base_model"] == "e2e-base-base"
    assert {f"e2e-base-{m}/pt-mc-sample" for m in ("base", "pretrain")} <= set(results)
    change = results["e2e-base-pretrain/pt-mc-sample"]["acc"] - results["e2e-base-base/pt-mc-sample"]["acc"]
    text = report.read_text()
    assert "change against the base model e2e-base-base" in text and f"({change:+.3f})" in text
    assert (pipeline.run_dir / "eval.png").exists()
    exported = json.loads((pipeline.checkpoint_of("pretrain") / "config.json").read_text())
    assert exported["model_type"] == "llama" and exported["vocab_size"] == json.loads(
        (base / "config.json").read_text())["vocab_size"] + 24 == len(
        AutoTokenizer.from_pretrained(str(pipeline.checkpoint_of("pretrain")))), "embeddings grown with the vocabulary"


@pytest.mark.slow
def test_sweep_stops_weak_trials_early_and_promotes_the_winner(demo_run, recipe_path):
    """`amalia sweep`: 4 trials of the pretraining stage's proxy (1 layer, 9 steps, validation every 3) on Ray
    Tune + Ray Train, two learning rates that learn and two that cannot; ASHA stops the hopeless ones at a
    validation, the winner is one that learns, and `amalia promote` carries it into a new recipe."""
    from amalia_ray.pipeline.sweep_space import SweepSpace
    from amalia_ray.pipeline.sweep import promote, run_sweep

    folder = recipe_path.parent / "sweep"
    folder.mkdir()
    recipe = write_recipe(folder, **{
        "run.name": "e2e", "run.output_dir": str(recipe_path.parent / "runs"),
        "train.0.proxy": {"model": {"num_layers": 1}, "steps": 9, "validate_every": 3, "num_workers": 1},
    })
    space = SweepSpace.model_validate({
        "search": "grid", "max_concurrent_trials": 2, "scheduler": {"grace_period": 1, "reduction_factor": 2},
        "parameters": {"lr": {"values": [0.01, 0.005, 1e-7, 2e-7]}}})
    out = run_sweep(Pipeline(load_recipe(recipe)), "pretrain", space)
    summary = json.loads((out / "sweep.json").read_text())
    trials = summary["trials"]
    assert len(trials) == 4 and not any(t["status"] == "failed" for t in trials), trials
    hopeless = [t for t in trials if t["config"]["lr"] < 1e-6]
    # ASHA stops whatever falls below the cut at a rung: both hopeless trials, and possibly the weaker of the two
    # good ones if it reached the first rung behind the other
    assert all(t["status"] == "stopped early" and t["steps"] < 9 for t in hopeless), trials
    assert summary["best"]["config"]["lr"] in (0.01, 0.005) and summary["best"]["steps"] == 9
    for t in trials:  # every trial is a real training run, logged like any stage
        history = read_jsonl(out / "trials" / t["trial_id"] / "metrics.jsonl")
        # (a stopped trial may train a step or two past its last report before Tune stops it)
        assert history[-1]["step"] >= t["steps"] and list((out / "trials" / t["trial_id"] / "tensorboard").iterdir())
    assert (out / "sweep.png").stat().st_size > 5_000 and "(best)" in (out / "report.md").read_text()
    report = (recipe_path.parent / "runs" / "e2e" / "report.md").read_text()
    assert "## Sweeps" in report and summary["sweep_id"] in report

    promoted = load_recipe(promote(out)).recipe
    assert promoted.train[0].lr == summary["best"]["config"]["lr"]
    assert promoted.provenance[0]["sweep_id"] == summary["sweep_id"]


@pytest.mark.slow
def test_a_lora_sweep_benchmarks_its_trial_adapters_on_one_engine(post_training):
    """`amalia sweep` over a LoRA SFT stage's rank and scale: two trials train adapters on the pretrained
    checkpoint, and the benchmark serves both on one vLLM engine of that checkpoint, each trial a model id on it,
    scored over HTTP on an eval task."""
    from amalia_ray.pipeline.sweep_space import SweepSpace
    from amalia_ray.pipeline.sweep import run_sweep

    data = yaml.safe_load(post_training.read_text())
    sft = next(s for s in data["train"] if s["name"] == "sft")
    sft["proxy"] = {"steps": 4, "validate_every": 2, "num_workers": 1}
    recipe = post_training.with_name("lora-sweep.yaml")
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    task = data["eval"]["tasks"][0]["name"]
    space = SweepSpace.model_validate({
        "search": "grid", "max_concurrent_trials": 2, "scheduler": {"grace_period": 2},
        "parameters": {"lora.r": {"values": [4, 8]}, "lora.alpha": {"values": [16]}},
        "benchmark": {"task": task, "top": 2}})
    out = run_sweep(Pipeline(load_recipe(recipe)), "sft", space)
    summary = json.loads((out / "sweep.json").read_text())
    benchmarked = [t for t in summary["trials"] if "benchmark" in t]
    assert len(benchmarked) == 2, summary["trials"]
    for t in benchmarked:
        assert t["benchmark"]["one_engine"] is True and t["benchmark"]["model"] == f"base:trial-{t['trial_id']}"
        assert t["benchmark"]["n"] > 0 and 0 <= t["benchmark"]["value"] <= 1
        adapter = json.loads((out / "trials" / t["trial_id"] / "adapter" / "adapter_config.json").read_text())
        assert adapter["r"] == t["config"]["lora.r"]
    assert "served together on one engine" in (out / "report.md").read_text()


@pytest.mark.slow
def test_an_interrupted_data_mix_ablation_resumes_and_scores_per_source_and_on_a_served_benchmark(
        demo_run, recipe_path, tmp_path):
    """A data-mix ablation: two trials that differ only in one source's sampling weight, scored by validation loss
    per source. Its driver (`amalia sweep`) is SIGKILLed after the first trial finished: running the same sweep again
    restores Tune's experiment and trains only the trial that was left, then serves the best finished trial with
    vLLM and scores it on an eval task over HTTP."""
    import ray

    folder = recipe_path.parent / "sweep-mix"
    folder.mkdir()
    recipe = write_recipe(folder, **{
        "run.name": "e2e", "run.output_dir": str(recipe_path.parent / "runs"), "serve.port": free_port(),
        "train.0.proxy": {"model": {"num_layers": 1}, "steps": 6, "validate_every": 3, "num_workers": 1},
        "eval.tasks": [{"name": "pt-mc", "path": str(Path(__file__).parents[1] / "evals/tasks/pt_mc_sample.jsonl"),
                        "format": "mcq", "limit": 6}],
    })
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "search": "grid", "metric": "val_loss/debian-faq-pt", "max_concurrent_trials": 1, "scheduler": {"type": "none"},
        "benchmark": {"task": "pt-mc", "top": 1}, "parameters": {"mix.debian-faq-pt": {"values": [0.1, 10.0]}}}))
    cli = [sys.executable, "-m", "amalia_ray.cli", "sweep", str(recipe), "--stage", "pretrain", "--space", str(space)]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "TUNE_GLOBAL_CHECKPOINT_S": "1"}
    sweeps = recipe_path.parent / "runs" / "e2e" / "sweeps"
    earlier = set(sweeps.glob("*"))  # the other sweep tests' folders
    driver = subprocess.Popen(cli, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, started = time.monotonic() + 600, []
    while time.monotonic() < deadline and len(started) < 2 and driver.poll() is None:
        # one trial at a time: a second one started
        started = sorted(m for m in sweeps.glob("*/trials/*/metrics.jsonl") if m.parents[2] not in earlier)
        time.sleep(0.5)
    assert len(started) == 2, "the second trial never started"
    first = started[0]
    assert read_jsonl(first)[-1]["step"] == 6 and (first.parent / "hf").exists(), "the first trial had finished"
    time.sleep(3)  # Tune saves its experiment state every second here
    driver.kill()
    driver.wait()
    finished_at = first.stat().st_mtime

    from amalia_ray.pipeline.sweep_space import load_space
    from amalia_ray.pipeline.sweep import run_sweep

    out = run_sweep(Pipeline(load_recipe(recipe)), "pretrain", load_space(space))
    assert first.stat().st_mtime == finished_at, "the finished trial was not trained again"
    trials = json.loads((out / "sweep.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["completed", "completed"]
    assert sorted(t["config"]["mix.debian-faq-pt"] for t in trials) == [0.1, 10.0]
    for t in trials:
        assert set(t["val_loss_by_source"]) == {"debian-reference-pt", "debian-faq-pt"}
        assert t["metric"] == t["val_loss_by_source"]["debian-faq-pt"]
    best = min(trials, key=lambda t: t["metric"])
    assert best["benchmark"]["task"] == "pt-mc" and best["benchmark"]["n"] == 6 and 0 <= best["benchmark"]["value"] <= 1
    assert [t for t in trials if "benchmark" in t] == [best], "only the top trial is served"
    assert "pt-mc acc" in (out / "report.md").read_text()


@pytest.mark.reliability
def test_storage_on_s3_checkpoints_there_and_a_fresh_machine_carries_on(demo_run, recipe_path, tmp_path, s3_server):
    """run.storage: s3://… — the finished data stages are mirrored there, Ray Train writes its DCP checkpoints
    there directly. The bucket fills up while the third checkpoint is uploaded (one file of it written): the run
    fails with one clear line and the half-written checkpoint, which Ray Train never registered, is detected; then
    the newest registered checkpoint is damaged in the bucket, and the rerun resumes from the one before. A machine
    without the run folder pulls the manifest and outputs and skips every stage."""
    import cloudpickle
    import pyarrow.fs as pafs

    import tests.fault_injection as faults
    from amalia_ray.core import signing
    from amalia_ray.train import checkpoint, train_stage

    pipeline, _ = demo_run
    local = tmp_path / "runs"
    shutil.copytree(pipeline.run_dir, local / "e2e", ignore=lambda d, names: [
        n for n in names if Path(d) == pipeline.run_dir and n not in ("data", "tokenizer", "pack", "manifest.json")])
    recipe = write_recipe(tmp_path, **{
        "run.name": "e2e", "run.output_dir": str(local), "run.storage": "s3://amalia/team/runs",
        "run.storage_options": s3_server, "train.0.steps": 8, "train.0.checkpoint_every": 2,
        "train.0.warmup_steps": 1, "train.0.max_failures": 0,
    })
    cloudpickle.register_pickle_by_value(faults)
    real_loop = train_stage.train_loop
    train_stage.train_loop = faults.full_storage_at(upload=3)
    failing = Pipeline(load_recipe(recipe))
    try:
        with pytest.raises(AmaliaError) as failed:
            failing.run(until="pretrain")
    finally:
        train_stage.train_loop = real_loop
    message = str(failed.value)
    assert message.startswith("[pretrain] the checkpoint of step 6 could not be written (OSError: [Errno 28] No "
                              "space left on device"), message
    assert "\n" not in message and "the checkpoints before it are intact" in message
    rec = failing.manifest.stages["pretrain"]
    assert rec.status == "failed" and "No space left on device" in rec.error
    s3 = pafs.S3FileSystem(**s3_server)
    ray_runs = [i.path for i in s3.get_file_info(pafs.FileSelector("amalia/team/runs/e2e/pretrain/ray"))]
    snapshot = json.loads(s3.open_input_stream(f"{ray_runs[0]}/checkpoint_manager_snapshot.json").read())
    registered = {r["metrics"]["step"]: r for r in snapshot["checkpoint_results"]}
    assert sorted(registered) == [2, 4], "two checkpoints registered before the failure"
    folders = sorted(i.path for i in s3.get_file_info(pafs.FileSelector(ray_runs[0]))
                     if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_"))
    assert len(folders) == 3, folders
    key = signing.signing_key()
    intact = {f: not checkpoint.problems(checkpoint.CheckpointFiles(s3, f), None, 0, key) for f in folders}
    assert sum(intact.values()) == 2, "the half-written one is detected, the two before it are intact"
    newest = next(f for f in folders if intact[f]
                  and json.loads(s3.open_input_stream(f"{f}/{checkpoint.TRAIN_STATE}").read())["step"] == 4)
    shard = f"{newest}/__1_0.distcp"
    damaged = s3.open_input_stream(shard).read()[:-100]  # an interrupted copy into the bucket
    with s3.open_output_stream(shard) as out:
        out.write(damaged)
    Pipeline(load_recipe(recipe)).run(until="pretrain")
    history = read_jsonl(local / "e2e" / "pretrain" / "metrics.jsonl")
    assert [h["step"] for h in history] == list(range(1, 9))
    assert {h["attempt_start_step"] for h in history if h["step"] > 2} == {2}, "resumed from step 2, not 4"
    stored = {i.path.removeprefix("amalia/team/runs/e2e/") for i in s3.get_file_info(
        pafs.FileSelector("amalia/team/runs/e2e", recursive=True)) if i.type == pafs.FileType.File}
    assert {"manifest.json", "report.md", "pretrain/hf/model.safetensors", "pretrain/metrics.jsonl"} <= stored
    assert any(f.startswith("data/kept/") and f.endswith(".parquet") for f in stored)
    assert any(f.startswith("pack/train/") for f in stored) and any(f.startswith("tokenizer/") for f in stored)
    dcp = [f for f in stored if f.startswith("pretrain/ray/") and f.endswith("/.metadata")]
    assert len(dcp) >= 1, "Ray Train's checkpoints are written to the bucket"
    assert not (local / "e2e" / "pretrain" / "ray").exists(), "and not to the local run folder"
    blobs = [s3.open_input_stream(f"amalia/team/runs/e2e/{f}").read() for f in stored if not f.endswith(".distcp")]
    blobs += [f.read_bytes() for f in local.rglob("*") if f.is_file() and f.suffix not in (".distcp", ".parquet")]
    assert not [b for b in blobs if S3_SECRET.encode() in b], "the storage credentials are in no file, here or there"

    attempts = {n: rec["attempts"] for n, rec in json.loads((local / "e2e" / "manifest.json").read_text())[
        "stages"].items()}
    shutil.rmtree(local)
    fresh = Pipeline(load_recipe(recipe))
    assert fresh.manifest.stages["pretrain"].status == "completed"
    calls = []
    fresh.execute = lambda spec, run=fresh.execute: calls.append(spec.name) or run(spec)
    fresh.run(until="pretrain")
    assert calls == ["data", "tokenizer", "pack", "pretrain"]
    assert all(fresh.manifest.stages[n].attempts == attempts[n] for n in calls), "nothing was run again"
    assert (local / "e2e" / "pretrain" / "hf" / "model.safetensors").exists(), "the checkpoint came back"


def test_corpus_empty_after_filtering(ray_cluster, tmp_path):
    recipe = write_recipe(tmp_path, **{"run.name": "empty", "data.min_chars": 10_000_000})
    with pytest.raises(AmaliaError, match=r"corpus empty after filtering: 0 of \d+ documents kept"):
        Pipeline(load_recipe(recipe)).run(until="data")
