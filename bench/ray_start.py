"""The fixed cost every command that starts its own Ray pays before and after its work: importing Ray, starting an
embedded Ray as `amalia data dedup` starts it (a logical CPU per core, no dashboard) and shutting it down, each
measured in a fresh process. Prints JSON (medians over `--repeat` processes).

    .venv/bin/python bench/ray_start.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = """
import json, os, time
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False)
t2 = time.perf_counter()
ray.shutdown()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "init_s": t2 - t1, "shutdown_s": t3 - t2}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    runs = []
    for _ in range(args.repeat):
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"benchmark": "ray_start", "cores": os.cpu_count(), "repeat": args.repeat,
                      **{k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]},
                      "runs": [{k: round(v, 2) for k, v in r.items()} for r in runs]}, indent=2))


if __name__ == "__main__":
    main()
