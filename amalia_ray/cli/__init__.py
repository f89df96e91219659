"""`amalia`, the command line: an entry point. Each module registers its commands on the one typer app of
`common.py` (one-line errors, `--debug`, `--address`), in the order `--help` lists them. Most commands go through
the pipeline; `amalia serve` and `amalia eval` call the serve and evals stages' public API directly, which entry
points may."""

import amalia_ray.cli.run
import amalia_ray.cli.variety
import amalia_ray.cli.serve
import amalia_ray.cli.cluster
import amalia_ray.cli.sweep  # noqa: F401 - imported for the commands they register
from amalia_ray.cli.common import app


def main() -> None:
    app()
