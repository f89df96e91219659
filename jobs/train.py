"""A recipe's training stages (Ray Train, FSDP2 workers) as one Ray job: all of them in order, or those named with
--stage. Their inputs (the packed data, the previous stage's checkpoint) must exist in the run folder already.

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.train RECIPE --stage sft
"""

from __future__ import annotations

import sys

from jobs.pipeline import run_job


def main(argv: list[str] | None = None) -> int:
    return run_job(
        "python -m jobs.train", __doc__.splitlines()[0], argv,
        select=lambda loaded, args: args.stage or [s.name for s in loaded.recipe.train],
        add_arguments=lambda p: p.add_argument("--stage", action="append", help="a train stage (repeatable; "
                                               "default: every train stage of the recipe)"))


if __name__ == "__main__":
    sys.exit(main())
