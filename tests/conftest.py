"""Shared fixtures. The end-to-end tests share one private Ray cluster per test session."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEMO_RECIPE = ROOT / "recipes" / "demo.yaml"

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(tmp_path: Path, **overrides) -> Path:
    """The demo recipe (its pretraining stage) with dotted-path overrides (e.g. `train.0.steps=20`), written with
    absolute paths to the eval tasks."""
    data = yaml.safe_load(DEMO_RECIPE.read_text())
    for task in data["eval"]["tasks"]:
        task["path"] = str((DEMO_RECIPE.parent / task["path"]).resolve())
    data["run"]["output_dir"] = str(tmp_path / "runs")
    data["train"] = data["train"][:1]  # pretraining; tests add the post-training stages they need, with their data
    for dotted, value in overrides.items():
        node = data
        keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def common_fields(stage: dict) -> dict:
    """A stage's fields that every objective has (to start another kind of stage from the pretraining one)."""
    from amalia_ray.core.config import TrainStageConfig

    return {k: v for k, v in stage.items() if k in TrainStageConfig.model_fields}


@pytest.fixture
def keys_only_shuffles(monkeypatch):
    """The data stage runs without Ray Data's sort and groupby, which shuffle every block's rows to every reducer
    (B² objects at a terabyte's 7,500 blocks): keys move in exchanges sized by bytes (never a document's text),
    counts are summed per block. Yields the list of columns each exchange moved."""
    import ray.data

    from amalia_ray.data.web import boilerplate
    from amalia_ray.data.dedup import components, ray_executor as dedup
    from amalia_ray.data.exchange import decide, partitions

    def refuse(name):
        def refused(*args, **kwargs):
            raise AssertionError(f"Dataset.{name} shuffles the whole dataset: the data stage must not call it")
        return refused

    for name in ("sort", "groupby", "random_shuffle", "repartition"):
        monkeypatch.setattr(ray.data.Dataset, name, refuse(name))
    moved: list[list[str]] = []

    def keys_only(ds, key, fn, plan=None):
        for one in ds if isinstance(ds, list) else [ds]:
            moved.append(one.schema().names)
            assert "text" not in moved[-1], f"an exchange by {key} moves the documents' text: {moved[-1]}"
        return partitions.exchange(ds, key, fn, plan)

    for module in (boilerplate, components, decide, dedup):
        monkeypatch.setattr(module, "exchange", keys_only)
    yield moved


@pytest.fixture
def documents_stay_staged(monkeypatch):
    """The data stage never holds the corpus in Ray's object store: between its passes the documents are staged as
    Parquet files on the run's storage (data/exchange/staged.py), and no dataset carrying their text is
    materialized or has all its blocks listed by the driver (either keeps every block in the store at once; a
    stream of blocks written as they come is fine). Yields the calls that held it (none, or the test fails)."""
    import ray.data

    from amalia_ray.data.exchange import partitions
    from amalia_ray.data.exchange.staged import Staged

    held: list[str] = []

    def has_text(ds) -> bool:
        schema = ds.schema(fetch_if_missing=False)
        return schema is not None and "text" in schema.names

    materialize, to_arrow_refs, row_blocks = (ray.data.Dataset.materialize, ray.data.Dataset.to_arrow_refs,
                                              partitions._row_blocks)

    def watched_materialize(self, *args, **kwargs):
        result = materialize(self, *args, **kwargs)
        if type(self._logical_plan.dag).__name__ != "Write" and has_text(result):  # Ray's own write: its stats
            held.append("Dataset.materialize")
        return result

    def watched_to_arrow_refs(self, *args, **kwargs):
        refs = to_arrow_refs(self, *args, **kwargs)
        if has_text(self):
            held.append("Dataset.to_arrow_refs")
        return refs

    def watched_row_blocks(ds):
        listed = row_blocks(ds)
        if not isinstance(ds, Staged) and has_text(ds):
            held.append("the block list of a dataset with text")
        return listed

    monkeypatch.setattr(ray.data.Dataset, "materialize", watched_materialize)
    monkeypatch.setattr(ray.data.Dataset, "to_arrow_refs", watched_to_arrow_refs)
    monkeypatch.setattr(partitions, "_row_blocks", watched_row_blocks)
    yield held
    assert not held, f"the documents' text was held in the object store by {held[0]}"


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=True, log_to_driver=False)
    yield ray
    ray.shutdown()


def read_jsonl(path: Path) -> list[dict]:
    import json

    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


STEPS = 40  # the demo run's pretraining steps


@pytest.fixture(scope="session")
def recipe_path(tmp_path_factory):
    """The demo recipe as the end-to-end tests run it (run `e2e`), shared by test_e2e.py and test_faults.py."""
    tmp = tmp_path_factory.mktemp("e2e")
    return write_recipe(tmp, **{
        "run.name": "e2e", "train.0.steps": STEPS, "train.0.checkpoint_every": 20, "train.0.warmup_steps": 5,
        "train.0.max_failures": 0, "serve.port": free_port(), "eval.contamination_of": ["this_run"],
    })


OTHER_TEAM_REPLY = "another team's application"


@pytest.fixture(scope="session")
def other_team(ray_cluster):
    """Another team's Serve application, up on the session's cluster before any of ours (its proxy on a port of its
    own, its route /other): the shared cluster every end-to-end test that serves runs on. Yields its URL."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class OtherTeam:
        async def __call__(self, request) -> str:
            return OTHER_TEAM_REPLY

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(OtherTeam.bind(), name="other-team", route_prefix="/other")
    yield f"http://127.0.0.1:{port}/other"
    serve.shutdown()


@pytest.fixture(scope="session")
def demo_run(ray_cluster, recipe_path, other_team):
    """The whole demo pipeline, run once per session. Its pretraining curve is also kept beside the run (as
    DEMO_PRETRAIN_METRICS): test_faults.py trains that stage again in the same run folder."""
    import shutil

    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline

    pipeline = Pipeline(load_recipe(recipe_path))
    report = pipeline.run()
    shutil.copy(pipeline.run_dir / "pretrain" / "metrics.jsonl", recipe_path.parent / DEMO_PRETRAIN_METRICS)
    return pipeline, report


DEMO_PRETRAIN_METRICS = "demo-pretrain-metrics.jsonl"
DATA_STAGES = ("data", "tokenizer", "pack")


def carry_over_data_stages(demo_run, run_dir: Path) -> dict:
    """Copies the demo run's data, tokenizer and pack stages (folders and manifest records) into another run folder,
    so a test of training on another kind of cluster starts from them (a recipe with the demo's data settings
    skips them) instead of curating the corpus again. Returns the carried manifest."""
    import json
    import shutil

    demo, _ = demo_run
    for stage in DATA_STAGES:
        shutil.copytree(demo.run_dir / stage, run_dir / stage)
    carried = json.loads((demo.run_dir / "manifest.json").read_text())
    carried.update(run_name=run_dir.name, stages={k: carried["stages"][k] for k in DATA_STAGES})
    (run_dir / "manifest.json").write_text(json.dumps(carried))
    return carried


@pytest.fixture(scope="session")
def post_training(demo_run, recipe_path) -> Path:
    """The demo run continued: pretrain -> LoRA sft (merged) on conversations made from the Debian FAQ -> a reward
    model from sft on arithmetic preference pairs -> on-policy dpo from sft, its candidates ranked by rules and the
    reward model; trained up to sft here (test_e2e.py trains the rest; test_e2e_serving.py serves the sft adapter).
    Returns the recipe."""
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.core.formats.jsonl import write_rows
    from amalia_ray.core.formats.preference_pairs import validate_reward_pair
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.faq_chats import write_faq_conversations
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from amalia_ray.pipeline.runner import Pipeline

    chats = recipe_path.parent / "faq-chat.jsonl"
    assert write_faq_conversations(Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz"), chats) >= 100
    tasks = recipe_path.parent / "dpo-tasks.jsonl"
    write_tasks(arithmetic_tasks(48, seed=1), tasks)
    pairs = recipe_path.parent / "reward-pairs.jsonl"
    write_rows([{"prompt": t["prompt"], "chosen": [{"role": "assistant", "content": f"A resposta é {t['answer']}."}],
                 "rejected": [{"role": "assistant", "content": f"A resposta é {int(float(t['answer'])) + 7}."}]}
                for t in arithmetic_tasks(64, seed=2)], pairs, validate_reward_pair)
    data = yaml.safe_load(recipe_path.read_text())
    sft = {**common_fields(data["train"][0]), "name": "sft", "objective": "sft", "dataset": str(chats),
           "seq_len": 512, "steps": 8, "warmup_steps": 2, "lr": 0.001, "checkpoint_every": 4}
    dpo = {**sft, "name": "dpo", "objective": "dpo", "dataset": str(tasks), "on_policy": True, "num_generations": 4,
           "max_completion_length": 24, "seq_len": 160, "steps": 4, "lr": 0.0005, "beta": 0.1, "checkpoint_every": 4,
           "rewards": ["exact_answer", "has_number", {"model": "rm", "weight": 0.5}], "rollout": {"engines": 2}}
    rm = {**sft, "name": "rm", "objective": "reward", "dataset": str(pairs), "seq_len": 160, "steps": 4,
          "warmup_steps": 0, "lr": 0.0005, "checkpoint_every": 4}
    data["train"] += [{**sft, "lora": {"r": 8, "alpha": 16, "merge": True}}, rm, dpo]
    post_recipe = recipe_path.parent / "post.yaml"
    post_recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    Pipeline(load_recipe(post_recipe)).run(until="sft")
    return post_recipe


S3_SECRET = "s3-secret-e2e-" + os.urandom(8).hex()


@pytest.fixture
def s3_server():
    """A local S3 endpoint (moto's server) with an empty bucket; yields the storage options that reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"endpoint_override": f"http://127.0.0.1:{port}", "scheme": "http", "region": "us-east-1",
               "access_key": "testing", "secret_key": S3_SECRET}
    boto3.client("s3", endpoint_url=options["endpoint_override"], region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key=S3_SECRET).create_bucket(Bucket="amalia")
    yield options
    server.stop()
