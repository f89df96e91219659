"""`amalia`: the command line. Each module registers its commands on the one typer app of `common`, in the order
`--help` lists them."""

import amalia_ray.cli.run
import amalia_ray.cli.variety
import amalia_ray.cli.serve
import amalia_ray.cli.cluster
import amalia_ray.cli.sweep  # noqa: F401 - imported for the commands they register
from amalia_ray.cli.common import app


def main() -> None:
    app()
