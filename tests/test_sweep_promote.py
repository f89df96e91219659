"""Search spaces become Tune spaces; `amalia promote` carries a sweep's winner into a new, valid recipe with its
provenance, which the run manifest then records."""

import json

import pytest
import yaml

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.sweep_space import SweepSpace
from amalia_ray.pipeline.runner import Pipeline
from amalia_ray.pipeline.sweep import promote, proxy_stage, sweep_id
from tests.conftest import write_recipe


def test_spaces_become_tune_spaces():
    from ray.tune.search.sample import Categorical, Float

    space = SweepSpace.model_validate({"search": "random", "parameters": {
        "lr": {"distribution": "loguniform", "low": 1e-4, "high": 1e-2}, "schedule": {"values": ["cosine", "wsd"]}}})
    tune_space = space.tune_space()
    assert isinstance(tune_space["lr"], Float) and isinstance(tune_space["schedule"], Categorical)
    grid = SweepSpace.model_validate({"search": "grid", "parameters": {"lr": {"values": [0.1, 0.01]}}})
    assert grid.tune_space()["lr"] == {"grid_search": [0.1, 0.01]}
    with pytest.raises(ValueError, match="grid search walks `values`"):
        SweepSpace.model_validate({"search": "grid", "parameters": {"lr": {"distribution": "uniform", "low": 0,
                                                                             "high": 1}}})


def test_proxy_shrinks_the_stage_and_a_bad_proxy_model_fails_the_recipe(tmp_path):
    stage = load_recipe(write_recipe(tmp_path, **{"train.0.proxy": {"steps": 12, "validate_every": 3}})).recipe.train[0]
    proxy = proxy_stage(stage)
    assert (proxy.steps, proxy.checkpoint_every, proxy.log_every, proxy.max_failures) == (12, 3, 3, 0)
    space = SweepSpace.model_validate({"parameters": {"lr": {"values": [0.1]}}})
    assert sweep_id(proxy, space).startswith("pretrain-")
    # the model, seed and data the trials train on are part of it: a changed one is a new sweep, not a restore
    context = {"model": {"hidden_size": 64}, "seed": 0, "inputs": {"pack": "f1"}}
    assert sweep_id(proxy, space, context) == sweep_id(proxy, space, dict(context))
    assert len({sweep_id(proxy, space, {**context, key: value}) for key, value in
                [("model", {"hidden_size": 128}), ("seed", 1), ("inputs", {"pack": "f2"}), ("seed", 0)]}) == 4
    with pytest.raises(AmaliaError, match=r"proxy.model does not make a valid model"):
        load_recipe(write_recipe(tmp_path, **{"train.0.proxy": {"model": {"num_heads": 3}}}))


def test_promote_writes_the_winner_with_its_provenance(tmp_path):
    recipe = write_recipe(tmp_path)
    sweep_dir = tmp_path / "runs" / "demo" / "sweeps" / "pretrain-abcd1234"
    sweep_dir.mkdir(parents=True)
    best = {"trial_id": "t2", "config": {"lr": 0.004, "schedule": "wsd"}, "metric": 5.1, "best_metric": 5.1,
            "steps": 30, "status": "completed"}
    (sweep_dir / "sweep.json").write_text(json.dumps({
        "sweep_id": "pretrain-abcd1234", "recipe": str(recipe), "run": "demo", "stage": "pretrain",
        "metric": "val_loss", "mode": "min", "space": {}, "proxy": {"model": {"num_layers": 1}, "steps": 30},
        "best": best, "trials": [best, {**best, "trial_id": "t1", "metric": 6.0, "status": "stopped early"}]}))
    out = promote(sweep_dir)
    assert out == recipe.with_name("recipe.pretrain-promoted.yaml")
    promoted = load_recipe(out).recipe
    assert promoted.train[0].lr == 0.004 and promoted.train[0].schedule == "wsd"
    assert promoted.model == load_recipe(recipe).recipe.model, "full scale: the proxy's model is not carried"
    prov = promoted.provenance[0]
    assert prov["sweep_id"] == "pretrain-abcd1234" and prov["metric"] == {"val_loss": 5.1, "mode": "min"}
    assert prov["trials"] == 2 and prov["proxy"]["steps"] == 30
    assert Pipeline(load_recipe(out)).manifest.provenance == promoted.provenance
    assert yaml.safe_load(out.read_text())["train"][0]["lr"] == 0.004


def test_promote_needs_a_finished_sweep(tmp_path):
    with pytest.raises(AmaliaError, match="not a finished sweep"):
        promote(tmp_path)


def test_a_lora_stage_sweeps_its_adapters_and_promotes_them(tmp_path):
    from amalia_ray.pipeline.sweep import trial_stage_of

    recipe = write_recipe(tmp_path, **{"train.0.lora": {"r": 8, "merge": True}})
    stage = load_recipe(recipe).recipe.train[0]
    space = SweepSpace.model_validate({"parameters": {
        "lora.r": {"values": [4, 16]}, "lora.alpha": {"distribution": "uniform", "low": 8, "high": 32},
        "lora.target_modules": {"values": [["q_proj", "v_proj"], "all-linear"]}, "lr": {"values": [0.001]}}})
    space.check_against(stage, ["debian-reference-pt", "debian-faq-pt"])
    trial = trial_stage_of(stage.model_dump(), {"lora.r": 16, "lora.alpha": 20.0, "lr": 0.001}, None)
    assert (trial.lora.r, trial.lora.alpha, trial.lora.merge, trial.lr) == (16, 20.0, True, 0.001)
    with pytest.raises(AmaliaError, match="tunable LoRA fields: lora.r"):
        SweepSpace.model_validate({"parameters": {"lora.merge": {"values": [False]}}}).check_against(stage, [])
    with pytest.raises(AmaliaError, match="does not fit"):
        SweepSpace.model_validate({"parameters": {"lora.r": {"values": [0]}}}).check_against(stage, [])
    (tmp_path / "full").mkdir()
    unmerged = load_recipe(write_recipe(tmp_path / "full", **{"train.0.lora": {"r": 8}},
                                        **{"eval.tasks": []})).recipe.train[0]
    benchmarked = SweepSpace.model_validate({"parameters": {"lora.r": {"values": [4]}},
                                             "benchmark": {"task": "pt-mc-sample"}})
    with pytest.raises(AmaliaError, match="a proxy model .*set lora.merge: true"):
        benchmarked.check_against(unmerged, [])  # the proxy's 1-layer model has no engine to run adapters on
    benchmarked.check_against(unmerged.model_copy(update={"proxy": type(unmerged.proxy)()}), [])  # one engine
    with pytest.raises(AmaliaError, match="random initial weights"):  # a new model's first stage: no engine
        benchmarked.check_against(unmerged.model_copy(update={"proxy": type(unmerged.proxy)()}), [], has_start=False)
    full = load_recipe(write_recipe(tmp_path / "full")).recipe.train[0]
    with pytest.raises(AmaliaError, match="trains no LoRA adapters"):
        space.check_against(full, [])

    sweep_dir = tmp_path / "runs" / "demo" / "sweeps" / "pretrain-lora"
    sweep_dir.mkdir(parents=True)
    best = {"trial_id": "t1", "config": {"lora.r": 16, "lr": 0.001}, "metric": 5.0, "best_metric": 5.0, "steps": 30,
            "status": "completed"}
    (sweep_dir / "sweep.json").write_text(json.dumps({
        "sweep_id": "pretrain-lora", "recipe": str(recipe), "run": "demo", "stage": "pretrain", "metric": "val_loss",
        "mode": "min", "space": {}, "proxy": {}, "best": best, "trials": [best]}))
    promoted = load_recipe(promote(sweep_dir)).recipe.train[0]
    assert promoted.lora.r == 16 and promoted.lora.merge and promoted.lr == 0.001


@pytest.mark.parametrize("lora_base", [True, False])
def test_the_benchmarked_trials_are_served_on_one_engine_when_they_are_adapters(tmp_path, monkeypatch, lora_base):
    """A LoRA stage's benchmarked trials: one engine of the checkpoint they were trained from, each trial's adapter
    a model id on it; other trials: each trial's export its own engine. Every trial is scored by its model id."""
    import amalia_ray.evals.evaluate as runner
    from amalia_ray.pipeline import stages, sweep
    from amalia_ray.serve import app as serve_app

    pipeline = Pipeline(load_recipe(write_recipe(tmp_path)))
    started, scored = [], []
    monkeypatch.setattr(serve_app, "start", lambda models, cfg, gpu, name, adapters=None, keep_going=False:
                        started.append((models, adapters)) or serve_app.Served("http://127.0.0.1:1/v1"))
    monkeypatch.setattr(serve_app, "stop", lambda name: None)
    monkeypatch.setattr(stages, "use_gpu", lambda p: False)
    monkeypatch.setattr(runner, "run_task", lambda task, path, *, model, **kw: scored.append(model) or {
        "scores": {"acc": 0.5, "acc_norm": 0.5}, "n": 20})
    out = tmp_path / "sweep"
    summary = {"mode": "min", "trials": [{"trial_id": t, "status": "completed", "metric": m}
                                         for t, m in (("a", 2.0), ("b", 1.0), ("c", 3.0))]}
    task = pipeline.recipe.eval.tasks[0]
    sweep._benchmark(pipeline, summary, task, 2, out, tmp_path / "start" if lora_base else None)
    (models, adapters), = started
    if lora_base:
        assert models == {"base": tmp_path / "start"}
        assert adapters == {"base": {f"trial-{t}": out / "trials" / t / "adapter" for t in "ba"}}
        assert scored == ["base:trial-b", "base:trial-a"]
    else:
        assert models == {f"trial-{t}": out / "trials" / t / "hf" for t in "ba"} and not adapters
        assert scored == ["trial-b", "trial-a"]
    best = summary["trials"][1]["benchmark"]
    assert best["model"] == scored[0] and best["one_engine"] is lora_base and "benchmark" not in summary["trials"][2]


def test_a_trial_that_finished_reports_its_last_step_once_more(tmp_path, monkeypatch):
    """A trial restored after its last report reached Tune, but before Tune saved it, trains no step and Ray Train
    reports nothing: the trial reports its last step's record again, so Tune holds the finished result and the
    trial is not taken as stopped early. A trial that stopped before its last step reports nothing more."""
    from ray import tune
    from ray.tune.integration import ray_train

    from amalia_ray.pipeline.sweep import _trial
    from amalia_ray.train import train_stage

    stage = proxy_stage(load_recipe(write_recipe(tmp_path, **{"train.0.proxy": {"steps": 6, "validate_every": 3}}))
                        .recipe.train[0])
    reported = []
    monkeypatch.setattr(tune, "report", reported.append)
    monkeypatch.setattr(tune, "get_context", lambda: type("Context", (), {"get_trial_id": lambda self: "t1"})())
    monkeypatch.setattr(ray_train, "TuneReportCallback", lambda: None)  # what Ray Train's reports went through
    for last in (6, 3):
        def trained(stage, model, *, stage_dir, **kwargs):
            stage_dir.mkdir(parents=True, exist_ok=True)
            (stage_dir / "metrics.jsonl").write_text("".join(
                json.dumps({"step": s, "loss": 1.0 / s, "val_loss": 2.0 / s}) + "\n" for s in range(1, last + 1)))

        monkeypatch.setattr(train_stage, "run_train_stage", trained)
        _trial({"lr": 0.01}, base=stage.model_dump(mode="json"), model={}, data_dir=str(tmp_path), tokenizer_dir="",
               init_hf_dir=None, trials_dir=str(tmp_path / "trials"), seed=0, use_gpu=False, hf_config={},
               space={"parameters": {"lr": {"values": [0.01]}}}, weights={})
    assert reported == [{"step": 6, "loss": 1.0 / 6, "val_loss": 2.0 / 6}]
