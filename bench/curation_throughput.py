"""Whole-curation throughput of the data stage (read → clean → language/variety → filters → exact dedup → Parquet)
in GB per core-hour, the unit the issue anchors on (Data-Juicer on Ray ≈ 1.5; datatrove's hashing ≈ 3 per task-hour).
Prints JSON.

    .venv/bin/python bench/curation_throughput.py [--recipe recipes/demo.yaml] [--repeat 4]

The recipe's sources are read `--repeat` times (as separate sources) so the fixed cost of starting Ray Data
operators is spread over more text; the result also gives peak RSS of this driver process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import gzip

    import ray

    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.data.readers import expand_paths
    from amalia_ray.data.stage import curate

    loaded = load_recipe(args.recipe)
    data = loaded.recipe.data
    sources = [s.model_copy(update={"name": f"{s.name}-{k}"}) for k in range(args.repeat) for s in data.sources]
    data = data.model_copy(update={"sources": sources})
    files = [f for i, s in enumerate(sources) for f in expand_paths(s, loaded.resolve, f"sources[{i}]")]
    text_bytes = sum(len(gzip.open(f).read()) if f.endswith(".gz") else Path(f).stat().st_size for f in files)
    cores = os.cpu_count() or 1
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        stats = curate(data, loaded.resolve, Path(tmp) / "data")
        wall = time.perf_counter() - t0
    ray.shutdown()
    gb = text_bytes / 1e9
    print(json.dumps({
        "benchmark": "curation_throughput", "recipe": args.recipe, "repeat": args.repeat,
        "uncompressed_gb": round(gb, 4), "documents_in": stats["documents_in"], "documents_kept": stats["documents_kept"],
        "wall_s": round(wall, 2), "cores": cores, "gb_per_core_hour": round(gb / (wall * cores / 3600), 3),
        "docs_per_s": round(stats["documents_in"] / wall, 1),
        "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "anchors_gb_per_core_hour": {"data_juicer_on_ray": 1.5, "datatrove_hashing_per_task_hour": 3.0},
    }, indent=2))


if __name__ == "__main__":
    main()
