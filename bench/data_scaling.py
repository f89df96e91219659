"""How the data stage's cost grows with the corpus: the whole stage (read, clean, language and variety, Gopher /
FineWeb quality filters, capture selection, site boilerplate, exact dedup, MinHash near-dedup, Parquet out) on a
web-archive-like corpus at several sizes, each in a fresh process with its own local Ray. Prints JSON.

    .venv/bin/python bench/data_scaling.py [--base-mb 50] [--scales 1,8,64] [--simulate 20:32]

The corpus is real Portuguese text (Debian's manuals and fortunes-br, the sentences of bench/dedup_vs_datatrove.py):
each page a seeded draw of 3–15 sentences on one of many sites, every page of a site ending in that site's rights
line (site boilerplate), 10% of pages also captured a year earlier with a few words changed (capture selection),
8% republished on another site with a few words changed (near duplicates); no exact copies made on purpose. jsonl
files of ~32 MB with `url` and `date` fields.

Per size: wall time (curate only, and with Ray's start) per GB of text, the driver's peak RSS (its own ru_maxrss),
the peak of Ray's shared object store (bytes and objects, sampled every second from Ray's memory summary), and what
the stage's keyed exchanges moved (`shuffled` in its stats: exchanges, bytes, parts, Ray objects created). Ratios
compare each size with the smallest: time per GB, driver peak RSS, objects per GB.

`--simulate NODES:CPUS` also runs the smallest size on a simulated large cluster: NODES Ray nodes on this machine
(`ray.cluster_utils.Cluster`, one raylet and object store each) of CPUS logical CPUs, so that everything the stage
sizes by the cluster's CPUs sees a 20 × 32-core cluster; Ray Data's tasks in flight are capped at `--in-flight`
so the simulation does not start hundreds of workers on a few cores (its wall time means nothing). It records the
same figures and their ratios to the same size on the local Ray: driver peak RSS, exchange parts and objects per GB,
object-store peak objects."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_corpus(folder: Path, megabytes: float, seed: int = 0) -> dict:
    from dedup_vs_datatrove import sentences

    from amalia_ray.data.dedup.planted import edit_words

    pool, rng = sentences(), random.Random(seed)
    vocab = [w for s in pool[:500] for w in s.split()]
    target, written, pages, files = megabytes * 1e6, 0, 0, []
    out = None
    sites = max(20, int(target / 1.3e3 / 300))  # ~300 pages a site

    def emit(record: dict) -> None:
        nonlocal out, written
        if out is None or out.tell() > 32e6:
            if out is not None:
                out.close()
            files.append(folder / f"crawl-{len(files):05d}.jsonl")
            out = open(files[-1], "w", encoding="utf-8")
        line = json.dumps(record, ensure_ascii=False) + "\n"
        out.write(line)
        written += len(line.encode())

    while written < target:
        site = rng.randrange(sites)
        text = " ".join(rng.sample(pool, rng.randint(3, 15)))
        footer = f"\n© Sítio {site}. Todos os direitos reservados. Política de privacidade e cookies."
        url = f"https://www.sitio{site:05d}.pt/artigos/{pages}"
        emit({"text": text + footer, "url": url, "date": f"2024-0{1 + pages % 9}-15T10:00:00Z"})
        roll = rng.random()
        if roll < 0.10:
            emit({"text": edit_words(text, 0.02, rng, vocab) + footer, "url": url, "date": "2023-03-01T09:00:00Z"})
        elif roll < 0.18:
            other = (site + 1) % sites
            emit({"text": edit_words(text, 0.02, rng, vocab) + f"\n© Sítio {other}. Todos os direitos reservados. "
                  "Política de privacidade e cookies.", "url": f"https://sitio{other:05d}.pt/copia/{pages}",
                  "date": "2024-06-01"})
        pages += 1
    out.close()
    return {"files": [str(f) for f in files], "bytes": written, "pages": pages}


class StoreWatch(threading.Thread):
    """Peak bytes and objects in Ray's shared object store (all nodes), from its memory summary every second."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_mb, self.peak_objects, self.stop = 0, 0, threading.Event()

    def run(self):
        from ray._private.internal_api import memory_summary

        while not self.stop.wait(1.0):
            try:
                found = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", memory_summary(stats_only=True))
            except Exception:  # the summary is best effort; the run goes on
                continue
            if found:
                self.peak_mb = max(self.peak_mb, int(found.group(1)))
                self.peak_objects = max(self.peak_objects, int(found.group(2)))


def start_ray(cpus: int, simulate: tuple[int, int] | None, in_flight: int):
    """A local Ray of `cpus` logical CPUs, or a simulated cluster of NODES × CPUS (returned, to shut down)."""
    import ray

    if simulate is None:
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        return None
    from ray.cluster_utils import Cluster
    from ray.data import ExecutionResources

    os.environ["RAY_prestart_worker_first_driver"] = "0"  # no worker per logical CPU started ahead of work
    os.environ["RAY_enable_worker_prestart"] = "0"
    nodes, per_node = simulate
    store = 200 << 20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": per_node, "object_store_memory": store,
                                                            "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=per_node, object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    ray.data.DataContext.get_current().execution_options.resource_limits = ExecutionResources(cpu=in_flight)
    return cluster


def run_one(corpus: dict, cpus: int, simulate: tuple[int, int] | None = None, in_flight: int = 4) -> dict:
    """One size, in this (fresh) process."""
    import ray

    from amalia_ray.core.config import (
        DataConfig,
        LanguageConfig,
        NearDedupConfig,
        QualityConfig,
        SourceConfig,
        VarietyConfig,
    )
    from amalia_ray.data.curate import curate

    cfg = DataConfig(
        sources=[SourceConfig(name="crawl", paths=corpus["files"], format="jsonl")], min_chars=120,
        language=LanguageConfig(keep=["pt"], min_score=0.5), variety=VarietyConfig(),
        quality=QualityConfig(language="pt"), near_dedup=NearDedupConfig())
    started = time.perf_counter()
    cluster = start_ray(cpus, simulate, in_flight)
    ray_cpus = int(ray.cluster_resources().get("CPU", 0))
    watch = StoreWatch()
    watch.start()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        stats = curate(cfg, Path, Path(out) / "data")
        wall = time.perf_counter() - t0
    watch.stop.set()
    with_start = time.perf_counter() - started
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    gb = corpus["bytes"] / 1e9
    return {"gb": round(gb, 4), "ray_cpus": ray_cpus, "ray_nodes": simulate[0] if simulate else 1, "pages_written": corpus["pages"], "documents_in": stats["documents_in"],
            "documents_kept": stats["documents_kept"], "removed": {
                "captures": sum(r["documents"] for r in stats["per_filter"] if r["reason"].startswith("capture")),
                "exact": stats["exact_duplicates_removed"], "near": stats["near_duplicates_removed"],
                "boilerplate_lines": stats.get("site_boilerplate_lines", 0)},
            "wall_s": round(wall, 2), "wall_with_ray_start_s": round(with_start, 2),
            "s_per_gb": round(wall / gb, 1), "driver_peak_rss_mb": round(resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "store_peak_mb": watch.peak_mb, "store_peak_objects": watch.peak_objects,
            "shuffled": stats["shuffled"], "exchange_objects_per_gb": round(stats["shuffled"]["objects"] / gb)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-mb", type=float, default=50, help="the corpus at scale 1")
    parser.add_argument("--scales", default="1,8,64")
    parser.add_argument("--cpus", type=int, default=max(8, os.cpu_count() or 1), help="the local Ray's logical CPUs")
    parser.add_argument("--simulate", metavar="NODES:CPUS",
                        help="also run the smallest size on a simulated cluster of NODES nodes of CPUS logical CPUs")
    parser.add_argument("--in-flight", type=int, default=4, help="with --simulate: Ray Data's tasks in flight")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a corpus description: run that size here
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    simulate = tuple(int(n) for n in args.simulate.split(":")) if args.simulate else None
    if args.one:
        print(json.dumps(run_one(json.loads(Path(args.one).read_text()), args.cpus, simulate, args.in_flight)))
        return

    def measure(corpus_file: Path, *extra: str) -> dict:
        proc = subprocess.run([sys.executable, __file__, "--one", str(corpus_file), "--cpus", str(args.cpus),
                               "--in-flight", str(args.in_flight), *extra], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{corpus_file} {extra} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    runs, simulated = {}, None
    scales = [int(s) for s in args.scales.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for scale in scales:
            folder = Path(tmp) / f"x{scale}"
            folder.mkdir()
            corpus = write_corpus(folder, args.base_mb * scale)
            (folder / "corpus.json").write_text(json.dumps(corpus))
            runs[str(scale)] = measure(folder / "corpus.json")
            if simulate and scale == min(scales):
                simulated = measure(folder / "corpus.json", "--simulate", args.simulate)
            for f in corpus["files"]:
                Path(f).unlink()
    first = runs[str(min(scales))]

    def ratio(a: float, b: float) -> float:
        return round(a / max(b, 1e-9), 3)

    print(json.dumps({
        "benchmark": "data_scaling", "cores": os.cpu_count(), "ray_cpus": args.cpus, "base_mb": args.base_mb,
        "runs": runs,
        "ratios_to_smallest": {scale: {
            "s_per_gb": ratio(r["s_per_gb"], first["s_per_gb"]),
            "driver_peak_rss": ratio(r["driver_peak_rss_mb"], first["driver_peak_rss_mb"]),
            "exchange_objects_per_gb": ratio(r["exchange_objects_per_gb"], max(1, first["exchange_objects_per_gb"])),
        } for scale, r in runs.items()},
        **({"simulated_cluster": simulated, "ratios_simulated_to_local": {
            "driver_peak_rss": ratio(simulated["driver_peak_rss_mb"], first["driver_peak_rss_mb"]),
            "exchange_objects_per_gb": ratio(simulated["exchange_objects_per_gb"],
                                             max(1, first["exchange_objects_per_gb"])),
            "exchange_parts": ratio(simulated["shuffled"]["parts"], max(1, first["shuffled"]["parts"])),
            "store_peak_objects": ratio(simulated["store_peak_objects"], max(1, first["store_peak_objects"])),
        }} if simulated else {}),
    }, indent=2))


if __name__ == "__main__":
    main()
