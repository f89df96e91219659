"""`amalia`, the command line: an entry point. Each module registers its commands on the one typer app of
`common.py` (one-line errors, `--debug`, `--address`), in the order `--help` lists them. Most commands go through
the pipeline; `amalia serve` and `amalia eval` call the serve and evals stages' public API directly, which entry
points may."""

import amalia_ray.cli.run_commands
import amalia_ray.cli.variety_commands
import amalia_ray.cli.serve_commands
import amalia_ray.cli.cluster_commands
import amalia_ray.cli.sweep_commands  # noqa: F401 - imported for the commands they register
from amalia_ray.cli.common import app


def main() -> None:
    app()
