import pytest

from amalia_ray.core.config import Recipe
from amalia_ray.core.errors import RecipeError
from amalia_ray.core.recipe import config_hash, load_recipe, parse_recipe
from tests.conftest import DEMO_RECIPE


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
    with pytest.raises(RecipeError, match="multiple of micro_batch_size"):
        parse_recipe(demo_text().replace("global_batch_size: 8", "global_batch_size: 6"))
    with pytest.raises(RecipeError, match="seq_len 1024 exceeds"):
        parse_recipe(demo_text().replace("seq_len: 256", "seq_len: 1024"))


def test_yaml_syntax_error_has_line():
    with pytest.raises(RecipeError, match=r"r.yaml:\d+: not valid YAML"):
        parse_recipe("run:\n  name: [unclosed\n", "r.yaml")


def test_grpo_batch_counts_whole_groups():
    text = demo_text().replace("objective: pretrain", "objective: grpo\n    dataset: tasks.jsonl\n    num_generations: 3")
    with pytest.raises(RecipeError, match="multiple of num_generations 3"):
        parse_recipe(text)


def test_dpo_stage_needs_preference_data():
    with pytest.raises(RecipeError, match="objective dpo needs a dataset"):
        parse_recipe(demo_text().replace("objective: pretrain", "objective: dpo"))


def test_config_hash_tracks_content():
    a = parse_recipe(demo_text())
    b = parse_recipe(demo_text().replace("steps: 200", "steps: 201"))
    assert config_hash(a.data) == config_hash(b.data)
    assert config_hash(a.train[0]) != config_hash(b.train[0])
