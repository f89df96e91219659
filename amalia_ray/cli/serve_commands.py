"""`amalia serve`, `amalia eval`, `amalia export-lm-eval`: serving checkpoints and scoring them over HTTP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from amalia_ray.cli.common import app, console, guarded

@app.command()
@guarded
def serve(
    checkpoints: Annotated[list[Path] | None, typer.Argument(help="HF checkpoint folders to serve side by side "
                                                           "(on a cluster: paths every node can read)")] = None,
    name: Annotated[list[str] | None, typer.Option("--name", help="model id per checkpoint (default: folder)")] = None,
    lora: Annotated[list[str] | None, typer.Option(
        "--lora", help="NAME=FOLDER: a PEFT LoRA adapter served on the first checkpoint's engine as the model id "
        "'MODEL:NAME' (MODEL:NAME=FOLDER for another checkpoint's); repeatable, all on one engine")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    min_replicas: int = 1,
    max_replicas: int = 1,
    target_ongoing_requests: int = 16,
    gpus_per_replica: Annotated[int, typer.Option(help="GPUs per replica, the model split over them (tensor "
                                                  "parallel; 0: one GPU where the cluster has GPUs)")] = 0,
    pipeline_parallel_size: Annotated[int, typer.Option(help="pipeline stages per replica (GPUs)")] = 1,
    max_model_len: Annotated[int, typer.Option(help="longest prompt + completion in tokens")] = 512,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        help="the share of a GPU's memory each replica's engine may take (default 0.9 on GPU, 0.1 of RAM on "
        "CPU)")] = None,
    device: Annotated[str, typer.Option(help="auto (GPU when the cluster has one; for --config-out: GPU when "
                                        "--gpus-per-replica is set), cpu or cuda")] = "auto",
    api_key_env: Annotated[str, typer.Option(help="env var holding the API key: when set, requests need "
                                             "'Authorization: Bearer <key>'")] = "AMALIA_API_KEY",
    config_out: Annotated[Path | None, typer.Option("--config-out", help="write a Serve config YAML for "
                                                    "`serve deploy` and exit")] = None,
    stop: Annotated[bool, typer.Option("--stop", help="stop the deployment serving on --port (on a cluster: "
                                       "delete the application --app)")] = False,
    app_name: Annotated[str, typer.Option("--app", help="the Serve application's name: on a shared cluster each "
                                          "deployment has its own, and --stop deletes only it")] = "amalia-serve",
    allow_no_auth: Annotated[bool, typer.Option("--allow-no-auth", help="serve on an address off loopback with no "
                                                "API key: anyone who reaches the port may use the models")] = False,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="serve the models that answer and name the ones "
                                             "that cannot be served (without it, one such model stops the start: "
                                             "exit 1)")] = False,
) -> None:
    """Serve checkpoints over the OpenAI API with Ray Serve + vLLM. On the embedded local Ray it runs until
    interrupted or `amalia serve --stop`; with --address / RAY_ADDRESS it deploys to the cluster and returns."""
    import signal
    import time

    import yaml
    from rich.markup import escape

    from amalia_ray.cluster.local import ray_session, resolve_use_gpu
    from amalia_ray.core.config import ServeConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.serve import app as serve_app

    on_cluster = bool(os.environ.get("RAY_ADDRESS"))
    if stop:
        if on_cluster:
            with ray_session():
                serve_app.stop(app_name)
            console.print(f"[green]deleted[/] Serve application '{app_name}' on {os.environ['RAY_ADDRESS']}")
        else:
            console.print(f"[green]stopped[/] {serve_app.stop_local(host, port)}")
        return
    if not checkpoints:
        raise AmaliaError("name at least one checkpoint folder to serve (or --stop)")
    names = name or [c.resolve().name if c.name != "hf" else c.resolve().parent.name for c in checkpoints]
    if len(names) != len(checkpoints):
        raise AmaliaError(f"{len(names)} --name values for {len(checkpoints)} checkpoints")
    if device not in ("auto", "cpu", "cuda"):
        raise AmaliaError(f"--device {device}: one of auto, cpu, cuda")
    cfg = ServeConfig(host=host, port=port, min_replicas=min_replicas, max_replicas=max_replicas,
                      target_ongoing_requests=target_ongoing_requests, api_key_env=api_key_env,
                      gpus_per_replica=gpus_per_replica, pipeline_parallel_size=pipeline_parallel_size,
                      allow_no_auth=allow_no_auth,
                      engine={"max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization})
    if not on_cluster or config_out:  # on a cluster, the running Serve's own address is checked as it is joined
        serve_app.check_auth(cfg)
    models = dict(zip(names, checkpoints))
    adapters = _adapters(lora or [], names)
    if config_out:
        use_gpu = device == "cuda" or (device == "auto" and gpus_per_replica > 0)
        config_out.write_text(yaml.safe_dump(serve_app.serve_config(models, cfg, use_gpu, app_name, adapters),
                                             sort_keys=False))
        console.print(f"wrote {config_out} ({'GPU' if use_gpu else 'CPU'} replicas): `serve deploy {config_out}` "
                      "on a cluster with this package installed")
        return
    serve_app.require_vllm()
    if not on_cluster:  # on a cluster, a Serve that already runs there is joined on its own port
        serve_app.check_port_free(host, port)
    if not serve_app.api_key(cfg):
        console.print(f"[yellow]no API key[/]: {api_key_env} is not set, so the endpoint is open to anyone who can "
                      f"reach {host}:{port}")
    with ray_session():
        started = serve_app.start(models, cfg, resolve_use_gpu(device),
                                  app_name, adapters, keep_going=keep_going)
        url = started.base_url
        served = [m for m in [*names, *(serve_app.adapter_id(m, a) for m, named in adapters.items() for a in named)]
                  if m not in started.failed]
        if not served:
            serve_app.stop(app_name)
            raise serve_app.ServeFailed(started.failed)
        for model_id, why in started.failed.items():
            console.print(f"[red]cannot serve[/] {escape(f'{model_id}: {why}')}")
        if on_cluster:
            console.print(f"[green]deployed[/] {', '.join(served)} at {url} as Serve application '{app_name}' "
                          f"(stop: amalia serve --stop --app {app_name})")
            return
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        with serve_app.local_state(host, port, url, served):
            console.print(f"[green]serving[/] {', '.join(served)} at {url} (Ctrl-C or `amalia serve --stop --port "
                          f"{port}` to stop)")
            try:
                while True:
                    time.sleep(3600)
            except _StopServing:
                console.print("stop requested (SIGTERM): shutting down")
            finally:
                serve_app.stop(app_name)


def _adapters(specs: list[str], names: list[str]) -> dict[str, dict[str, Path]]:
    """--lora values (NAME=FOLDER, or MODEL:NAME=FOLDER) by the served model whose engine runs them."""
    from amalia_ray.core.errors import AmaliaError

    adapters: dict[str, dict[str, Path]] = {}
    for spec in specs:
        key, sep, folder = spec.partition("=")
        model, _, adapter = key.rpartition(":")
        model = model or names[0]
        if not sep or not adapter or not folder:
            raise AmaliaError(f"--lora {spec}: expected NAME=FOLDER (or MODEL:NAME=FOLDER)")
        if model not in names:
            raise AmaliaError(f"--lora {spec}: '{model}' is not a served model ({', '.join(names)})")
        if adapter in adapters.get(model, {}):
            raise AmaliaError(f"--lora {spec}: '{model}' already has an adapter named '{adapter}'")
        adapters.setdefault(model, {})[adapter] = Path(folder)
    return adapters


def _task_config(task: Path, format: str, method: str | None, name: str | None = None, **fields):
    """An EvalTaskConfig from command-line options; a bad option is reported by its flag."""
    from pydantic import ValidationError

    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.evals.tasks import task_of_file

    try:
        return task_of_file(task, name, format, method=method, **fields)
    except ValidationError as e:
        raise AmaliaError(_options_error(e)) from None


def _options_error(e) -> str:
    return "; ".join(f"--{str(err['loc'][-1]).replace('_', '-') if err['loc'] else 'options'}: {err['msg']}"
                     for err in e.errors())


class _StopServing(Exception):
    pass


def _stop_on_sigterm(*_) -> None:
    raise _StopServing


@app.command("eval")
@guarded
def eval_(
    task: Annotated[Path, typer.Option("--task", help="task file (JSON lines or a JSON array) or a folder of them; "
                                       "or a `datasets` folder or Parquet / Arrow file (its test split)")],
    base_url: Annotated[str | None, typer.Option(
        "--base-url", help="OpenAI API base URL, e.g. http://127.0.0.1:8000/v1")] = None,
    model: Annotated[str | None, typer.Option("--model", help="served model id")] = None,
    format: Annotated[str | None, typer.Option(
        "--format", help="mcq|pheb|binary|cloze|judge|variety|answer|euroeval (default: told by the first item's "
        "fields)")] = None,
    output: Annotated[Path | None, typer.Option("--output", help="result JSON")] = None,
    method: Annotated[str | None, typer.Option(help="choice tasks: loglik (default) or generate")] = None,
    chat: Annotated[bool, typer.Option(help="instruction-tuned models: generate through /v1/chat/completions; "
                                       "loglik over the model's chat template")] = False,
    system_prompt: Annotated[str | None, typer.Option(help="with --chat: the system turn before each prompt")] = None,
    max_tokens: int = 32,
    limit: int | None = None,
    n: Annotated[int, typer.Option("--n", help="answer tasks: samples per item (pass@1, pass@n, maj@n)")] = 1,
    temperature: Annotated[float, typer.Option(help="sampling temperature of the generations (0: greedy)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling of the generations")] = 1.0,
    seed: Annotated[int, typer.Option(help="sampling seed: item i's request carries seed + i")] = 0,
    num_fewshot: Annotated[int, typer.Option(help="loglik choice tasks: answered examples before each item")] = 0,
    fewshot_path: Annotated[Path | None, typer.Option(help="the examples' source (default: the dataset's train "
                                                      "split, else the task's other items)")] = None,
    fewshot_seed: Annotated[int, typer.Option(help="the examples' seed (lm-eval's default)")] = 1234,
    fewshot_as_multiturn: Annotated[bool | None, typer.Option(
        "--fewshot-as-multiturn/--fewshot-in-one-turn", help="with --chat: each example as a user and an assistant "
        "turn (the default, as lm-eval's), or all in one user turn")] = None,
    concurrency: int = 8,
    prompts_per_request: Annotated[int, typer.Option(help="loglik: prompts per request (items kept whole)")] = 24,
    retries: int = 3,
    timeout: float = 120,
    api_key_env: Annotated[str, typer.Option(help="env var holding the server's API key")] = "AMALIA_API_KEY",
    judge_model: Annotated[str | None, typer.Option(help="judge tasks: the served model that grades")] = None,
    judge_base_url: Annotated[str | None, typer.Option(help="judge's base URL (default: --base-url)")] = None,
    variety_model: Annotated[Path | None, typer.Option(help="variety tasks: a variety classifier (`amalia data "
                                                       "train-variety`), or `builtin` (the one shipped); without "
                                                       "one, the cue scorer")] = None,
    variety_margin: Annotated[float | None, typer.Option(help="variety tasks: how far from 0.5 a label needs "
                                                         "(default: the model's own; 0.15 for the cue "
                                                         "scorer)")] = None,
    contamination_of: Annotated[list[Path] | None, typer.Option(
        "--contamination-of", help="a run folder (its curated corpus) or a jsonl/Parquet corpus the model trained on "
        "(repeatable): each item is flagged when it shares a 13-gram with it, and the unseen items are scored "
        "apart")] = None,
    show_prompt: Annotated[bool, typer.Option(
        "--show-prompt", help="print the exact text sent for the first item (--limit N: the first N) and exit; "
        "needs no server")] = False,
) -> None:
    """Score a served model on one task over HTTP and write the result JSON (scores, n, per-item predictions)."""
    from pydantic import ValidationError

    from amalia_ray.core.config import EvalConfig, JudgeConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.evals.evaluate import run_task
    from amalia_ray.evals.tasks import detect_format

    format = format or detect_format(task)
    fewshot = {"num_fewshot": num_fewshot, "fewshot_seed": fewshot_seed,
               "fewshot_path": str(fewshot_path) if fewshot_path else None, "system_prompt": system_prompt,
               "fewshot_as_multiturn": fewshot_as_multiturn}
    if show_prompt:
        from amalia_ray.evals.fewshot import task_items
        from amalia_ray.evals.evaluate import requests_of

        shown = _task_config(task, format, method, chat=chat, max_tokens=max_tokens, limit=limit or 1, n=n,
                             temperature=temperature, top_p=top_p, seed=seed, **fewshot)
        items = task_items(shown, task)
        console.print_json(json.dumps({"task": shown.name, "format": shown.format, "method": shown.scoring,
                                       "items": [requests_of(shown, it) for it in items]}, ensure_ascii=False))
        return
    if not base_url or not model:
        raise AmaliaError("amalia eval needs --base-url and --model (the served model to score), "
                          "or --show-prompt to print what would be sent")
    if format == "judge" and not judge_model:
        raise AmaliaError("--format judge needs --judge-model (the served model that grades the answers)")
    try:
        task_cfg = _task_config(task, format, method, chat=chat, max_tokens=max_tokens, limit=limit, n=n,
                                temperature=temperature, top_p=top_p, seed=seed, **fewshot)
        judge = JudgeConfig(model=judge_model, base_url=judge_base_url) if judge_model else None
        settings = EvalConfig(tasks=[task_cfg], concurrency=concurrency, prompts_per_request=prompts_per_request,
                              retries=retries, request_timeout_s=timeout, judge=judge,
                              variety={"model": str(variety_model) if variety_model else None,
                                       "margin": variety_margin})
    except ValidationError as e:
        raise AmaliaError(_options_error(e)) from None
    result = run_task(task_cfg, task, base_url=base_url, model=model, settings=settings, output=output,
                      api_key=os.environ.get(api_key_env) or None, contamination_of=contamination_of or None)
    clean = {"n_seen": result["n_seen"], "n_clean": result["n_clean"], "scores_clean": result["scores_clean"]} \
        if contamination_of else {}
    console.print_json(json.dumps({"task": result["task"], "format": result["format"], "method": result["method"],
                                   "model": model, "n": result["n"], **result["scores"],
                                   **({"rejected": result["rejected"]} if result["rejected"] else {}), **clean}))


@app.command("export-lm-eval")
@guarded
def export_lm_eval(
    task: Annotated[Path, typer.Argument(help="task file (JSON lines or a JSON array) or a folder of them; or a "
                                         "`datasets` folder or Parquet / Arrow file (its test split)")],
    output: Annotated[Path, typer.Option("--output", help="folder for the task YAML and its items")],
    format: Annotated[str | None, typer.Option(
        "--format", help="mcq|pheb|binary|euroeval|cloze (default: told by the first item's fields)")] = None,
    method: Annotated[str | None, typer.Option(help="choice tasks: loglik (default) or generate")] = None,
    name: Annotated[str | None, typer.Option(help="lm-eval task name (default: the file's stem)")] = None,
    num_fewshot: Annotated[int, typer.Option(help="loglik choice tasks: the YAML's num_fewshot, with the examples' "
                                             "pool as its fewshot split")] = 0,
    fewshot_path: Annotated[Path | None, typer.Option(help="the examples' source (default: the dataset's train "
                                                      "split, else the task's other items)")] = None,
) -> None:
    """Write one of our tasks as an lm-eval task YAML: `lm_eval --include_path OUTPUT --tasks NAME`."""
    from amalia_ray.evals.lmeval_export import export_lm_eval as export
    from amalia_ray.evals.tasks import detect_format

    cfg = _task_config(task, format or detect_format(task), method, name=name, num_fewshot=num_fewshot,
                       fewshot_path=str(fewshot_path) if fewshot_path else None)
    console.print(f"wrote {export(cfg, task, output)}")
