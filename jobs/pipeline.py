"""Run a recipe's pipeline as a Ray job on the cluster the job was submitted to:

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.pipeline recipes/demo.yaml

Inside a Ray job RAY_ADDRESS points at the cluster, so the pipeline attaches to it instead of starting Ray.
"""

from __future__ import annotations

import argparse
import sys

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.recipe import load_recipe
from amalia_ray.pipeline.runner import Pipeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--until", help="last stage to run (default: all)")
    parser.add_argument("--run-name")
    parser.add_argument("--force", action="store_true", help="rerun stages even when unchanged")
    args = parser.parse_args(argv)
    try:
        report = Pipeline(load_recipe(args.recipe), run_name=args.run_name, force=args.force).run(until=args.until)
    except AmaliaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
