"""The pipeline's commands: run it whole or in part, check a recipe, the data tools, a run's status."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from amalia_ray.cli.common import (DEFAULT_RECIPE, AddressOpt, ForceOpt, RecipeArg, ReuseStaleOpt, RunNameOpt, app,
                                   console, guarded, pipeline_of, run_quietly)


@app.command()
@guarded
def run(recipe: RecipeArg = DEFAULT_RECIPE, run_name: RunNameOpt = None, force: ForceOpt = False,
        until: Annotated[str | None, typer.Option(help="last stage to run (default: all)")] = None,
        reuse_stale: ReuseStaleOpt = False) -> None:
    """Run the whole pipeline: data → tokenizer → pack → training stages → serve + eval → report."""
    report = run_quietly(pipeline_of(recipe, run_name, force, reuse_stale), until=until)
    console.print(f"[bold green]done[/]: {report}")


@app.command()
@guarded
def validate(recipe: RecipeArg = DEFAULT_RECIPE) -> None:
    """Check a recipe without running anything."""
    from amalia_ray.core.recipe import load_recipe

    loaded = load_recipe(recipe)
    r = loaded.recipe
    base = ""
    if r.model.base:
        from amalia_ray.pipeline.stages import check_base_model

        config = check_base_model(r, loaded.resolve)
        base = f", base model {r.model.base} ({config.get('model_type')}, {config.get('max_position_embeddings')} positions)"
    console.print(f"[green]valid[/]: {recipe} — run '{r.run.name}', {len(r.data.sources)} source(s), "
                  f"train stages {[s.name for s in r.train]}, {len(r.eval.tasks)} eval task(s){base}")


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
def data_run(recipe: RecipeArg = DEFAULT_RECIPE, run_name: RunNameOpt = None, force: ForceOpt = False,
             reuse_stale: ReuseStaleOpt = False) -> None:
    """Run the data stages of a recipe: curate, train the tokenizer, tokenize and pack."""
    p = pipeline_of(recipe, run_name, force, reuse_stale)
    run_quietly(p, until=p.recipe.data_stages[-1])


@data_app.command("dedup")
@guarded
def data_dedup(
    input: Annotated[Path, typer.Argument(help="jsonl (.gz) or Parquet file/folder with columns id and text")],
    output: Annotated[Path, typer.Argument(help="writes OUTPUT/kept/*.parquet and OUTPUT/clusters.parquet")],
    threshold: Annotated[float, typer.Option(
        help="keep LSH candidate pairs whose Jaccard >= T; 0 = keep every candidate")] = 0.8,
    similarity: Annotated[str, typer.Option(
        help="estimated: Jaccard from the MinHash signatures (only they move); exact: over the shingle sets")
    ] = "estimated",
    num_perm: Annotated[int, typer.Option("--num-perm", help="MinHash permutations")] = 112,
    bands: Annotated[int, typer.Option(help="LSH bands (rows = num_perm / bands)")] = 14,
    ngram: Annotated[int, typer.Option(help="words per shingle")] = 5,
    seed: int = 1,
    executor: Annotated[str, typer.Option(
        help="ray: on a Ray cluster (RAY_ADDRESS, else one started here); in-process: in this process, the input "
        "held in memory; auto: in-process for an input of up to 256 MB when no cluster is given, else ray")
    ] = "auto",
) -> None:
    """Near-duplicate removal with MinHash-LSH: on a Ray cluster (distributed exchanges and connected components), or in
    this process for a small input (--executor)."""
    from amalia_ray.cluster.local import ray_session
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.dedup.minhash import MinHashParams

    if not 0 <= threshold <= 1:
        raise AmaliaError(f"--threshold must be within [0, 1], got {threshold}")
    if similarity not in ("estimated", "exact"):
        raise AmaliaError(f"--similarity must be estimated or exact, got {similarity!r}")
    try:
        params = MinHashParams(ngram=ngram, num_perm=num_perm, bands=bands, seed=seed)
    except ValueError as e:
        raise AmaliaError(str(e)) from None
    if executor not in ("auto", "ray", "in-process"):
        raise AmaliaError(f"--executor must be auto, ray or in-process, got {executor!r}")
    if not input.exists():
        raise AmaliaError(f"dedup input not found: {input}")
    if executor == "auto":
        from amalia_ray.data.dedup.in_process import fits_in_process

        on_cluster = os.environ.get("RAY_ADDRESS") or ("ray" in sys.modules and sys.modules["ray"].is_initialized())
        executor = "ray" if on_cluster or not fits_in_process(input) else "in-process"
    if executor == "in-process":
        from amalia_ray.data.dedup.in_process import dedup_in_process

        stats = dedup_in_process(input, output, params, threshold or None, similarity=similarity)
    else:
        from amalia_ray.data.dedup.ray_executor import dedup

        # nothing is served here: a logical CPU per core, so no more workers start (a second of imports each) than
        # there are cores to run them
        with ray_session(dashboard=False, num_cpus=os.cpu_count() or 1):
            stats = dedup(input, output, params, threshold or None, similarity=similarity)
    console.print_json(json.dumps({**stats, "executor": executor}))


@data_app.command("train-quality")
@guarded
def data_train_quality(
    output: Annotated[Path, typer.Argument(help="the model folder to write (quality_model.json, weights.npz)")],
    positive: Annotated[list[str], typer.Option(help="high-quality documents (repeatable): jsonl, Parquet, WARC, "
                                                "HTML or plain text (split into paragraphs); .gz/.zst read as well")],
    negative: Annotated[list[str], typer.Option(help="raw web documents (repeatable), the same formats")],
    text_field: Annotated[str, typer.Option(help="jsonl/Parquet: the field holding the text")] = "text",
    holdout: Annotated[float, typer.Option(help="share of each side held back to measure precision and recall")
                       ] = 0.1,
    max_docs: Annotated[int, typer.Option(min=1, help="documents per side at most (a fixed hash-chosen subset)")] = 200_000,
    min_chars: Annotated[int, typer.Option(help="shorter documents are left out")] = 200,
    seed: int = 0,
) -> None:
    """Train a quality classifier (DCLM's recipe: curated positives against raw web negatives) that the data stage
    applies with data.quality_model."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.steps.quality_model import train_quality_model

    if not 0 <= holdout < 1:
        raise AmaliaError(f"--holdout must be within [0, 1), got {holdout}")
    meta = train_quality_model(output, positive, negative, text_field=text_field, holdout=holdout,
                               max_docs=max_docs, min_chars=min_chars, seed=seed)
    console.print_json(json.dumps({"model": str(output), **meta["metrics"]}))


@data_app.command("faq-chat")
@guarded
def data_faq_chat(
    source: Annotated[Path, typer.Argument(help="a FAQ as text (.gz ok) with numbered questions, e.g. Debian's")],
    output: Annotated[Path, typer.Argument(help="conversations jsonl for an sft stage's dataset")],
    max_answer_chars: Annotated[int, typer.Option(help="keep an answer's first paragraphs up to this size")] = 1200,
) -> None:
    """Turn a FAQ's numbered questions and their answers into user/assistant conversations (SFT data)."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.posttrain.faq_chats import write_faq_conversations

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
    question's answer (pairs sampled from the model itself: a dpo stage with on_policy: true)."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.core.formats.conversations import validate_conversation
    from amalia_ray.core.formats.jsonl import checked_rows, line_id
    from amalia_ray.core.formats.preference_pairs import write_preferences
    from amalia_ray.data.posttrain.faq_chats import mismatched_answer_pairs

    try:  # a row's own id, if it has one, wins over its line number
        rows = [{"id": line_id(conversations, f, n), **row}
                for f, n, row in checked_rows(conversations, "conversations", validate_conversation)]
    except ValueError as e:
        raise AmaliaError(str(e)) from None
    try:
        n = write_preferences(mismatched_answer_pairs(rows, seed), output)
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
    from amalia_ray.data.posttrain.synthesize import synthesize

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
    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks

    console.print(f"{write_tasks(arithmetic_tasks(n, seed, max_operand), output)} tasks -> {output}")


@app.command()
@guarded
def train(
    recipe: RecipeArg = DEFAULT_RECIPE,
    stage: Annotated[str | None, typer.Option(help="last training stage to run (default: all)")] = None,
    run_name: RunNameOpt = None,
    force: ForceOpt = False,
    reuse_stale: ReuseStaleOpt = False,
) -> None:
    """Run the training stages (and any data stage whose output is missing or stale)."""
    p = pipeline_of(recipe, run_name, force, reuse_stale)
    if not p.recipe.train:
        from amalia_ray.core.errors import AmaliaError

        raise AmaliaError(f"{recipe}: the recipe has no train stages (a curation recipe): use `amalia run`")
    run_quietly(p, until=stage or p.recipe.train[-1].name)


@app.command()
@guarded
def status(
    target: Annotated[str, typer.Argument(help="a run folder (e.g. runs/demo) or a submitted job id")] = "runs/demo",
    address: AddressOpt = None,
) -> None:
    """What each stage of a run did (status, wall time, attempts), or a submitted job's status."""
    from rich.table import Table

    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.pipeline.manifest import Manifest

    run_dir = Path(target)
    if not (run_dir / "manifest.json").exists():
        if address or os.environ.get("RAY_ADDRESS"):
            from amalia_ray.cluster import jobs

            console.print_json(json.dumps(jobs.status(target, address)))
            return
        raise AmaliaError(f"no run at {run_dir} (no manifest.json); for a submitted job's status pass --address")
    m = Manifest.load_or_new(run_dir, run_dir.name)
    table = Table(title=f"run {m.run_name}")
    for col in ("stage", "status", "wall time (s)", "attempts", "finished", "error"):
        table.add_column(col)
    for n, r in m.stages.items():
        table.add_row(n, r.status, f"{r.wall_time_s:.1f}" if r.wall_time_s else "", str(r.attempts),
                      r.finished_at or "", (r.error or "")[:80])
    console.print(table)
