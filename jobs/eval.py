"""A recipe's evaluation stage as one Ray job: serve the run's checkpoints with Ray Serve + vLLM, score every task
over HTTP, stop serving, write the report. The checkpoints must exist in the run folder already.

    ray job submit --address http://HEAD:8265 --working-dir . -- python -m jobs.eval RECIPE
"""

from __future__ import annotations

import sys

from jobs.pipeline import run_job


def main(argv: list[str] | None = None) -> int:
    return run_job("python -m jobs.eval", __doc__.splitlines()[0], argv, select=lambda loaded, args: ["eval"])


if __name__ == "__main__":
    sys.exit(main())
