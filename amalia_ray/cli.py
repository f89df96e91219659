"""`amalia`: the command line. Errors are one clear line; `--debug` shows the traceback."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from amalia_ray.core.console import console, err_console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build a language model end to end on Ray: curate, pretrain, post-train, serve, evaluate.")
STATE = {"debug": False}
DEFAULT_RECIPE = Path("recipes/demo.yaml")

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML (default: recipes/demo.yaml)")]
RunNameOpt = Annotated[str | None, typer.Option("--run-name", help="override run.name: the folder under runs/")]
ForceOpt = Annotated[bool, typer.Option("--force", help="rerun stages even when unchanged")]


def guarded(fn):
    """Turn our errors (and any other failure) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from amalia_ray.core.errors import AmaliaError, NotImplementedYet

        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except NotImplementedYet as e:
            _fail(e, code=3)
        except AmaliaError as e:
            _fail(e, code=1)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence for a CLI
            _fail(e, code=1, unexpected=True)

    return wrapper


def _fail(e: Exception, code: int, unexpected: bool = False) -> None:
    if STATE["debug"]:
        raise e
    message = " ".join(str(e).split()) or type(e).__name__
    if unexpected:
        message = f"{type(e).__name__}: {message} (rerun with --debug for the traceback)"
    err_console.print(f"error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster address (else RAY_ADDRESS, else an "
                                                "embedded local Ray)")] = None,
) -> None:
    STATE["debug"] = debug
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per HTTP request
    if address:
        os.environ["RAY_ADDRESS"] = address


def _pipeline(recipe: Path, run_name: str | None, force: bool = False):
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline

    return Pipeline(load_recipe(recipe), run_name=run_name, force=force)


@app.command()
@guarded
def run(recipe: RecipeArg = DEFAULT_RECIPE, run_name: RunNameOpt = None, force: ForceOpt = False) -> None:
    """Run the whole pipeline: data → tokenizer → pack → training stages → serve + eval → report."""
    report = _pipeline(recipe, run_name, force).run()
    console.print(f"[bold green]done[/]: {report}")


@app.command()
@guarded
def validate(recipe: RecipeArg = DEFAULT_RECIPE) -> None:
    """Check a recipe without running anything."""
    from amalia_ray.core.recipe import load_recipe

    loaded = load_recipe(recipe)
    r = loaded.recipe
    console.print(f"[green]valid[/]: {recipe} — run '{r.run.name}', {len(r.data.sources)} source(s), "
                  f"train stages {[s.name for s in r.train]}, {len(r.eval.tasks)} eval task(s)")


class _DefaultRunGroup(TyperGroup):
    """`amalia data RECIPE` runs the data stages; `amalia data dedup ...` and friends are subcommands."""

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


data_app = typer.Typer(cls=_DefaultRunGroup, help="Data stages: curate, tokenize, pack; dedup a corpus; FAQ -> SFT chats.")
app.add_typer(data_app, name="data")


@data_app.command("run")
@guarded
def data_run(recipe: RecipeArg = DEFAULT_RECIPE, run_name: RunNameOpt = None, force: ForceOpt = False) -> None:
    """Run the data stages of a recipe: curate, train the tokenizer, tokenize and pack."""
    _pipeline(recipe, run_name, force).run(until="pack")


@data_app.command("dedup")
@guarded
def data_dedup(
    input: Annotated[Path, typer.Argument(help="jsonl (.gz) or Parquet file/folder with columns id and text")],
    output: Annotated[Path, typer.Argument(help="writes OUTPUT/kept/*.parquet and OUTPUT/clusters.parquet")],
    threshold: Annotated[float, typer.Option(
        help="keep LSH candidate pairs whose exact shingle-set Jaccard >= T; 0 = keep every candidate")] = 0.8,
    num_perm: Annotated[int, typer.Option("--num-perm", help="MinHash permutations")] = 112,
    bands: Annotated[int, typer.Option(help="LSH bands (rows = num_perm / bands)")] = 14,
    ngram: Annotated[int, typer.Option(help="words per shingle")] = 5,
    seed: int = 1,
) -> None:
    """Near-duplicate removal with MinHash-LSH and distributed connected components."""
    from amalia_ray.cluster.local import ray_session
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.dedup import dedup
    from amalia_ray.data.minhash import MinHashParams

    if not 0 <= threshold <= 1:
        raise AmaliaError(f"--threshold must be within [0, 1], got {threshold}")
    try:
        params = MinHashParams(ngram=ngram, num_perm=num_perm, bands=bands, seed=seed)
    except ValueError as e:
        raise AmaliaError(str(e)) from None
    if not input.exists():
        raise AmaliaError(f"dedup input not found: {input}")
    with ray_session():
        stats = dedup(input, output, params, threshold or None)
    console.print_json(json.dumps(stats))


@data_app.command("faq-chat")
@guarded
def data_faq_chat(
    source: Annotated[Path, typer.Argument(help="a FAQ as text (.gz ok) with numbered questions, e.g. Debian's")],
    output: Annotated[Path, typer.Argument(help="conversations jsonl for an sft stage's dataset")],
    max_answer_chars: Annotated[int, typer.Option(help="keep an answer's first paragraphs up to this size")] = 1200,
) -> None:
    """Turn a FAQ's numbered questions and their answers into user/assistant conversations (SFT data)."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.conversations import write_faq_conversations

    if not source.is_file():
        raise AmaliaError(f"FAQ not found: {source}")
    n = write_faq_conversations(source, output, max_answer_chars)
    if n == 0:
        raise AmaliaError(f"{source}: no numbered question with an answer found")
    console.print(f"{n} conversations -> {output}")


@data_app.command("preference-pairs")
@guarded
def data_preference_pairs(
    conversations: Annotated[Path, typer.Argument(help="conversations jsonl ({messages}), e.g. from faq-chat")],
    output: Annotated[Path, typer.Argument(help="preference pairs jsonl for a dpo stage's dataset")],
    seed: Annotated[int, typer.Option(help="seed of the answer shuffle")] = 0,
) -> None:
    """DPO pairs from question-answer conversations: chosen = the question's own answer, rejected = another
    question's answer (on-policy pairs generated by a served model are the next step of issue #4)."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.conversations import mismatched_answer_pairs, write_jsonl

    rows = []
    for n, line in enumerate(conversations.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append({"id": str(n), **json.loads(line)})
                rows[-1]["messages"][-1]["content"]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                raise AmaliaError(f"{conversations}:{n}: not a JSON object with 'messages' ({e})") from None
    try:
        n = write_jsonl(mismatched_answer_pairs(rows, seed), output)
    except ValueError as e:
        raise AmaliaError(f"{conversations}: {e}") from None
    console.print(f"{n} preference pairs -> {output}")


@data_app.command("synthesize")
@guarded
def data_synthesize(
    seeds: Annotated[Path, typer.Argument(help="seed prompts jsonl ({prompt, answer?, …}), e.g. from arithmetic")],
    output: Annotated[Path, typer.Argument(help="conversations jsonl (an sft stage's dataset)")],
    base_url: Annotated[str, typer.Option(help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")],
    model: Annotated[str, typer.Option(help="served model id")],
    per_seed: Annotated[int, typer.Option(help="samples per seed prompt")] = 4,
    reward: Annotated[str | None, typer.Option(help="keep only samples this reward scores >= --min-reward "
                                               "(rejection sampling), e.g. exact_answer")] = None,
    min_reward: Annotated[float, typer.Option(help="threshold for --reward")] = 1.0,
    temperature: float = 1.0,
    max_tokens: int = 256,
) -> None:
    """Expand seed prompts into many samples with a served model, through Ray Data (R1-style rejection sampling)."""
    from amalia_ray.cluster.local import ray_session
    from amalia_ray.data.synthesize import synthesize

    with ray_session():
        stats = synthesize(seeds, output, base_url=base_url, model=model, per_seed=per_seed, temperature=temperature,
                           max_tokens=max_tokens, reward=reward, min_reward=min_reward,
                           api_key=os.environ.get("AMALIA_API_KEY") or None)
    console.print_json(json.dumps(stats))


@data_app.command("arithmetic")
@guarded
def data_arithmetic(
    output: Annotated[Path, typer.Argument(help="tasks jsonl for a grpo stage's dataset")],
    n: Annotated[int, typer.Option(help="number of tasks")] = 512,
    seed: Annotated[int, typer.Option(help="seed of the draw")] = 0,
    max_operand: Annotated[int, typer.Option(help="largest operand")] = 50,
) -> None:
    """Portuguese arithmetic and word problems with exact answers (GRPO tasks with verifiable rewards)."""
    from amalia_ray.data.conversations import write_jsonl
    from amalia_ray.data.tasks import arithmetic_tasks

    console.print(f"{write_jsonl(arithmetic_tasks(n, seed, max_operand), output)} tasks -> {output}")


@app.command()
@guarded
def train(
    recipe: RecipeArg = DEFAULT_RECIPE,
    stage: Annotated[str | None, typer.Option(help="last training stage to run (default: all)")] = None,
    run_name: RunNameOpt = None,
    force: ForceOpt = False,
) -> None:
    """Run the training stages (and any data stage whose output is missing or stale)."""
    p = _pipeline(recipe, run_name, force)
    p.run(until=stage or p.recipe.train[-1].name)


@app.command()
@guarded
def serve(
    checkpoints: Annotated[list[Path] | None, typer.Argument(help="HF checkpoint folders to serve side by side "
                                                           "(on a cluster: paths every node can read)")] = None,
    name: Annotated[list[str] | None, typer.Option("--name", help="model id per checkpoint (default: folder)")] = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    min_replicas: int = 1,
    max_replicas: int = 1,
    target_ongoing_requests: int = 16,
    api_key_env: Annotated[str, typer.Option(help="env var holding the API key: when set, requests need "
                                             "'Authorization: Bearer <key>'")] = "AMALIA_API_KEY",
    config_out: Annotated[Path | None, typer.Option("--config-out", help="write a Serve config YAML for "
                                                    "`serve deploy` and exit")] = None,
    stop: Annotated[bool, typer.Option("--stop", help="stop the deployment serving on --port (on a cluster: "
                                       "delete the application)")] = False,
) -> None:
    """Serve checkpoints over the OpenAI API with Ray Serve + vLLM. On the embedded local Ray it runs until
    interrupted or `amalia serve --stop`; with --address / RAY_ADDRESS it deploys to the cluster and returns."""
    import signal
    import time

    import yaml

    from amalia_ray.cluster.local import cluster_has_gpu, ray_session
    from amalia_ray.core.config import ServeConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.serve import app as serve_app

    on_cluster = bool(os.environ.get("RAY_ADDRESS"))
    if stop:
        if on_cluster:
            with ray_session():
                serve_app.delete()
            console.print(f"[green]deleted[/] Serve application '{serve_app.APP_NAME}' on {os.environ['RAY_ADDRESS']}")
        else:
            console.print(f"[green]stopped[/] {serve_app.stop_local(host, port)}")
        return
    if not checkpoints:
        raise AmaliaError("name at least one checkpoint folder to serve (or --stop)")
    names = name or [c.resolve().name if c.name != "hf" else c.resolve().parent.name for c in checkpoints]
    if len(names) != len(checkpoints):
        raise AmaliaError(f"{len(names)} --name values for {len(checkpoints)} checkpoints")
    cfg = ServeConfig(host=host, port=port, min_replicas=min_replicas, max_replicas=max_replicas,
                      target_ongoing_requests=target_ongoing_requests, api_key_env=api_key_env)
    models = dict(zip(names, checkpoints))
    if config_out:
        config_out.write_text(yaml.safe_dump(serve_app.serve_config(models, cfg, use_gpu=False), sort_keys=False))
        console.print(f"wrote {config_out}: `serve deploy {config_out}` on a cluster with this package installed "
                      "(set a GPU in placement_group_config.bundles for GPU replicas)")
        return
    serve_app.require_vllm()
    serve_app.check_port_free(host, port)
    if not serve_app.api_key(cfg):
        console.print(f"[yellow]no API key[/]: {api_key_env} is not set, so the endpoint is open to anyone who can "
                      f"reach {host}:{port}")
    with ray_session():
        url = serve_app.start(models, cfg, cluster_has_gpu())
        if on_cluster:
            console.print(f"[green]deployed[/] {', '.join(names)} at {url} (stop: amalia serve --stop)")
            return
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
        with serve_app.local_state(host, port, url, names):
            console.print(f"[green]serving[/] {', '.join(names)} at {url} (Ctrl-C or `amalia serve --stop --port "
                          f"{port}` to stop)")
            try:
                while True:
                    time.sleep(3600)
            except _StopServing:
                console.print("stop requested (SIGTERM): shutting down")
            finally:
                serve_app.stop()


def _task_config(task: Path, format: str, method: str | None, name: str | None = None, **fields):
    """An EvalTaskConfig from command-line options; a bad option is reported by its flag."""
    import re

    from pydantic import ValidationError

    from amalia_ray.core.config import EvalTaskConfig
    from amalia_ray.core.errors import AmaliaError

    try:
        return EvalTaskConfig(name=name or re.sub(r"[^A-Za-z0-9._-]", "-", task.stem).lstrip("-._") or "task",
                              path=str(task), format=format, method=method, **fields)
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
    base_url: Annotated[str, typer.Option("--base-url", help="OpenAI API base URL, e.g. http://127.0.0.1:8000/v1")],
    model: Annotated[str, typer.Option("--model", help="served model id")],
    task: Annotated[Path, typer.Option("--task", help="task file (JSON lines or a JSON array)")],
    format: Annotated[str, typer.Option("--format", help="mcq|pheb|binary|cloze|judge|variety")] = "mcq",
    output: Annotated[Path | None, typer.Option("--output", help="result JSON")] = None,
    method: Annotated[str | None, typer.Option(help="choice tasks: loglik (default) or generate")] = None,
    chat: Annotated[bool, typer.Option(help="generate through /v1/chat/completions")] = False,
    max_tokens: int = 32,
    limit: int | None = None,
    concurrency: int = 8,
    retries: int = 3,
    timeout: float = 120,
    api_key_env: Annotated[str, typer.Option(help="env var holding the server's API key")] = "AMALIA_API_KEY",
    judge_model: Annotated[str | None, typer.Option(help="judge tasks: the served model that grades")] = None,
    judge_base_url: Annotated[str | None, typer.Option(help="judge's base URL (default: --base-url)")] = None,
) -> None:
    """Score a served model on one task over HTTP and write the result JSON (scores, n, per-item predictions)."""
    from pydantic import ValidationError

    from amalia_ray.core.config import EvalConfig, JudgeConfig
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.evals.runner import run_task

    if format == "judge" and not judge_model:
        raise AmaliaError("--format judge needs --judge-model (the served model that grades the answers)")
    try:
        task_cfg = _task_config(task, format, method, chat=chat, max_tokens=max_tokens, limit=limit)
        judge = JudgeConfig(model=judge_model, base_url=judge_base_url) if judge_model else None
        settings = EvalConfig(tasks=[task_cfg], concurrency=concurrency, retries=retries, request_timeout_s=timeout,
                              judge=judge)
    except ValidationError as e:
        raise AmaliaError(_options_error(e)) from None
    result = run_task(task_cfg, task, base_url=base_url, model=model, settings=settings, output=output,
                      api_key=os.environ.get(api_key_env) or None)
    console.print_json(json.dumps({"task": result["task"], "format": result["format"], "method": result["method"],
                                   "model": model, "n": result["n"], **result["scores"]}))


@app.command("export-lm-eval")
@guarded
def export_lm_eval(
    task: Annotated[Path, typer.Argument(help="task file (JSON lines or a JSON array)")],
    output: Annotated[Path, typer.Option("--output", help="folder for the task YAML and its items")],
    format: Annotated[str, typer.Option("--format", help="mcq|pheb|binary|cloze")] = "mcq",
    method: Annotated[str | None, typer.Option(help="choice tasks: loglik (default) or generate")] = None,
    name: Annotated[str | None, typer.Option(help="lm-eval task name (default: the file's stem)")] = None,
) -> None:
    """Write one of our tasks as an lm-eval task YAML: `lm_eval --include_path OUTPUT --tasks NAME`."""
    from amalia_ray.evals.lmeval_export import export_lm_eval as export

    cfg = _task_config(task, format, method, name=name)
    console.print(f"wrote {export(cfg, task, output)}")


@app.command()
@guarded
def status(
    run_dir: Annotated[Path, typer.Argument(help="run folder, e.g. runs/demo")] = Path("runs/demo"),
) -> None:
    """Show what each stage of a run did: status, wall time, attempts."""
    from rich.table import Table

    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.manifest import Manifest

    if not (run_dir / "manifest.json").exists():
        raise AmaliaError(f"no run at {run_dir} (no manifest.json)")
    m = Manifest.load_or_new(run_dir, run_dir.name)
    table = Table(title=f"run {m.run_name}")
    for col in ("stage", "status", "wall time (s)", "attempts", "finished", "error"):
        table.add_column(col)
    for n, r in m.stages.items():
        table.add_row(n, r.status, f"{r.wall_time_s:.1f}" if r.wall_time_s else "", str(r.attempts),
                      r.finished_at or "", (r.error or "")[:80])
    console.print(table)


@app.command()
@guarded
def plan(
    recipe: RecipeArg = DEFAULT_RECIPE,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Estimate per training stage: memory per GPU under FSDP2, step time at the recipe's MFU, GPU-hours, cost and
    energy. Exits 1 naming what to change when a stage cannot fit."""
    import dataclasses

    from rich.table import Table

    from amalia_ray.cluster.plan import parameter_count
    from amalia_ray.cluster.plan import plan as make_plan
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.recipe import load_recipe

    r = load_recipe(recipe).recipe
    plans = make_plan(r)
    if as_json:
        console.print_json(json.dumps([dataclasses.asdict(p) | {"memory_total_gb": p.total_memory_gb}
                                       for p in plans]))
    else:
        params = parameter_count(r.model, r.tokenizer.vocab_size)[0]
        hw = r.plan
        table = Table(title=f"{recipe}: {params / 1e9:.2f} B parameters on {hw.gpu} "
                            f"({hw.peak_tflops:.0f} TFLOP/s peak, MFU {hw.mfu:.0%}, ${hw.usd_per_gpu_hour}/GPU-h, "
                            f"{hw.watts_per_gpu:.0f} W/GPU)")
        for col in ("stage", "GPUs", "seq", "tokens/step", "memory/GPU (GB)", "step (s)", "GPU-hours", "cost ($)",
                    "energy (kWh)", "tokens/J", "implied MFU"):
            table.add_column(col, justify="right")
        for p in plans:
            table.add_row(p.stage, str(p.gpus), str(p.seq_len), f"{p.tokens_per_step:,}",
                          f"{p.total_memory_gb:.1f}" + ("" if p.fits else " ✗"), _figure(p.step_time_s),
                          _figure(p.gpu_hours), _figure(p.cost_usd), _figure(p.energy_kwh),
                          _figure(p.tokens_per_joule), f"{p.implied_mfu:.1%}" if p.implied_mfu else "")
        console.print(table)
        for p in plans:
            console.print(f"{p.stage}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.memory_gb.items()) + " GB")
    if misfits := [p for p in plans if not p.fits]:
        raise AmaliaError("; ".join(f"stage '{p.stage}' cannot fit: {p.advice}" for p in misfits))


def _figure(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _planned(name: str, issue: int, what: str) -> None:
    """A command that is designed but not built yet: it exists, says so, and names the issue."""

    @guarded
    def command(ctx: typer.Context) -> None:
        from amalia_ray.core.errors import NotImplementedYet

        raise NotImplementedYet(f"amalia {name}", issue)

    command.__doc__ = f"{what} (not implemented yet: issue #{issue})"
    app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


_planned("submit", 6, "Submit a recipe as a Ray job to a cluster")
_planned("sweep", 7, "Ray Tune sweep of a stage's hyperparameters on its proxy")
_planned("promote", 7, "Write the winning sweep values into a full-scale recipe")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
