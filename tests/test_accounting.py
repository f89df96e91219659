"""Per-stage accounting: device-hours held, tokens, energy and money, recorded in the manifest and the report."""

import json

import pytest

from amalia_ray.pipeline.accounting import stage_cost, total_cost
from amalia_ray.core.config import AccountingConfig
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.report import write_report
from amalia_ray.pipeline.runner import Pipeline, StageSpec
from tests.conftest import write_recipe


def test_eight_gpus_for_half_an_hour():
    cfg = AccountingConfig(watts={"CPU": 10, "GPU": 700}, usd_per_hour={"CPU": 0.0, "GPU": 2.0}, pue=1.2)
    c = stage_cost({"CPU": 16, "GPU": 8}, 1800, tokens=3_600_000_000, cfg=cfg)
    assert c["device_hours"] == {"CPU": 8.0, "GPU": 4.0}
    assert c["tokens_per_gpu_hour"] == pytest.approx(9e8)
    assert c["tokens_per_device_hour"]["CPU"] == pytest.approx(4.5e8)
    joules = (16 * 10 + 8 * 700) * 1.2 * 1800
    assert c["energy_kwh"] == pytest.approx(joules / 3.6e6)
    assert c["tokens_per_joule"] == pytest.approx(3.6e9 / joules)
    assert c["usd"] == pytest.approx(8.0)


def test_gpus_held_count_sharded_replicas_and_rollout_engines_of_their_own():
    """What a stage is billed for on GPUs: each served replica's GPUs (tensor or pipeline parallel), and a
    training stage's workers, reward-model replicas, judges' engines and rollout engines placed apart from the
    workers (colocated ones share the workers' GPUs); on CPU no GPU at all."""
    from amalia_ray.core.config import ServeConfig, train_stage
    from amalia_ray.pipeline.stages import _serve_held, _train_held

    # a replica's placement group: its actor's CPUs and a GPU, then a CPU and a GPU per further GPU
    assert _serve_held(ServeConfig(gpus_per_replica=4), 3, True, 999) == {"CPU": 12, "GPU": 12}
    assert _serve_held(ServeConfig(), 3, True, 999)["GPU"] == 3 and _serve_held(ServeConfig(), 3, False, 4) == {
        "CPU": 4, "GPU": 0}
    grpo = {"name": "rl", "objective": "grpo", "dataset": "t.jsonl", "steps": 10, "num_workers": 8}
    apart = train_stage({**grpo, "rollout": {"engines": 2, "tensor_parallel": 4, "placement": "separate"}})
    assert _train_held(apart, True, 999)({"mean_world_size": 8})["GPU"] == 8 + 2 * 4
    assert _train_held(train_stage({**grpo, "rollout": {"engines": 2}}), True, 999)({"mean_world_size": 8})[
        "GPU"] == 8
    assert _train_held(apart, False, 999)({"mean_world_size": 8})["GPU"] == 0
    judges = _serve_held(ServeConfig(gpus_per_replica=2, cpus_per_replica=3), 2, True, 999)  # two judge engines
    assert _train_held(apart, True, 999, judges)({"mean_world_size": 8}) == {"CPU": 8 + 8, "GPU": 8 + 8 + 4}


def test_no_tokens_no_rates_and_unpriced_resources_count_hours_only():
    c = stage_cost({"CPU": 2, "TPU": 4, "GPU": 0}, 3600, tokens=None, cfg=AccountingConfig())
    assert c["device_hours"] == {"CPU": 2.0, "TPU": 4.0} and c["held"] == {"CPU": 2, "TPU": 4}
    assert "tokens_per_joule" not in c and c["energy_kwh"] == pytest.approx(0.02)
    total = total_cost([c, stage_cost({"GPU": 1}, 3600, 10, AccountingConfig())])
    assert total["device_hours"] == {"CPU": 2.0, "TPU": 4.0, "GPU": 1.0}
    assert total["energy_kwh"] == pytest.approx(0.72) and total["usd"] == pytest.approx(2.58)


def test_bad_figures_fail_validation_naming_the_field():
    with pytest.raises(ValueError, match="watts: negative"):
        AccountingConfig(watts={"GPU": -5})
    with pytest.raises(ValueError, match="pue"):
        AccountingConfig(pue=0.5)


def test_failed_attempt_cost_is_kept_and_reported(tmp_path):
    recipe = write_recipe(tmp_path, **{"accounting.watts": {"CPU": 100.0}, "accounting.usd_per_hour": {"CPU": 1.0}})
    pipeline = Pipeline(load_recipe(recipe))
    out = pipeline.stage_dir("thing")
    attempts = []

    def body():
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("node lost")
        out.mkdir(parents=True, exist_ok=True)
        (out / "x").write_text("x")
        return {"tokens_done": 1000}

    def spec():
        return StageSpec("thing", [1], {}, {"result": out}, body, {"CPU": 4}, held=lambda m: {"CPU": 4},
                         tokens=lambda m: m.get("tokens_done"))

    with pytest.raises(RuntimeError):
        pipeline.execute(spec())
    failed = json.loads((pipeline.run_dir / "manifest.json").read_text())["stages"]["thing"]["cost"]
    assert failed["held"] == {"CPU": 4} and failed["tokens"] is None
    again = Pipeline(pipeline.loaded)
    again.execute(spec())
    rec = again.manifest.stages["thing"]
    assert rec.cost["tokens"] == 1000 and rec.cost["tokens_per_joule"] > 0
    assert rec.earlier_attempts_cost["device_hours"]["CPU"] == pytest.approx(failed["device_hours"]["CPU"])
    text = write_report(again.run_dir, again.manifest).read_text()
    assert "## Cost" in text and "100 W and $1/h per CPU" in text
    cost_table = text.split("## Cost", 1)[1].splitlines()
    row = next(ln for ln in cost_table if ln.startswith("| thing |"))
    assert "| 1000 |" in row
