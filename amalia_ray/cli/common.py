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
STATE = {"debug": False}
DEFAULT_RECIPE = Path("recipes/demo.yaml")

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML (default: recipes/demo.yaml)")]
RunNameOpt = Annotated[str | None, typer.Option("--run-name", help="override run.name: the folder under runs/")]
ForceOpt = Annotated[bool, typer.Option("--force", help="rerun stages even when unchanged")]
AddressOpt = Annotated[str | None, typer.Option("--address", help="Ray job server, e.g. http://HEAD:8265 "
                                              "(else RAY_ADDRESS)")]


def guarded(fn):
    """Turn our errors (and any other failure) into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from amalia_ray.core.errors import AmaliaError

        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
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
    from amalia_ray.core.secrets import mask

    message = mask(" ".join(str(e).split())) or type(e).__name__
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
    from amalia_ray.core.secrets import install_log_masking, remember

    remember(os.environ.get("AMALIA_API_KEY"))
    install_log_masking()
    if address:
        os.environ["RAY_ADDRESS"] = address


def pipeline_of(recipe: Path, run_name: str | None, force: bool = False):
    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.pipeline.runner import Pipeline

    return Pipeline(load_recipe(recipe), run_name=run_name, force=force)
