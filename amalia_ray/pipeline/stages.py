"""Wires each recipe section to its stage package: what the stage reads, writes and runs. The only place that knows
all stages; the stage packages never import each other."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.markup import escape

from amalia_ray.cluster.local import cluster_gpus, ray_session, resolve_use_gpu
from amalia_ray.core import hf_model
from amalia_ray.core.config import EvalConfig
from amalia_ray.core.console import stage_line
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import named_code
from amalia_ray.core.stop import stop_file
from amalia_ray.core.variety_model import VarietyModel, label_margin, model_for_workers, variety_model_folder
from amalia_ray.data import curate as data_stage
from amalia_ray.data.steps.quality_model import QualityModel
from amalia_ray.evals.contamination import corpus_root, seen_items
from amalia_ray.evals.fewshot import task_items
from amalia_ray.evals.evaluate import metrics_of, run_task
from amalia_ray.evals.tasks import item_text, load_task, task_of_file
from amalia_ray.pipeline.manifest import named_code_hash
from amalia_ray.pipeline.spec import RunContext, StageSpec
from amalia_ray.serve import app as serve_app
from amalia_ray.serve import reward_server
from amalia_ray.train.model import check_config
from amalia_ray.train.train_stage import run_train_stage


def corpus_listing(p: RunContext) -> list:
    """The corpus's files as listed once per run: by the checks before work starts, reused by the data stage's
    fingerprint and read (an object store's pattern is one LIST per 1,000 objects, not three)."""
    if p.corpus is None:
        p.corpus = data_stage.list_corpus(p.recipe.data, p.loaded.resolve)
    return p.corpus


def preflight(p: RunContext, needs_serving: bool) -> None:
    """Everything that can be checked before any work starts, so a bad path fails in a second, not after training."""
    r = p.recipe
    if p.store:
        p.store.check()
    if r.tracking.wandb and importlib.util.find_spec("wandb") is None:
        raise AmaliaError("tracking.wandb is set but the wandb package is not installed: pip install wandb")
    corpus_listing(p)
    for stage in r.train:
        if stage.data_path and not p.loaded.resolve(stage.data_path).exists():
            raise AmaliaError(f"train stage '{stage.name}': dataset not found: {p.loaded.resolve(stage.data_path)}")
        for ref, folder in reward_models(p, stage).items():
            if ref not in {s.name for s in r.train}:  # a folder: a reward model, read from its config alone
                try:
                    reward_server.check_checkpoint(folder)
                except AmaliaError as e:
                    raise AmaliaError(f"train stage '{stage.name}': rewards model '{ref}' is not a reward stage of "
                                      f"the recipe, and as a folder: {e}") from None
    for i, task in enumerate(r.eval.tasks):
        task, path = eval_task(p, task)
        if not path.exists():
            raise AmaliaError(f"eval.tasks[{i}].path: task file or folder not found: {path}")
        if task.fewshot_path and not Path(task.fewshot_path).exists():
            raise AmaliaError(f"eval.tasks[{i}].fewshot_path: not found: {task.fewshot_path}")
        task_items(task, path)
    for task in decontamination_tasks(p):
        load_task(p.loaded.resolve(task.path), task.format)
    if r.data.quality_model:
        QualityModel(p.loaded.resolve(r.data.quality_model))  # a missing or foreign model fails here, not in a worker
    # a missing or foreign variety model fails here, not in a worker hours in; so does labelling with a model that
    # records no margin where the recipe sets none (a sampled stage's reward is its score: no margin)
    labelling = [(v.model, v.margin) for v in (r.data.variety, r.eval.variety) if v and v.model]
    for model, margin in [*labelling, *((s.variety_model, 0.0) for s in r.train if getattr(s, "variety_model", None))]:
        folder = variety_model_folder(model, p.loaded.resolve)
        VarietyModel(folder)
        label_margin(folder, margin)
    if r.model.base:
        check_base_model(r, p.loaded.resolve)
    judge = r.eval.judge
    engines, adapters = served_models(p, paths=False)
    served = [*engines, *(serve_app.adapter_id(m, a) for m, named in adapters.items() for a in named)]
    if judge and judge.base_url is None and judge.model not in served:
        raise AmaliaError(f"eval.judge.model '{judge.model}' is not one of the run's served checkpoints {served}; "
                          "name one of them, or set eval.judge.base_url to reach another server")
    if any(s.judge_stages for s in r.train):  # judges served from the recipe's stages while one trains
        serve_app.require_vllm()
        serve_app.check_can_serve(r.serve)
    if needs_serving and r.eval.tasks:
        serve_app.require_vllm()
        eval_rec = p.manifest.stages.get("eval")
        if p.force or eval_rec is None or not eval_rec.done:
            serve_app.check_can_serve(r.serve)


def eval_task(p: RunContext, task):
    """An eval task with its paths resolved against the recipe's folder, and its task path."""
    if task.fewshot_path:
        task = task.model_copy(update={"fewshot_path": str(p.loaded.resolve(task.fewshot_path))})
    return task, p.loaded.resolve(task.path)


def check_base_model(recipe, resolve) -> dict:
    """The base model's architecture can be trained and its positions hold every stage's sequences: read from its
    config.json alone (model.config_file, or the one file fetched), before any weights are. Returns that config."""
    m = hf_model.anchored(recipe.model, resolve)
    source = None if m.config_file or not m.trust_remote_code else str(
        hf_model.resolve(m.base, m.revision, hf_model.CONFIG_FILES))
    config = hf_model.recipe_config(m, resolve)
    limit = check_config(config, m.trust_remote_code, source).max_position_embeddings
    lengths = {**({"pack.seq_len": recipe.pack.seq_len} if recipe.pack else {}),
               **{f"train stage '{s.name}' seq_len": s.sequence_length for s in recipe.train if s.sequence_length}}
    if too_long := {k: v for k, v in lengths.items() if v > limit}:
        raise AmaliaError(f"{', '.join(f'{k} {v}' for k, v in too_long.items())} exceed(s) the base model's "
                          f"max_position_embeddings {limit}: shorten them, or extend the context (model.rope_scaling)")
    return config


def base_model_dir(p: RunContext) -> Path | None:
    """The base model's folder, None for a new model: a hub model is fetched into this machine's Hugging Face cache
    the first time, then placed in the run folder (`run_dir/hub`), which every node of the cluster sees."""
    m = hf_model.anchored(p.recipe.model, p.loaded.resolve)
    if not m.base:
        return None
    if p.base_dir is None:
        p.base_dir = hf_model.stage_snapshot(hf_model.resolve(m.base, m.revision), p.run_dir / "hub")
    return p.base_dir


def starting_checkpoint(p: RunContext, index: int) -> Path | None:
    """What train stage `index` starts from: the previous policy stage's export (reward stages branch off), the base
    model before the first, or nothing (random weights: init_from scratch, or the first stage of a new model)."""
    stage = p.recipe.train[index]
    if stage.init_from != "previous":
        return None
    previous = p.recipe.previous_policy(index)
    return p.checkpoint_of(p.recipe.train[previous].name) if previous is not None else base_model_dir(p)


def by_content(inputs: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
    """The inputs whose files are hashed into a stage's fingerprint, and those a hub snapshot names by its commit
    (recorded in the stage's config instead: a 9B base model is 18 GB to read for what its commit already says)."""
    named = {k: commit for k, v in inputs.items() if (commit := hf_model.snapshot_commit(v))}
    return {k: v for k, v in inputs.items() if k not in named}, named


def logical_cpus_needed(r) -> int:
    """Logical CPUs the recipe's widest step holds at once: serving every trained model side by side (a vLLM
    replica holds its actor's CPU and its engine bundle's) plus the ingress and slack, or the widest training stage
    plus its rollout engine, controller and reward models."""
    served = len(r.policy_stages) + (1 if r.model.base else 0)  # a base model is served beside its stages (at most)
    serve = 2 * served * r.serve.cpus_per_replica * r.serve.max_replicas + 4
    train = max((s.worker_range[1] * s.cpus_per_worker + 3
                 + len(s.reward_models_named) + 2 * r.serve.cpus_per_replica * len(s.judge_stages)
                 for s in r.train), default=0)
    return max(serve if r.eval.tasks else 0, train)


@contextmanager
def cluster(p: RunContext):
    with ray_session(p.recipe.resources.address, p.recipe.resources.num_cpus, logical_cpus_needed(p.recipe),
                     logs_link=p.run_dir / "logs" / "ray") as info:
        p.cluster_info = info
        yield info


def use_gpu(p: RunContext) -> bool:
    return resolve_use_gpu(p.recipe.resources.device)


def build(p: RunContext, names: list[str]) -> Iterator[StageSpec]:
    """Yields stage specs lazily: a later stage's inputs (e.g. a checkpoint) exist only once earlier ones ran."""
    r, d = p.recipe, p.stage_dir
    cpus = {"CPU": p.cluster_info["resources"].get("CPU", 0)}
    cluster_cpus = {"CPU": p.cluster_info["billable_cpus"]}  # Ray Data spreads over the whole cluster
    if "data" in names:
        listing = corpus_listing(p)  # listed, not read
        benchmarks = decontamination_tasks(p)
        yield StageSpec("data", [r.data, *([[t.model_dump() for t in benchmarks]] if benchmarks else []),
                                 data_stage.input_fingerprints(listing)],
                        {**{f"benchmark:{t.name}": p.loaded.resolve(t.path) for t in benchmarks},
                         **({"quality_model": p.loaded.resolve(r.data.quality_model)} if r.data.quality_model else {}),
                         **({"variety_model": variety_model_folder(r.data.variety.model, p.loaded.resolve)}
                            if r.data.variety and r.data.variety.model else {})},
                        {"corpus": d("data")},
                        lambda: data_stage.curate(r.data, p.loaded.resolve, d("data"), benchmark_items(p, benchmarks),
                                                  listing),
                        cpus, held=lambda m: cluster_cpus)
    if "tokenizer" in names:
        base = base_model_dir(p)
        # a base model's tokenizer depends on its tokenizer files, not its weights; on the corpus only when tokens
        # are learned from it
        corpus = {"corpus": d("data") / "kept"}
        learned = corpus if isinstance(r.tokenizer.add_tokens, int) else {}
        sources = {**{f"base:{f.name}": f for f in sorted(base.iterdir())
                      if f.is_file() and f.suffix != ".safetensors"}, **learned} if base else corpus
        yield StageSpec("tokenizer", [r.tokenizer], sources, {"tokenizer": d("tokenizer")},
                        lambda: data_stage.build_tokenizer(d("data"), d("tokenizer"), r.tokenizer, base,
                                                           r.model.trust_remote_code), {"CPU": 1},
                        held=lambda m: {"CPU": 1})
    if "pack" in names:
        weights = {s.name: s.weight for s in r.data.sources}
        yield StageSpec("pack", [r.pack, weights, r.run.seed], {"corpus": d("data") / "kept",
                                                                 "tokenizer": d("tokenizer")},
                        {"packed": d("pack")},
                        lambda: data_stage.pack(d("data"), d("tokenizer"), d("pack"), r.pack, weights, r.run.seed),
                        cpus, held=lambda m: cluster_cpus, tokens=lambda m: m.get("tokens_packed"))
    for index, stage in enumerate(r.train):
        if stage.name not in names:
            break
        init = starting_checkpoint(p, index)
        data = {"dataset": p.loaded.resolve(stage.data_path)} if stage.data_path else {"packed": d("pack")}
        inputs, named = by_content({**data, "tokenizer": d("tokenizer"), **({"init_checkpoint": init} if init else {}),
                                    **variety_models(p, stage),
                                    **{f"reward_model:{ref}": path for ref, path in reward_models(p, stage).items()},
                                    **{f"judge:{name}": judge_checkpoint(p, name) for name in stage.judge_stages}})
        gpu = use_gpu(p)
        # a LoRA stage exports its adapter folder, and the merged weights when it merges
        outputs = {**({"adapter": d(stage.name) / "adapter"} if stage.lora else {}),
                   **({} if stage.lora and not stage.lora.merge else {"checkpoint": p.checkpoint_of(stage.name)})}
        # the rewards and curriculum hook it names from the user's own code: a fix to them trains again
        code = {spec: named_code_hash(spec) for spec in named_code(stage)}
        yield StageSpec(
            stage.name, [stage, r.model, r.run.seed, *([named] if named else []), *([code] if code else [])], inputs,
            outputs,
            _train_body(p, stage, init, gpu),
            {"workers": stage.num_workers, "CPU_per_worker": stage.cpus_per_worker, "GPU_per_worker": int(gpu),
             "placement": stage.placement},
            held=_train_held(stage, gpu, p.cluster_info["billable_cpus"], _judges_held(p, stage, gpu)),
            tokens=lambda m: m.get("tokens_trained"),
            metrics_file=d(stage.name) / "metrics.jsonl",
        )
    if "eval" in names and r.eval.tasks:
        models, adapters = served_models(p)
        tasks = {f"task:{t.name}": p.loaded.resolve(t.path) for t in r.eval.tasks}
        tasks |= {f"fewshot:{t.name}": p.loaded.resolve(t.fewshot_path) for t in r.eval.tasks if t.fewshot_path}
        replicas = len(models) * r.serve.replicas_in_use  # adapters add no replica: they run on their base's engine
        serve_held = _serve_held(r.serve, replicas, use_gpu(p), p.cluster_info["billable_cpus"])
        served = {**models, **{serve_app.adapter_id(m, a): path for m, named in adapters.items()
                               for a, path in named.items()}}
        # the training text items are looked up in: another run re-curated, or a corpus changed, scores again
        corpora = {f"contamination:{i}": d("data") / "kept" if t == p.run_dir else corpus_root(t)
                   for i, t in enumerate(contamination_targets(p))}
        inputs, named = by_content({**{f"model:{k}": v for k, v in served.items()}, **tasks, **corpora,
                                    **variety_models(p, r.eval)})
        yield StageSpec("eval", [r.eval, r.serve, *([named] if named else [])], inputs,
                        {"results": d("eval")}, lambda: _serve_and_evaluate(p, models, adapters),
                        {"replicas": r.serve.min_replicas, "CPU_per_replica": r.serve.cpus_per_replica},
                        held=lambda m: serve_held, tokens=lambda m: m.get("tokens_processed"))


def contamination_targets(p: RunContext) -> list[Path]:
    """The run folders and corpora `eval.contamination_of` names (`this_run`: this run's folder)."""
    return [p.run_dir if t == "this_run" else p.loaded.resolve(t) for t in p.recipe.eval.contamination_of]


def served_models(p: RunContext, paths: bool = True) -> tuple[dict[str, Path | None], dict[str, dict[str, Path]]]:
    """What the eval stage serves (Recipe.served_engines), by model id: the checkpoints that get an engine each
    (model id -> folder) and per engine the LoRA stages' adapters that run on it (engine id -> {stage name -> adapter
    folder}). paths=False leaves the base model's folder None (finding it may mean downloading it)."""
    engines = p.recipe.served_engines()

    def folder(name: str) -> Path | None:
        if p.recipe.names_base_model(name):
            return base_model_dir(p) if paths else None
        return p.checkpoint_of(name)
    return ({p.model_id(e): folder(e) for e in engines},
            {p.model_id(e): {a: p.stage_dir(a) / "adapter" for a in named} for e, named in engines.items() if named})


def decontamination_tasks(p: RunContext) -> list:
    """The tasks the data stage decontaminates against (see referenced_task), their paths as the recipe gives them."""
    d = p.recipe.data.decontaminate
    tasks = [referenced_task(p, t, f"data.decontaminate.tasks[{i}]") for i, t in enumerate(d.tasks if d else [])]
    names = [t.name for t in tasks]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise AmaliaError(f"data.decontaminate.tasks: more than one task named {twice} (a task given by its path is "
                          "named after its file): give those as {name, path, format} with names of their own")
    return tasks


def referenced_task(p: RunContext, ref, where: str):
    """The task a recipe field refers to, its path as the recipe gives it (relative to the recipe: a run's
    fingerprint does not change when the project moves). The rule: a string that names one of eval.tasks is that
    task; any other string is a task file or folder, relative to the recipe, its format told by its fields as
    `amalia eval --task` tells it; a mapping {name, path, format, …} is a task of its own."""
    named = {t.name: t for t in p.recipe.eval.tasks}
    task = ref if not isinstance(ref, str) else named.get(ref)
    if task is None:
        path = p.loaded.resolve(ref)
        if not path.exists():
            raise AmaliaError(f"{where}: '{ref}' is neither the name of one of eval.tasks ({', '.join(named) or 'none'}) "
                              f"nor a task file or folder (nothing at {path}); give one of those, or a task "
                              "{name, path, format}")
        try:
            task = task_of_file(path).model_copy(update={"path": ref})
        except AmaliaError as e:
            raise AmaliaError(f"{where}: {e}") from None
    if not p.loaded.resolve(task.path).exists():
        raise AmaliaError(f"{where}.path: task file or folder not found: {p.loaded.resolve(task.path)}")
    return task


def benchmark_items(p: RunContext, tasks: list) -> dict[str, list[tuple[str, str]]]:
    return {t.name: [(item.id, item_text(item)) for item in load_task(p.loaded.resolve(t.path), t.format)]
            for t in tasks}


def _train_held(stage, gpu: bool, billable_cpus: float, judges: dict[str, float] | None = None):
    # each reward model's replica holds a GPU (on GPU clusters) or a CPU while the stage trains, the judges' engines
    # what their replicas hold (`judges`), and rollout engines placed apart from the workers their own GPUs
    # (colocated ones share the workers')
    scorers = len(stage.reward_models_named)
    engines = stage.engine_gpus(gpu)
    judges = judges or {"CPU": 0, "GPU": 0}

    def held(metrics: dict) -> dict[str, float]:
        workers = metrics.get("mean_world_size") or stage.worker_range[1]  # a failed attempt: what it asked for
        return {"CPU": min(workers * stage.cpus_per_worker + (0 if gpu else scorers) + judges["CPU"], billable_cpus),
                "GPU": workers + scorers + engines + judges["GPU"] if gpu else 0}
    return held


def _judges_held(p: RunContext, stage, gpu: bool) -> dict[str, float]:
    """What the engines serving a stage's judges hold while it trains (one application, as the eval stage's)."""
    judged_by = stage.judge_stages
    engines = len(judge_engines(p, judged_by)[0]) if judged_by else 0
    return _serve_held(p.recipe.serve, engines * p.recipe.serve.replicas_in_use, gpu, p.cluster_info["billable_cpus"])


def _serve_held(serve, replicas: int, gpu: bool, billable_cpus: float) -> dict[str, float]:
    # on GPUs a vLLM replica holds its placement group's bundles (a GPU each); on CPU its actor's CPUs and as many
    # for its engine
    if not gpu:
        return {"CPU": min(2 * replicas * serve.cpus_per_replica, billable_cpus), "GPU": 0}
    bundles = serve_app.replica_placement(serve, use_gpu=True)["placement_group_config"]["bundles"]
    return {"CPU": min(replicas * sum(b.get("CPU", 0) for b in bundles), billable_cpus),
            "GPU": replicas * sum(b.get("GPU", 0) for b in bundles)}


def with_variety_model(p: RunContext, section):
    """A config section (a sampled train stage, eval settings) with its variety model's path as the recipe's folder
    names it: the workers and the eval client run elsewhere than the recipe (`builtin` stays as it is)."""
    if isinstance(section, EvalConfig) and section.variety.model:
        return section.model_copy(update={"variety": section.variety.model_copy(update={
            "model": model_for_workers(section.variety.model, p.loaded.resolve)})})
    if getattr(section, "variety_model", None):
        return section.model_copy(update={"variety_model": model_for_workers(section.variety_model,
                                                                             p.loaded.resolve)})
    return section


def variety_models(p: RunContext, section) -> dict[str, Path]:
    """The variety model a section scores with, as a stage input (its content decides whether the stage reruns)."""
    model = section.variety.model if isinstance(section, EvalConfig) else getattr(section, "variety_model", None)
    return {"variety_model": variety_model_folder(model, p.loaded.resolve)} if model else {}


def reward_models(p: RunContext, stage) -> dict[str, Path]:
    """The reward models a sampled stage's rewards name -> their checkpoint folders: an earlier reward stage's
    export, or a folder relative to the recipe."""
    names = {s.name for s in p.recipe.train}
    return {m: p.checkpoint_of(m) if m in names else p.loaded.resolve(m) for m in stage.reward_models_named}


def judge_engines(p: RunContext, names: list[str]) -> tuple[dict[str, Path], dict[str, dict[str, Path]],
                                                            dict[str, str]]:
    """What serving these stages as judges takes, as the eval stage serves them: the engines (model id -> folder),
    the LoRA adapters on them, and each stage's model id there."""
    engines, adapters = served_models(p)
    models: dict[str, Path] = {}
    on: dict[str, dict[str, Path]] = {}
    ids: dict[str, str] = {}
    for name in names:
        engine = p.model_id(p.recipe.engine_serving(name))
        models[engine] = engines[engine]
        if engine == p.model_id(name):
            ids[name] = engine
        else:  # a LoRA stage: its adapter
            on.setdefault(engine, {})[name] = adapters[engine][name]
            ids[name] = serve_app.adapter_id(engine, name)
    return models, on, ids


def judge_checkpoint(p: RunContext, name: str) -> Path:
    """The weights a judge served from stage `name` answers with (what decides whether the judged stage reruns): the
    base model's, a LoRA stage's adapter where it exports no merged weights, else the stage's export."""
    if p.recipe.names_base_model(name):
        return base_model_dir(p)
    stage = next(s for s in p.recipe.train if s.name == name)
    return p.stage_dir(name) / "adapter" if stage.lora and not stage.lora.merge else p.checkpoint_of(name)


@contextmanager
def serving_rewards(p: RunContext, stage, gpu: bool) -> Iterator[tuple[dict[str, str], dict[str, dict]]]:
    """What the stage's rewards need served while it trains, deleted after: its reward models (reward model ->
    Serve application) and the stages its judges are (stage -> {base_url, model, api_key_env}), those on one
    application of vLLM engines on the OpenAI API, as the eval stage serves them."""
    r = p.recipe
    apps: list[str] = []
    reward_apps: dict[str, str] = {}
    judge_servers: dict[str, dict] = {}
    rms, judged_by = reward_models(p, stage), stage.judge_stages
    engines, adapters, ids = judge_engines(p, judged_by) if judged_by else ({}, {}, {})
    if gpu and (rms or engines or stage.engine_gpus(True)):
        judges = _serve_held(r.serve, len(engines) * r.serve.replicas_in_use, True, float("inf"))["GPU"]
        check_gpus_beside_workers(stage, len(rms) + judges, cluster_gpus())
    try:
        if engines:  # first: where it starts Serve, it starts it with the HTTP proxy the judges are reached by
            stage_line(stage.name, f"serving the judge(s) {escape(', '.join(judged_by))}")
            name = serve_app.app_name(f"{p.run_name}-{stage.name}-judges")
            url = serve_app.start(engines, r.serve, gpu, name, adapters).base_url
            apps.append(name)
            key_env = r.serve.api_key_env if serve_app.api_key(r.serve) else None
            judge_servers = {s: {"base_url": url, "model": ids[s], "api_key_env": key_env} for s in judged_by}
        for i, (ref, folder) in enumerate(rms.items()):
            stage_line(stage.name, f"serving reward model {escape(ref)}")
            apps.append(reward_server.start(folder, reward_server.app_name(f"{p.run_name}-{stage.name}", i), gpu,
                                            r.serve.startup_timeout_s))
            reward_apps[ref] = apps[-1]
        yield reward_apps, judge_servers
    finally:
        for app in reversed(apps):  # the first started Serve: stopped last, it shuts Serve down
            serve_app.stop(app)


def check_gpus_beside_workers(stage, served: int, cluster_gpus: int) -> None:
    """On GPUs each reward model's replica and judge's engine holds GPUs of its own (`served` in all) beside the
    stage's workers (and separate rollout engines'): a cluster without that many, up or to be started by its
    autoscaler (`cluster_gpus`), would leave a replica, or the workers after it, waiting forever."""
    engines = stage.engine_gpus(True)
    needed = stage.worker_range[0] + served + engines
    if cluster_gpus < needed:
        raise AmaliaError(f"train stage '{stage.name}': {stage.worker_range[0]} training worker(s)"
                          f"{f', separate rollout engines ({engines} GPUs)' if engines else ''} and the reward "
                          "models and judges it "
                          f"serves ({served} GPU(s)) need {needed} GPUs; the cluster has {cluster_gpus}: add GPUs, or "
                          "lower num_workers")


def _train_body(p: RunContext, stage, init: Path | None, gpu: bool):
    def body() -> dict:
        # same fingerprint -> same Ray Train run name -> Ray resumes from that run's latest checkpoint
        fingerprint = p.manifest.stage(stage.name).fingerprint
        with serving_rewards(p, stage, gpu) as (reward_apps, judge_servers):
            return _train(p, stage, init, gpu, fingerprint, reward_apps, judge_servers)
    return body


def _train(p: RunContext, stage, init: Path | None, gpu: bool, fingerprint: str, reward_apps: dict[str, str],
           judge_servers: dict[str, dict]) -> dict:
    return run_train_stage(
        with_variety_model(p, stage), p.recipe.model,
        data_dir=p.loaded.resolve(stage.data_path) if stage.data_path else p.stage_dir("pack"),
        tokenizer_dir=p.stage_dir("tokenizer"),
        init_hf_dir=init, base_dir=base_model_dir(p), stage_dir=p.stage_dir(stage.name),
        ray_run_name=f"{stage.name}-{fingerprint}",
        seed=p.recipe.run.seed, use_gpu=gpu, stop_file=stop_file(p.run_dir),
        step_transient=_step_transient(p, stage), reward_apps=reward_apps, judge_servers=judge_servers,
        **({"storage_path": p.store.path(f"{stage.name}/ray"), "storage_filesystem": p.store.fs} if p.store else {}),
    )


def _step_transient(p: RunContext, stage):
    """For a GRPO stage, what a step adds above the sharded training state given a sequence's tokens (`amalia
    plan`'s activations, logits, gathered blocks…, as a function the workers call), which its colocated rollout
    engine must leave free; None for other objectives."""
    if stage.objective != "grpo":
        return None
    from amalia_ray.cluster.plan import Dims, StepTransient

    m = hf_model.anchored(p.recipe.model, p.loaded.resolve)
    hf_config = hf_model.recipe_config(m, p.loaded.resolve) if m.base else None  # with the recipe's overrides
    return StepTransient(stage, p.recipe, Dims.of(p.recipe, hf_config))


def _in_stage_order(p: RunContext, model_ids: list[str], adapters: dict[str, str]) -> list[str]:
    """The base model first, then each stage's model (its own or its adapter's id), as the recipe orders them: the
    order of the report's columns."""
    rank = {name: i for i, name in enumerate(["base", *(s.name for s in p.recipe.train)])}

    def stage_of(model_id: str) -> str:
        return model_id.split(":", 1)[1] if model_id in adapters else model_id.removeprefix(f"{p.run_name}-")
    return sorted(model_ids, key=lambda m: rank.get(stage_of(m), len(rank)))


def _serve_and_evaluate(p: RunContext, models: dict[str, Path], adapters: dict[str, dict[str, Path]]) -> dict:
    """Serve every trained checkpoint side by side (LoRA adapters on the engine of the checkpoint they were trained
    from), score each task on each over HTTP, then stop serving."""
    r = p.recipe
    name = serve_app.app_name(p.run_name)
    on = {serve_app.adapter_id(m, a): m for m, named in adapters.items() for a in named}  # adapter id -> engine
    failed_items = 0
    out: dict = {"results": {}, "tokens_processed": 0, **({"base_model": p.model_id("base")} if r.model.base else {}),
                 **({"adapters": on} if on else {})}
    targets = contamination_targets(p)
    eval_settings = with_variety_model(p, r.eval)
    seen = seen_items({t.name: load_task(p.loaded.resolve(t.path), t.format, t.limit) for t in r.eval.tasks},
                      targets) if targets else {}
    try:
        served = serve_app.start(models, r.serve, use_gpu(p), name, adapters, keep_going=True)
        out["base_url"] = base_url = served.base_url
        if served.failed and len(served.failed) == len(models) + len(on):
            raise serve_app.ServeFailed(served.failed)  # nothing to score
        for model_id in _in_stage_order(p, [*models, *on], on):
            if why := served.failed.get(model_id):  # that model's rows say why; the others are scored
                stage_line("eval", f"[red]cannot serve[/] {escape(f'{model_id}: {why}')}")
                out["results"] |= {f"{model_id}/{task.name}": {"failed": why, "metric": metrics_of(task)[0]}
                                   for task in r.eval.tasks}
                # recorded, and the next run evaluates again instead of skipping a stage that scored only some
                out["incomplete"] = f"{len(served.failed)} model(s) could not be served"
                continue
            for task in r.eval.tasks:
                res = run_task(*eval_task(p, task), base_url=base_url, model=model_id,
                               settings=eval_settings, output=p.stage_dir("eval") / model_id / f"{task.name}.json",
                               api_key=serve_app.api_key(r.serve), contamination_of=targets or None,
                               seen=seen.get(task.name))
                clean = {"n_seen": res["n_seen"], **{f"{k}_clean": v for k, v in (res["scores_clean"] or {}).items()
                                                     if not k.endswith("_stderr")}} if targets else {}
                out["results"][f"{model_id}/{task.name}"] = {**res["scores"], "n": res["n"],
                                                             "rejected": res["rejected"],
                                                             "failed_items": res.get("failed", 0),
                                                             "metric": metrics_of(task)[0], **clean}
                failed_items += res.get("failed", 0)  # scored on fewer items than it has (an outage, a bad reply)
                out["tokens_processed"] += sum(res["usage"].values())
        if failed_items:  # recorded, and the next run evaluates again, as for a model that could not be served
            out["incomplete"] = "; ".join([*([out["incomplete"]] if "incomplete" in out else []),
                                           f"{failed_items} item(s) failed (retries spent, or a bad reply)"])
    finally:
        serve_app.stop(name)
    return out
