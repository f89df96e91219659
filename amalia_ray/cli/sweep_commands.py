"""Ablation commands: `amalia sweep` (Ray Tune over a training stage, on its proxy) and `amalia promote`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from amalia_ray.cli.common import DEFAULT_RECIPE, RecipeArg, RunNameOpt, app, console, guarded, pipeline_of


@app.command()
@guarded
def sweep(
    recipe: RecipeArg = DEFAULT_RECIPE,
    stage: Annotated[str, typer.Option(help="the training stage to sweep")] = "pretrain",
    space: Annotated[Path, typer.Option(help="search space YAML (parameters, search, metric, scheduler)")] = Path(
        "recipes/sweeps/pretrain-lr.yaml"),
    run_name: RunNameOpt = None,
) -> None:
    """Sweep a training stage's hyperparameters with Ray Tune on the stage's proxy (recipe: train[].proxy); ASHA
    stops weak trials at validation. Rerun the same command to resume an interrupted sweep."""
    from amalia_ray.pipeline.sweep_space import load_space
    from amalia_ray.pipeline.sweep import run_sweep

    out = run_sweep(pipeline_of(recipe, run_name), stage, load_space(space))
    console.print(f"[bold green]sweep done[/]: {out / 'report.md'} — `amalia promote {out}` to carry the winner "
                  "to the full recipe")


@app.command()
@guarded
def promote(
    sweep_dir: Annotated[Path, typer.Argument(help="a finished sweep: runs/<run>/sweeps/<stage>-<id>")],
    out: Annotated[Path | None, typer.Option(help="where to write the new recipe (default: next to the "
                                             "sweep's recipe, <name>.<stage>-promoted.yaml)")] = None,
) -> None:
    """Write a new recipe with the sweep's winning values in the swept stage, recording the sweep as provenance."""
    from amalia_ray.pipeline.sweep import promote as promote_sweep

    console.print(f"[green]wrote[/] {promote_sweep(sweep_dir, out)}")
