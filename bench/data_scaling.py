"""How the data stage's cost grows with the corpus: the whole stage (read, clean, language and variety, Gopher /
FineWeb quality filters, capture selection, site boilerplate, exact dedup, MinHash near-dedup, Parquet out) on a
web-archive-like corpus at several sizes, each in a fresh process with its own local Ray. Prints JSON.

    .venv/bin/python bench/data_scaling.py [--base-mb 50] [--scales 1,8,64]

The corpus is real Portuguese text (Debian's manuals and fortunes-br, the sentences of bench/dedup_vs_datatrove.py):
each page a seeded draw of 3–15 sentences on one of many sites, every page of a site ending in that site's rights
line (site boilerplate), 10% of pages also captured a year earlier with a few words changed (capture selection),
8% republished on another site with a few words changed (near duplicates); no exact copies made on purpose. jsonl
files of ~32 MB with `url` and `date` fields.

Per size: wall time (curate only, and with Ray's start) per GB of text, the driver's peak RSS (its own ru_maxrss),
the peak of Ray's shared object store (bytes and objects, sampled every second from Ray's memory summary), and what
the stage's keyed exchanges moved (`shuffled` in its stats: exchanges, bytes, Ray objects created). Ratios compare
each size with the smallest: time per GB, driver peak RSS, objects per GB."""

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

    from amalia_ray.data.planted import edit_words

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


def run_one(corpus: dict, cpus: int) -> dict:
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
    from amalia_ray.data.stage import curate

    cfg = DataConfig(
        sources=[SourceConfig(name="crawl", paths=corpus["files"], format="jsonl")], min_chars=120,
        language=LanguageConfig(keep=["pt"], min_score=0.5), variety=VarietyConfig(),
        quality=QualityConfig(language="pt"), near_dedup=NearDedupConfig())
    started = time.perf_counter()
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    watch = StoreWatch()
    watch.start()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        stats = curate(cfg, Path, Path(out) / "data")
        wall = time.perf_counter() - t0
    watch.stop.set()
    with_start = time.perf_counter() - started
    ray.shutdown()
    gb = corpus["bytes"] / 1e9
    return {"gb": round(gb, 4), "pages_written": corpus["pages"], "documents_in": stats["documents_in"],
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
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a corpus description: run that size here
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.one:
        print(json.dumps(run_one(json.loads(Path(args.one).read_text()), args.cpus)))
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scale in [int(s) for s in args.scales.split(",")]:
            folder = Path(tmp) / f"x{scale}"
            folder.mkdir()
            corpus = write_corpus(folder, args.base_mb * scale)
            (folder / "corpus.json").write_text(json.dumps(corpus))
            proc = subprocess.run([sys.executable, __file__, "--one", str(folder / "corpus.json"),
                                   "--cpus", str(args.cpus)], capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"scale {scale} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            runs[str(scale)] = json.loads(proc.stdout.strip().splitlines()[-1])
            for f in corpus["files"]:
                Path(f).unlink()
    first = runs[min(runs, key=int)]
    print(json.dumps({
        "benchmark": "data_scaling", "cores": os.cpu_count(), "ray_cpus": args.cpus, "base_mb": args.base_mb,
        "runs": runs,
        "ratios_to_smallest": {scale: {
            "s_per_gb": round(r["s_per_gb"] / first["s_per_gb"], 3),
            "driver_peak_rss": round(r["driver_peak_rss_mb"] / first["driver_peak_rss_mb"], 3),
            "exchange_objects_per_gb": round(r["exchange_objects_per_gb"] / max(1, first["exchange_objects_per_gb"]), 3),
        } for scale, r in runs.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
