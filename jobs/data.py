"""The data stages of a recipe as one Ray job: curate (Ray Data), train the tokenizer, tokenize and pack.

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.data RECIPE
"""

from __future__ import annotations

import sys

from jobs.pipeline import run_job


def main(argv: list[str] | None = None) -> int:
    return run_job("python -m jobs.data", __doc__.splitlines()[0], argv, select=lambda loaded, args: loaded.recipe.data_stages)


if __name__ == "__main__":
    sys.exit(main())
