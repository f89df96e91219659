import pytest
import yaml

from amalia_ray.core.config import Recipe
from amalia_ray.core.errors import RecipeError
from amalia_ray.core.recipe import config_hash, load_recipe, parse_recipe
from tests.conftest import DEMO_RECIPE, write_recipe


def demo_text() -> str:
    return DEMO_RECIPE.read_text()


def test_demo_recipe_validates():
    loaded = load_recipe(DEMO_RECIPE)
    assert isinstance(loaded.recipe, Recipe)
    assert loaded.recipe.train[0].objective == "pretrain"
    assert loaded.resolve("../evals/tasks/pt_mc_sample.jsonl").is_file()


def test_unknown_field_names_yaml_path_line_and_allowed_fields():
    text = demo_text().replace("  hidden_size: 256", "  hiden_size: 256")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "hiden_size" in ln)
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, "demo.yaml")
    msg = str(e.value)
    assert f"demo.yaml:{line}: model.hiden_size: unknown field 'hiden_size'" in msg
    assert "allowed: from, revision, trust_remote_code, config_file, architecture, hidden_size" in msg


def test_bad_choice_lists_allowed_values():
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text().replace("schedule: cosine", "schedule: cosin"), "r.yaml")
    assert "train[0].schedule" in str(e.value) and "'cosine', 'wsd' or 'constant'" in str(e.value)


def test_unknown_field_in_list_item_is_located():
    text = demo_text().replace("      split: paragraph\n", "      splitt: paragraph\n", 1)
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, "r.yaml")
    assert "data.sources[0].splitt: unknown field" in str(e.value)
    assert "allowed: name, paths, format, text_field, id_field, split" in str(e.value)


def test_cross_field_rules():
    parse_recipe(demo_text().replace("global_batch_size: 8", "global_batch_size: 6"))  # any batch, any workers
    with pytest.raises(RecipeError, match="seq_len 1024 exceeds"):
        parse_recipe(demo_text().replace("seq_len: 256", "seq_len: 1024"))
    recipe = yaml.safe_load(demo_text())
    recipe["eval"]["tasks"].append(dict(recipe["eval"]["tasks"][0]))  # results are keyed by task name
    with pytest.raises(RecipeError, match=f"each name once; given more than once: {recipe['eval']['tasks'][0]['name']}"):
        parse_recipe(yaml.safe_dump(recipe))


def test_yaml_syntax_error_has_line():
    with pytest.raises(RecipeError, match=r"r.yaml:\d+: not valid YAML"):
        parse_recipe("run:\n  name: [unclosed\n", "r.yaml")


def test_grpo_batch_counts_whole_groups():
    with pytest.raises(RecipeError, match="multiple of num_generations 3"):
        parse_recipe(_post_training(objective="grpo", num_generations=3))


def test_dpo_stage_needs_preference_data():
    with pytest.raises(RecipeError, match=r"<recipe>:\d+: train\[0\]\.dataset: required field is missing"):
        parse_recipe(demo_text().replace("objective: pretrain\n", "objective: dpo\n"))


def _post_training(**fields) -> str:
    """The demo recipe with one post-training stage of these fields after its pretraining stage."""
    data = yaml.safe_load(demo_text())
    data["train"] = [data["train"][0], {"name": "post", "steps": 20, "dataset": "x.jsonl", **fields}]
    return yaml.safe_dump(data, sort_keys=False)


@pytest.mark.parametrize("fields, message", [
    ({"objective": "sft", "beta": 0.2}, r"train\[1\]\.beta: unknown field 'beta' of a sft stage \(allowed: .*seq_len"),
    ({"objective": "sft", "kl_coef": 0.1}, r"train\[1\]\.kl_coef: unknown field 'kl_coef' of a sft stage"),
    ({"objective": "dpo", "kl_coef": 0.1}, r"unknown field 'kl_coef' of a dpo stage"),
    ({"objective": "grpo", "beta": 0.1}, r"unknown field 'beta' of a grpo stage"),
    ({"objective": "sft", "curriculum": {"hook": "a.b:c"}}, r"unknown field 'curriculum' of a sft stage"),
    ({"objective": "dpo", "num_generations": 8}, r"num_generations apply to on-policy dpo only"),
    ({"objective": "ppo"}, r"train\[1\]: Input tag 'ppo' found using 'objective' does not match any of the "
                           r"expected tags: 'pretrain', 'sft', 'dpo', 'grpo'"),
])
def test_a_field_of_another_objective_is_an_error_naming_the_line(fields, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(_post_training(**fields))


def test_beta_on_pretraining_is_an_error():
    with pytest.raises(RecipeError, match=r"train\[0\]\.beta: unknown field 'beta' of a pretrain stage"):
        parse_recipe(demo_text().replace("objective: pretrain\n", "objective: pretrain\n    beta: 0.1\n"))


def test_each_objective_has_its_own_default_learning_rate():
    lrs = {}
    for objective in ("sft", "dpo", "grpo"):
        stage = parse_recipe(_post_training(objective=objective)).train[1]
        lrs[objective] = stage.lr
    assert lrs == {"sft": 2e-5, "dpo": 1e-6, "grpo": 1e-6}
    data = yaml.safe_load(demo_text())
    del data["train"][0]["lr"]
    assert parse_recipe(yaml.safe_dump(data)).train[0].lr == 3e-4
    assert parse_recipe(_post_training(objective="dpo", on_policy=True, num_generations=8)).train[1].num_generations == 8


@pytest.mark.reliability
def test_rewards_and_curriculum_hooks_are_checked_when_the_recipe_loads():
    with pytest.raises(RecipeError, match=r"<recipe>:\d+: train\[1\]\.rewards\[1\]: unknown reward 'exact'"):
        parse_recipe(_post_training(objective="grpo", rewards=["format", "exact"]))
    trusting = "run:\n  trusted_modules: [no_such_module]\n"
    with pytest.raises(RecipeError, match=r"train\[1\]\.rewards\[0\]: reward 'no_such_module:f' cannot be imported"):
        parse_recipe(_post_training(objective="dpo", on_policy=True, rewards=["no_such_module:f"]).replace(
            "run:\n", trusting, 1))
    # a recipe runs the code it names: only from this package's modules and those run.trusted_modules lists
    for spec in ("builtins:exec", "os:system", "no_such_module_2:f"):
        with pytest.raises(RecipeError, match=rf"train\[1\]\.rewards\[0\]: '{spec}' names code in module "
                                              r"'.*', which run.trusted_modules does not list"):
            parse_recipe(_post_training(objective="grpo", rewards=[spec]))
    parse_recipe(_post_training(objective="grpo", rewards=["amalia_ray.core.rewards:has_number_reward"]))
    with pytest.raises(RecipeError, match=r"train\[1\]\.rewards\[1\]\.name: unknown reward 'exact'"):
        parse_recipe(_post_training(objective="grpo", rewards=[
            "format", {"name": "exact", "weight": 0.5}, {"judge": {"base_url": "http://j/v1", "model": "j"}}]))
    data = yaml.safe_load(demo_text())
    data["train"][0]["curriculum"] = {"hook": "amalia_ray.core.formats.shards:no_such_schedule"}
    with pytest.raises(RecipeError, match=r"train\[0\]\.curriculum\.hook: curriculum hook "
                                          r"'amalia_ray.core.formats.shards:no_such_schedule' cannot be imported"):
        parse_recipe(yaml.safe_dump(data, sort_keys=False))


@pytest.mark.reliability
def test_config_hash_tracks_content():
    a = parse_recipe(demo_text())
    b = parse_recipe(demo_text().replace("steps: 200", "steps: 201"))
    assert config_hash(a.data) == config_hash(b.data)
    assert config_hash(a.train[0]) != config_hash(b.train[0])
    # how a stage runs is not what it trains: an interrupted stage given more retries or workers resumes
    stage = a.train[0]
    for field, value in [("max_failures", 3), ("num_workers", 4), ("log_every", 7), ("checkpoints_to_keep", 5),
                         ("placement", "SPREAD"), ("checkpoint_async", False), ("proxy", {"steps": 3})]:
        assert config_hash(stage.model_copy(update={field: value})) == config_hash(stage), field
    assert config_hash(stage.model_copy(update={"lr": stage.lr * 2})) != config_hash(stage)


def test_the_recipe_reference_is_what_the_models_say():
    from amalia_ray.recipe_reference import render
    from tests.conftest import ROOT

    assert (ROOT / "docs" / "recipe.md").read_text() == render(), "docs/recipe.md is stale: run `make docs`"


def test_the_readme_recipe_validates():
    import re

    from tests.conftest import ROOT

    text = (ROOT / "README.md").read_text()
    block = re.search(r"## A recipe in 20 lines\n\n```yaml\n(.*?)```", text, re.S).group(1)
    assert len(block.splitlines()) <= 20
    recipe = parse_recipe(block, "README.md")
    assert [s.objective for s in recipe.train] == ["pretrain", "sft", "dpo"]


@pytest.mark.reliability
def test_code_a_recipe_names_is_fingerprinted_with_its_stage(tmp_path, monkeypatch):
    """A fix to the curriculum hook (or a reward) a lab's own package provides changes what the stage trains: the
    source of its whole top-level package is hashed into the stage's config (pipeline/stages.py), so the stage
    trains again rather than being skipped or resumed on other code."""
    from amalia_ray.core.recipe import named_code
    from amalia_ray.pipeline.manifest import named_code_hash

    package = tmp_path / "lab_sched"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mix.py").write_text("from lab_sched.shared import W\n\n\ndef weights(tokens, sources):\n"
                                    "    return {s: W for s in sources}\n")
    (package / "shared.py").write_text("W = 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = load_recipe(write_recipe(tmp_path, **{"run.trusted_modules": ["lab_sched"], "train.0.curriculum": {
        "hook": "lab_sched.mix:weights"}})).recipe.train[0]
    assert named_code(stage) == ["lab_sched.mix:weights"]
    before = named_code_hash("lab_sched.mix:weights")
    assert named_code_hash("lab_sched.mix:weights") == before
    (package / "shared.py").write_text("W = 2.0\n")  # a module beside the hook's, which it imports
    assert named_code_hash("lab_sched.mix:weights") != before
