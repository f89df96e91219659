"""Whole-curation throughput of the data stage (read → clean → language/variety → filters → exact dedup → Parquet)
in GB per core-hour, with no peer in the run: a measurement of ours, not a comparison. Prints JSON.

    .venv/bin/python bench/curation_throughput.py [--recipe recipes/demo.yaml]
    .venv/bin/python bench/curation_throughput.py --synthetic-mb 800 --object-store-mb 75   # out of core

The recipe's sources are read once, as they are (the demo's are two manuals, ~2 MB: the fixed cost of starting Ray
and its Data operators weighs heavily at that size; the wall time with and without Ray's start are both given).
`--synthetic-mb` instead writes text files of that size made from the recipe's
sources (each copy's paragraphs tagged with the copy number, so they are not exact duplicates) and curates them with
the recipe's data settings; with `--object-store-mb` far below it, this is the out-of-core check: the run must finish
by streaming and spilling. Reported: peak RSS of this driver and of the whole Ray process tree (sampled every 0.2 s;
pages of the shared object store count once per process that maps them), the least available system memory seen,
and what Ray spilled to disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import tempfile
import threading
import time
from pathlib import Path

import psutil


class MemoryWatch(threading.Thread):
    """Peak RSS of this process and all its descendants (the embedded Ray: GCS, raylet, workers)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_tree_mb, self.min_available_mb, self.stop = 0.0, float("inf"), threading.Event()

    def run(self):
        me = psutil.Process()
        while not self.stop.wait(0.2):
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_tree_mb = max(self.peak_tree_mb, total / 2**20)
            self.min_available_mb = min(self.min_available_mb, psutil.virtual_memory().available / 2**20)


def synthetic_corpus(files: list[str], folder: Path, megabytes: int) -> list[str]:
    import gzip

    text = "\n\n".join(gzip.open(f, "rt", encoding="utf-8").read() if f.endswith(".gz") else open(f).read()
                       for f in files)
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    out, written, copy = [], 0, 0
    while written < megabytes * 1e6:
        path = folder / f"part-{len(out):04d}.txt"
        with open(path, "w", encoding="utf-8") as f:
            while f.tell() < 50e6 and written + f.tell() < megabytes * 1e6:
                f.write("\n\n".join(f"{p} [{copy}]" for p in paragraphs) + "\n\n")
                copy += 1
            written += f.tell()
        out.append(str(path))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--synthetic-mb", type=int, default=0, help="curate this many MB made from the sources")
    parser.add_argument("--object-store-mb", type=int, default=0, help="Ray object store size (0: Ray's default)")
    parser.add_argument("--variety-model", help="a variety classifier: its speed is measured beside the cue scorer's "
                        "and language ID's")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import gzip

    import ray

    from amalia_ray.core.recipe import load_recipe
    from amalia_ray.data.read.inputs import expand_paths
    from amalia_ray.data.curate import curate

    loaded = load_recipe(args.recipe)
    data = loaded.recipe.data
    workdir = tempfile.TemporaryDirectory()
    if args.synthetic_mb:
        originals = [f for i, s in enumerate(data.sources) for f in expand_paths(s, loaded.resolve, f"sources[{i}]")]
        files = synthetic_corpus(originals, Path(workdir.name), args.synthetic_mb)
        sources = [data.sources[0].model_copy(update={"name": "synthetic", "paths": files, "format": "text"})]
    else:
        sources = list(data.sources)
        files = [f for i, s in enumerate(sources) for f in expand_paths(s, loaded.resolve, f"sources[{i}]")]
    data = data.model_copy(update={"sources": sources})
    text_bytes = sum(len(gzip.open(f).read()) if f.endswith(".gz") else Path(f).stat().st_size for f in files)
    cores = os.cpu_count() or 1
    started = time.perf_counter()
    ray.init(address="local", num_cpus=max(8, cores), include_dashboard=False, log_to_driver=False,
             object_store_memory=args.object_store_mb * 2**20 or None)
    store_mb = ray.available_resources().get("object_store_memory", 0) / 2**20
    watch = MemoryWatch()
    watch.start()
    t0 = time.perf_counter()
    stats = curate(data, loaded.resolve, Path(workdir.name) / "data")
    wall = time.perf_counter() - t0
    with_start = time.perf_counter() - started
    watch.stop.set()
    from ray._private.internal_api import memory_summary

    spilled = re.search(r"Spilled (\d+) MiB", memory_summary(stats_only=True))
    ray.shutdown()
    workdir.cleanup()
    gb = text_bytes / 1e9
    steps = step_speeds(files, args.variety_model)
    print(json.dumps({
        "benchmark": "curation_throughput", "recipe": args.recipe, "synthetic_mb": args.synthetic_mb,
        "uncompressed_gb": round(gb, 4), "documents_in": stats["documents_in"], "documents_kept": stats["documents_kept"],
        "wall_s": round(wall, 2), "wall_with_ray_start_s": round(with_start, 2), "cores": cores,
        "gb_per_core_hour": round(gb / (wall * cores / 3600), 3),
        "gb_per_core_hour_with_ray_start": round(gb / (with_start * cores / 3600), 3),
        "docs_per_s": round(stats["documents_in"] / wall, 1),
        "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "ray_tree_peak_rss_mb": round(watch.peak_tree_mb, 1), "min_available_system_mb": round(watch.min_available_mb),
        "object_store_mb": round(store_mb), "corpus_over_object_store": round(text_bytes / 2**20 / max(store_mb, 1), 1),
        "spilled_mb": int(spilled.group(1)) if spilled else 0,
        "steps_docs_per_core_s": steps,
    }, indent=2))


def step_speeds(files: list[str], variety_model: str | None, limit: int = 3000) -> dict:
    """Documents per core-second (this process's CPU time, one thread) of the per-document steps that tell
    languages and varieties apart, on the same paragraphs of the sources (the first `limit` of 20+ words)."""
    import gzip

    from amalia_ray.core.variety import score_variety
    from amalia_ray.core.variety_model import VarietyModel
    from amalia_ray.data.steps.language import detect_language

    texts = []
    for f in files:
        text = (gzip.open(f, "rt", encoding="utf-8", errors="replace") if f.endswith(".gz")
                else open(f, encoding="utf-8", errors="replace")).read()
        texts += [p for p in re.split(r"\n\s*\n", text) if len(p.split()) >= 20]
    texts = texts[:limit]
    steps = {"language_id": lambda: [detect_language(t) for t in texts],
             "variety_cue_scorer": lambda: [score_variety(t) for t in texts]}
    if variety_model:
        model = VarietyModel(Path(variety_model))
        steps["variety_model"] = lambda: [model.score(texts[i:i + 1024]) for i in range(0, len(texts), 1024)]
    detect_language("aquecimento")  # the model's load is not a per-document cost
    out = {"documents": len(texts), "mean_chars": round(sum(map(len, texts)) / max(1, len(texts)))}
    for name, run in steps.items():
        cpu = time.process_time()
        run()
        out[name] = round(len(texts) / max(time.process_time() - cpu, 1e-9), 1)
    return out


if __name__ == "__main__":
    main()
