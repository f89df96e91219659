"""`amalia sweep`: a Ray Tune sweep over one training stage's hyperparameters. Each trial is a real run of our
training loop on Ray Train, on the stage's proxy (the recipe's `train[].proxy`: a smaller model, fewer steps),
reporting its validation metric to Tune at every validation so ASHA can stop the weak trials early.

The sweep lives in `runs/<run>/sweeps/<stage>-<id>/` (id: a hash of the space, the proxy and the stage): Tune's
experiment (`tune/`, restored if a driver died mid-sweep, from its state as signed in `tune-state/`), each trial's
metrics and TensorBoard events (`trials/<trial id>/`), `sweep.json` (every trial, the winner, the proxy) and
`report.md` with a plot of the metric against each swept value. `amalia promote SWEEP_DIR` carries the winner to the full recipe."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

from amalia_ray.core.config import ModelConfig, TrainStageConfig, train_stage
from amalia_ray.core.console import stage_line
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.formats.step_metrics import read_step_records
from amalia_ray.core.storage import hash_path, write_json
from amalia_ray.pipeline.sweep_space import MIX, SweepSpace, adapters_servable, with_values
from amalia_ray.pipeline.spec import RunContext


def proxy_stage(stage: TrainStageConfig) -> TrainStageConfig:
    """The stage as a trial runs it: the proxy's steps and workers, validating (and reporting) every
    `validate_every` steps, no retries (a failed trial is a result)."""
    proxy = stage.proxy
    steps = proxy.steps or stage.steps
    return train_stage({
        **stage.model_dump(), "steps": steps, "num_workers": proxy.num_workers or stage.worker_range[0],
        "checkpoint_every": proxy.validate_every, "log_every": proxy.validate_every, "checkpoints_to_keep": 1,
        "warmup_steps": round(stage.warmup_steps * steps / stage.steps), "max_failures": 0,
    })


def sweep_id(stage: TrainStageConfig, space: SweepSpace, context: dict | None = None) -> str:
    """The sweep's folder name: the stage and the space, and the `context` its trials train in (the model, the
    seed, the sources' weights, the fingerprints of the stages whose outputs they read). A sweep run again with all
    of these unchanged resumes its Tune experiment; any change makes a new sweep, not a restore of trials of an
    older model or data."""
    blob = json.dumps([stage.model_dump(mode="json"), space.model_dump(mode="json"), context or {}], sort_keys=True,
                      default=str)
    return f"{stage.name}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def trial_stage_of(base: dict, config: dict, mix: dict[str, float] | None) -> TrainStageConfig:
    """The stage a trial trains: the proxy with the trial's values; swept source weights become a one-phase mix."""
    fields = with_values(base, config)
    if mix is not None:
        fields["curriculum"] = {"phases": [{"until_tokens": None, "weights": mix}]}
    return train_stage(fields)


def _trial(config: dict, *, base: dict, model: dict, data_dir: str, tokenizer_dir: str, init_hf_dir: str | None,
           trials_dir: str, seed: int, use_gpu: bool, hf_config: dict, space: dict, weights: dict) -> None:
    """One Tune trial: the training loop on Ray Train with this trial's values; Train's reports reach Tune."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from amalia_ray.train.train_stage import run_train_stage

    trial_id = tune.get_context().get_trial_id()
    stage = trial_stage_of(base, config, SweepSpace.model_validate(space).mix_weights(config, weights))
    out = Path(trials_dir) / trial_id
    run_train_stage(stage, ModelConfig.model_validate(model), data_dir=Path(data_dir),
                    tokenizer_dir=Path(tokenizer_dir), init_hf_dir=Path(init_hf_dir) if init_hf_dir else None,
                    stage_dir=out, ray_run_name=f"trial-{trial_id}", seed=seed, use_gpu=use_gpu,
                    hf_config=hf_config, callbacks=[TuneReportCallback()], progress=False)
    # the last step's record once more: a trial whose sweep driver died after that report reached Tune but before
    # Tune saved it is restored, trains no step and reports nothing, and would keep an earlier step's result (a
    # finished trial taken as stopped early); otherwise Tune gets the same last result twice
    records = read_step_records(out / "metrics.jsonl")
    if records and records[-1]["step"] >= stage.steps:
        tune.report(records[-1])


def run_sweep(p: RunContext, stage_name: str, space: SweepSpace) -> Path:
    from amalia_ray.pipeline import stages

    r = p.recipe
    names = [s.name for s in r.train]
    if stage_name not in names:
        raise AmaliaError(f"unknown train stage '{stage_name}'; train stages of this recipe: {', '.join(names)}")
    index = names.index(stage_name)
    stage = r.train[index]
    if any(w.model is not None for w in stage.sampled_rewards):
        raise AmaliaError(f"train stage '{stage_name}' is scored by a reward model: sweeping such a stage is not "
                          "available (its trials would each need the reward model served); sweep it with rule or "
                          "judge rewards")
    if stage.objective == "reward" and space.benchmark:
        raise AmaliaError(f"train stage '{stage_name}' is a reward model, which does not generate: a benchmark "
                          "cannot score its trials; sweep it on val_loss or accuracy without benchmark")
    sources = [s.name for s in r.data.sources]
    space.check_against(stage, sources, r.starts_from_checkpoint(index))
    trial_stage = proxy_stage(stage)
    for name, param in space.parameters.items():  # the proxy's fixed values may clash with a swept one
        for value in param.edges() if not name.startswith(MIX) else []:
            try:
                train_stage(with_values(trial_stage.model_dump(), {name: value}))
            except ValueError as e:
                raise AmaliaError(f"parameters.{name}: value {value!r} does not fit the proxy of train stage "
                                  f"'{stage_name}': {e}") from None
    before = r.previous_policy(index) if stage.init_from == "previous" else None
    previous = names[before] if before is not None else None
    if previous and stage.proxy.model:
        raise AmaliaError(f"train stage '{stage_name}' starts from '{previous}''s checkpoint, which a proxy with "
                          "another model shape (proxy.model) cannot load: sweep it with proxy.model empty")
    model = ModelConfig.model_validate({**r.model.model_dump(), **stage.proxy.model}) if stage.proxy.model else r.model
    from amalia_ray.train.objectives.registry import objective_of

    reported = objective_of(stage.objective).reported(stage, sources)
    if space.metric not in reported:
        raise AmaliaError(f"metric '{space.metric}' is not reported by a {stage.objective} stage; it reports "
                          f"{', '.join(sorted(reported))}")
    benchmark = stages.referenced_task(p, space.benchmark.task, "benchmark.task") if space.benchmark else None

    p.run(until=previous or "pack")  # what the trials read: packed data, tokenizer, the starting checkpoint
    read = [name for name in ("pack", "tokenizer", previous) if name and name in p.manifest.stages]
    out = p.run_dir / "sweeps" / sweep_id(trial_stage, space, {
        "model": model.model_dump(mode="json", by_alias=True), "seed": r.run.seed,
        "dataset": hash_path(p.loaded.resolve(stage.data_path)) if stage.data_path else None,
        "weights": {s.name: s.weight for s in r.data.sources},
        "inputs": {name: p.manifest.stages[name].fingerprint for name in read}})
    out.mkdir(parents=True, exist_ok=True)
    from amalia_ray.train.train_stage import hf_config_dict

    with stages.cluster(p):
        trainable = functools.partial(
            _trial, base=stages.with_variety_model(p, trial_stage).model_dump(mode="json"),
            model=model.model_dump(mode="json", by_alias=True, exclude_unset=True),
            data_dir=str(p.loaded.resolve(stage.data_path) if stage.data_path else p.stage_dir("pack")),
            tokenizer_dir=str(p.stage_dir("tokenizer")),
            init_hf_dir=str(init) if (init := stages.starting_checkpoint(p, index)) else None,
            trials_dir=str(out / "trials"), seed=r.run.seed,
            hf_config=hf_config_dict(model, p.stage_dir("tokenizer"), stages.base_model_dir(p)),
            use_gpu=stages.use_gpu(p),
            space=space.model_dump(mode="json"), weights={s.name: s.weight for s in r.data.sources})
        results = _fit(trainable, space, trial_stage, out, p.cluster_info["billable_cpus"])
        summary = _summarize(results, space, stage, trial_stage, p, out)
        if space.benchmark:
            on = init if adapters_servable(stage, r.starts_from_checkpoint(index)) else None
            _benchmark(p, summary, benchmark, space.benchmark.top, out, on)
    write_json(out / "sweep.json", summary)
    from amalia_ray.pipeline.report import write_report, write_sweep_report

    write_sweep_report(out, summary)
    write_report(p.run_dir, p.manifest, {s.name: s.objective for s in p.recipe.train})
    best = summary["best"]
    stage_line("sweep", f"[green]done[/]: {len(summary['trials'])} trials, best {space.metric} "
               f"{best['metric']:.4g} with {best['config']} — {out}")
    return out


def _fit(trainable, space: SweepSpace, stage: TrainStageConfig, out: Path, cpus: float):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from amalia_ray.pipeline.sweep_state import (SIGNED_DIR, TUNER_FILE, SignTuneState, restore_signed_state,
                                                  sign_state)

    experiment = out / "tune"
    per_trial = stage.worker_range[1] * stage.cpus_per_worker
    concurrent = space.max_concurrent_trials or max(1, int(cpus // per_trial))
    # the trial function only drives Ray Train (its workers hold the CPUs): a sliver of a CPU (Tune refuses none)
    trainable = tune.with_resources(trainable, {"CPU": 0.1})
    if tune.Tuner.can_restore(str(experiment)) and restore_signed_state(experiment):
        stage_line("sweep", f"[yellow]resuming[/] the interrupted sweep in {experiment}")
        # a trial that failed is a result (trials do not retry): it is not run again
        tuner = tune.Tuner.restore(str(experiment), trainable=trainable, resume_unfinished=True,
                                   resume_errored=False, param_space=space.tune_space())
    else:
        # a sweep whose driver stopped before Tune first saved: nothing of it to restore
        shutil.rmtree(experiment, ignore_errors=True)
        scheduler = ASHAScheduler(
            time_attr="step", max_t=stage.steps, grace_period=space.scheduler.grace_period * stage.checkpoint_every,
            reduction_factor=space.scheduler.reduction_factor) if space.scheduler.type == "asha" else FIFOScheduler()
        tuner = tune.Tuner(
            trainable, param_space=space.tune_space(),
            tune_config=tune.TuneConfig(metric=space.metric, mode=space.mode, num_samples=space.samples,
                                        scheduler=scheduler,
                                        # Tune ignores max_concurrent_trials next to a generator: the generator
                                        # bounds it itself
                                        search_alg=BasicVariantGenerator(max_concurrent=concurrent,
                                                                         random_state=space.seed)),
            run_config=tune.RunConfig(name="tune", storage_path=str(out), verbose=0, callbacks=[SignTuneState()]),
        )
        sign_state([experiment / TUNER_FILE], out / SIGNED_DIR)
    return tuner.fit()


def _summarize(results, space: SweepSpace, stage, trial_stage, p: RunContext, out: Path) -> dict:
    sign = 1 if space.mode == "min" else -1
    trials = []
    for result in results:
        history = result.metrics_dataframe
        values = [] if history is None or space.metric not in history else [
            v for v in history[space.metric].tolist() if v == v]
        steps = int(result.metrics.get("step", 0)) if result.metrics else 0
        trials.append({
            "trial_id": result.metrics.get("trial_id") if result.metrics else Path(result.path).name,
            "config": {k: result.config[k] for k in space.parameters},
            "metric": values[-1] if values else None,
            "best_metric": (min(values, key=lambda v: sign * v)) if values else None,
            "steps": steps,
            "val_loss_by_source": {k.split("/", 1)[1]: v for k, v in (result.metrics or {}).items()
                                   if k.startswith("val_loss/")},
            "status": "failed" if result.error else ("completed" if steps >= trial_stage.steps else "stopped early"),
            "error": str(result.error)[:500] if result.error else None,
        })
    scored = [t for t in trials if t["metric"] is not None and t["status"] == "completed"] or [
        t for t in trials if t["metric"] is not None]
    if not scored:
        raise AmaliaError(f"no trial of the sweep reported {space.metric}; see {out / 'tune'}")
    best = min(scored, key=lambda t: sign * t["metric"])
    return {
        "sweep_id": out.name, "recipe": str(p.loaded.path), "run": p.run_name, "stage": stage.name,
        "metric": space.metric, "mode": space.mode, "space": space.model_dump(mode="json"),
        "proxy": {"model": stage.proxy.model, "steps": trial_stage.steps,
                  "validate_every": trial_stage.checkpoint_every, "num_workers": trial_stage.num_workers},
        "best": best, "trials": trials,
    }


def _benchmark(p: RunContext, summary: dict, task, top: int, out: Path, lora_base: Path | None) -> None:
    """Serve the best finished trials side by side and score each on the task over HTTP: LoRA trials as adapters
    on one engine of the checkpoint they were trained from (`lora_base`), others by their exports."""
    from amalia_ray.evals.evaluate import metrics_of, run_task
    from amalia_ray.pipeline import stages
    from amalia_ray.serve import app as serve_app

    sign = 1 if summary["mode"] == "min" else -1
    finished = sorted((t for t in summary["trials"] if t["status"] == "completed" and t["metric"] is not None),
                      key=lambda t: sign * t["metric"])[:top]
    trials = {f"trial-{t['trial_id']}": out / "trials" / t["trial_id"] for t in finished}
    if not trials:
        return
    if lora_base:
        models, adapters = {"base": lora_base}, {"base": {n: d / "adapter" for n, d in trials.items()}}
        ids = [serve_app.adapter_id("base", n) for n in trials]
    else:
        models, adapters, ids = {n: d / "hf" for n, d in trials.items()}, None, list(trials)
    r = p.recipe
    name = serve_app.app_name(f"{p.run_name}-sweep-{out.name}")
    try:
        served = serve_app.start(models, r.serve, stages.use_gpu(p), name, adapters, keep_going=True)
        for t, model_id in zip(finished, ids):
            if why := served.failed.get(model_id):  # that trial cannot be served; the others are scored
                t["benchmark"] = {"task": task.name, "failed": why, "model": model_id}
                continue
            res = run_task(*stages.eval_task(p, task), base_url=served.base_url, model=model_id,
                           settings=stages.with_variety_model(p, r.eval),
                           output=out / "benchmark" / f"{model_id}.json", api_key=serve_app.api_key(r.serve))
            metric = metrics_of(task)[0]
            t["benchmark"] = {"task": task.name, "metric": metric, "value": res["scores"][metric], "n": res["n"],
                              "model": model_id, "one_engine": bool(lora_base)}
    finally:
        serve_app.stop(name)


def promote(sweep_dir: Path, out: Path | None = None) -> Path:
    """Write a new recipe: the sweep's recipe with the winning values in the swept stage (at full scale: only the
    swept fields change, never the proxy's size) and the sweep recorded under `provenance`."""
    import yaml

    from amalia_ray.core.recipe import load_recipe

    info_path = sweep_dir / "sweep.json"
    if not info_path.is_file():
        raise AmaliaError(f"not a finished sweep: {info_path} not found (run `amalia sweep` to the end first)")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    source = Path(info["recipe"])
    if not source.is_file():
        raise AmaliaError(f"the sweep's recipe is gone: {source}")
    data = yaml.safe_load(source.read_text(encoding="utf-8"))
    entry = next((s for s in data.get("train", []) if s.get("name") == info["stage"]), None)
    if entry is None:
        raise AmaliaError(f"{source} has no train stage '{info['stage']}' any more")
    best = info["best"]
    entry.update(with_values(entry, best["config"]))
    if mix := {k[len(MIX):]: v for k, v in best["config"].items() if k.startswith(MIX)}:
        weights = {s["name"]: s.get("weight", 1.0) for s in data.get("data", {}).get("sources", [])}
        entry["curriculum"] = {"phases": [{"until_tokens": None, "weights": {**weights, **mix}}]}
    data.setdefault("provenance", []).append({
        "sweep_id": info["sweep_id"], "sweep_dir": str(sweep_dir.resolve()), "stage": info["stage"],
        "values": best["config"], "metric": {info["metric"]: best["metric"], "mode": info["mode"]},
        "trial_id": best["trial_id"], "trials": len(info["trials"]), "proxy": info["proxy"],
        "from_recipe": str(source),
    })
    out = out or source.with_name(f"{source.stem}.{info['stage']}-promoted.yaml")
    out.write_text(f"# promoted from sweep {info['sweep_id']} by `amalia promote` (see provenance at the end)\n"
                   + yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    load_recipe(out)  # the promoted recipe must validate as any other
    return out
