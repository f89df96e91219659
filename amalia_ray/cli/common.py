"""What every command shares: the typer app, its global options, the recipe arguments, and `guarded`, which turns a
failure into one clear line (`--debug` shows the traceback)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from amalia_ray.core.console import console, err_console  # noqa: F401 - console: what the commands print with

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Build a language model end to end on Ray: curate, pretrain, post-train, serve, evaluate.")
STATE = {"debug": False, "verbose": False}
DEFAULT_RECIPE = Path("recipes/demo.yaml")

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML (default: recipes/demo.yaml)")]
RunNameOpt = Annotated[str | None, typer.Option("--run-name", help="override run.name: the folder under runs/")]
ForceOpt = Annotated[bool, typer.Option("--force", help="rerun stages even when unchanged")]
ReuseStaleOpt = Annotated[bool, typer.Option("--reuse-stale", help="keep the results of stages completed by an "
                                             "older version of the code (same config and inputs) instead of "
                                             "rerunning them; the report says which")]
AddressOpt = Annotated[str | None, typer.Option("--address", help="Ray job server, e.g. http://HEAD:8265 "
                                              "(else RAY_ADDRESS)")]


def guarded(fn):
    """Turn our errors (and any other failure) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from amalia_ray.core.errors import AmaliaError
        from amalia_ray.core.stop import EXIT_STOPPED, StageStopped

        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except StageStopped as e:
            _fail(e, code=EXIT_STOPPED, label="stopped")
        except AmaliaError as e:
            _fail(e, code=1)
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence for a CLI
            _fail(e, code=1, unexpected=True)

    return wrapper


def _fail(e: Exception, code: int, unexpected: bool = False, label: str = "error") -> None:
    if STATE["debug"]:
        raise e
    from amalia_ray.core.secrets import mask

    message = mask(" ".join(str(e).split())) or type(e).__name__
    if unexpected:
        message = f"{type(e).__name__}: {message} (rerun with --debug for the traceback)"
    err_console.print(f"{label}: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


@app.callback()
def main_options(
    debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="show Ray's, vLLM's and the workers' own logs on the "
                                          "terminal (otherwise they go to runs/<name>/logs/)")] = False,
    address: Annotated[str | None, typer.Option("--address", help="Ray cluster address (else RAY_ADDRESS, else an "
                                                "embedded local Ray)")] = None,
) -> None:
    STATE["debug"], STATE["verbose"] = debug, verbose
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per HTTP request
    from amalia_ray.core.secrets import install_log_masking, remember

    remember(os.environ.get("AMALIA_API_KEY"))
    install_log_masking()
    if address:
        os.environ["RAY_ADDRESS"] = address


def pipeline_of(recipe: Path, run_name: str | None, force: bool = False, reuse_stale: bool = False):
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline

    return Pipeline(load_recipe(recipe), run_name=run_name, force=force, reuse_stale=reuse_stale)


def run_quietly(pipeline, **selection) -> Path:
    """Run the pipeline with one line per stage and a progress bar per long step on the terminal; what Ray, vLLM and
    the workers print goes to runs/<name>/logs/driver.log (on the terminal too with --verbose)."""
    from amalia_ray.core.console import quiet_output, stage_line, warnings_in

    if STATE["verbose"]:
        return pipeline.run(**selection)
    pipeline.preflight(**selection)  # a bad input fails before the run folder (and its log) exists
    log_dir = pipeline.run_dir / "logs"
    with quiet_output(log_dir) as log:
        start = log.stat().st_size
        try:
            return pipeline.run(**selection)
        finally:
            count = warnings_in(log, start)
            stage_line("logs", f"{log}" + (f" ({count} warning or error lines from Ray, vLLM and the workers)"
                                           if count else ""))
