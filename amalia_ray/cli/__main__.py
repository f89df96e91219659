"""`python -m amalia_ray.cli`: the `amalia` command."""

import sys

from amalia_ray.cli import main

sys.exit(main())
