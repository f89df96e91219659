"""Run a recipe's pipeline as a Ray job on the cluster the job was submitted to:

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.pipeline recipes/demo.yaml

Inside a Ray job RAY_ADDRESS points at the cluster, so the pipeline attaches to it instead of starting Ray.
The per-stage jobs (jobs.data, jobs.train, jobs.eval) run one part of the same run folder, for teams that give each
stage its own job (and its own cluster shape); jobs.serve deploys the run's checkpoints and leaves them serving.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from amalia_ray.core import secrets
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import LoadedRecipe, load_recipe
from amalia_ray.core.stop import EXIT_STOPPED, StageStopped
from amalia_ray.pipeline.runner import Pipeline


def run_job(prog: str, description: str, argv: list[str] | None,
            select: Callable[[LoadedRecipe, argparse.Namespace], list[str] | None] | None = None,
            add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """Parse `RECIPE [--run-name] [--force]` (plus the job's own options), run the selected stages (all when
    `select` is None or returns None), print where the report is; 1 with the message on a recipe or input error."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("recipe")
    parser.add_argument("--run-name")
    parser.add_argument("--force", action="store_true", help="rerun stages even when unchanged")
    parser.add_argument("--reuse-stale", action="store_true", help="keep the results of stages completed by an "
                        "older version of the code instead of rerunning them")
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args(argv)
    secrets.install_log_masking()
    try:
        loaded = load_recipe(args.recipe)
        pipeline = Pipeline(loaded, run_name=args.run_name, force=args.force, reuse_stale=args.reuse_stale)
        only = select(loaded, args) if select else None
        if only is not None and not only:
            raise AmaliaError(f"{args.recipe}: nothing for {prog} to run in this recipe (it has no such stages)")
        report = pipeline.run(until=getattr(args, "until", None), only=only)
    except Exception as e:  # noqa: BLE001 - the job's log is where a user reads why it failed
        return failed(e)
    print(f"report: {report}")
    return 0


def failed(e: Exception) -> int:
    """Say why the job failed — the message of an expected error, the traceback of any other — with every secret
    this process knows (storage credentials, the API key) masked, as the job's log is readable on the dashboard.
    Returns the job's exit code (EXIT_STOPPED when a stop was requested: run again to carry on)."""
    if isinstance(e, StageStopped):  # not a failure: the next run of the recipe carries on
        print(f"stopped: {e}", file=sys.stderr)
        return EXIT_STOPPED
    text = f"error: {e}" if isinstance(e, AmaliaError) else traceback.format_exc()
    print(secrets.mask(text), file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    return run_job("python -m jobs.pipeline", __doc__.splitlines()[0], argv, add_arguments=lambda p: p.add_argument(
        "--until", help="last stage to run (default: all)"))


if __name__ == "__main__":
    sys.exit(main())
