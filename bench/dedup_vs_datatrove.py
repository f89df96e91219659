"""Near-dedup: ours (Ray Data MinHash-LSH + exact Jaccard verification + distributed connected components) against
datatrove's MinHash pipeline, same shingles (5 words), same 14 bands × 8 rows, same corpus and machine, in one run.
Prints JSON.

    .venv/bin/python bench/dedup_vs_datatrove.py [--docs 40000] [--threshold 0.8]   # datatrove: dev extra

The corpus is made of real Portuguese sentences (Debian's manuals, fortunes-br): each original document is a seeded
random draw of 3–15 sentences; half of the originals get a copy with words replaced, deleted or inserted at a known
rate (1, 2, 3, 5, 10 or 20%). A pair of documents is a true near-duplicate when the exact Jaccard similarity of their
5-word shingle sets (computed here, independently of both systems) is >= the threshold; every planted pair and every
pair either system reports is checked. Reported per system: wall time, docs/s, MB/s, precision/recall/F1 of the
duplicate pairs, recall of the planted pairs per edit rate, and the agreement of the two systems' pair sets. Ray's
start-up and first-job warm-up are reported apart (a cluster is started once, not per job).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path

SOURCES = ["/usr/share/debian-reference/debian-reference.pt.txt.gz", "/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz",
           "/usr/share/games/fortunes/brasil"]
EDIT_RATES = (0.01, 0.02, 0.03, 0.05, 0.10, 0.20)


def sentences() -> list[str]:
    out = []
    for f in SOURCES:
        if not Path(f).exists():
            continue
        text = (gzip.open(f, "rt", encoding="utf-8") if f.endswith(".gz") else open(f, encoding="utf-8")).read()
        for s in re.split(r"(?<=[.!?])\s+|\n\s*\n|\n%\n", text):
            s = " ".join(s.split())
            if len(s.split()) >= 5:
                out.append(s)
    return sorted(set(out))


def corpus(n_docs: int, seed: int) -> tuple[list[dict], dict[str, str], dict[str, float]]:
    from amalia_ray.data.planted import edit_words

    pool, rng = sentences(), random.Random(seed)
    vocab = [w for s in pool[:500] for w in s.split()]
    docs, origin, rate_of = [], {}, {}
    n_originals = int(n_docs / 1.5)
    for i in range(n_originals):
        doc_id = f"d{i:07d}"
        text = " ".join(rng.sample(pool, rng.randint(3, 15)))
        docs.append({"id": doc_id, "text": text})
        origin[doc_id] = doc_id
        if i % 2 == 0:
            rate = EDIT_RATES[(i // 2) % len(EDIT_RATES)]
            copy = f"{doc_id}-copy"
            docs.append({"id": copy, "text": edit_words(text, rate, rng, vocab)})
            origin[copy], rate_of[copy] = doc_id, rate
    rng.shuffle(docs)
    return docs, origin, rate_of


def run_ours(path: Path, out: Path, threshold: float) -> tuple[float, float, dict[str, str]]:
    import pyarrow.parquet as pq
    import ray

    from amalia_ray.data.dedup import dedup
    from amalia_ray.data.minhash import MinHashParams

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    ray.data.range(os.cpu_count() or 1).materialize()  # a started cluster has its workers up and Ray Data loaded
    started = time.perf_counter() - t0
    t0 = time.perf_counter()
    dedup(path, out, MinHashParams(ngram=5, num_perm=112, bands=14), threshold=threshold)
    elapsed = time.perf_counter() - t0
    ray.shutdown()
    rows = pq.read_table(out / "clusters.parquet").to_pylist()
    return started, elapsed, {r["id"]: r["cluster_id"] for r in rows}


def run_datatrove(path: Path, work: Path, workers: int) -> tuple[float, dict[str, str]]:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        """Words split on white space, as our shingling does (datatrove's default needs spaCy models)."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    # datatrove 0.10 passes str to xxhash, which xxhash >= 4 (pulled in by vLLM) only takes as bytes
    import xxhash
    from datatrove.utils.hashes import xxhash as dt_xxhash

    dt_xxhash.xxhash64 = lambda data: xxhash.xxh64_intdigest(data.encode() if isinstance(data, str) else data)
    dt_xxhash.xxhash32 = lambda data: xxhash.xxh32_intdigest(data.encode() if isinstance(data, str) else data)

    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8, seed=1)
    src, glob = str(path), "*.jsonl"
    t0 = time.perf_counter()
    LocalPipelineExecutor([JsonlReader(src, glob_pattern=glob), MinhashDedupSignature(str(work / "sigs"), config=cfg,
                                                                          language=Whitespace())],
                          tasks=workers, workers=workers, logging_dir=str(work / "logs1")).run()
    LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)],
                          tasks=cfg.num_buckets, workers=workers, logging_dir=str(work / "logs2")).run()
    LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "clusters"), config=cfg,
                                               save_cluster_id=True)],
                          tasks=1, workers=1, logging_dir=str(work / "logs3")).run()
    LocalPipelineExecutor([JsonlReader(src, glob_pattern=glob),
                           MinhashDedupFilter(str(work / "clusters"), load_cluster_ids=True,
                                              exclusion_writer=JsonlWriter(str(work / "removed"))),
                           JsonlWriter(str(work / "kept"))],
                          tasks=workers, workers=workers, logging_dir=str(work / "logs4")).run()
    elapsed = time.perf_counter() - t0
    found = {}
    for f in list((work / "kept").rglob("*.jsonl.gz")) + list((work / "removed").rglob("*.jsonl.gz")):
        for line in gzip.open(f, "rt", encoding="utf-8"):
            doc = json.loads(line)
            cluster = doc.get("metadata", {}).get("minhash_cluster_id")
            found[doc["id"]] = f"c{cluster}" if cluster is not None and cluster != -1 else doc["id"]
    return elapsed, found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=40000, help="originals + planted copies")
    parser.add_argument("--threshold", type=float, default=0.8, help="ours: Jaccard verification; both: the truth")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from amalia_ray.data.planted import duplicate_pairs as cluster_pairs
    from amalia_ray.data.planted import reference_jaccard, threshold_scores

    docs, origin, rate_of = corpus(args.docs, args.seed)
    text_of = {d["id"]: d["text"] for d in docs}
    cache: dict[tuple[str, str], float] = {}

    def similarity(pair: tuple[str, str]) -> float:
        if pair not in cache:
            cache[pair] = reference_jaccard(text_of[pair[0]], text_of[pair[1]])
        return cache[pair]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / "in"  # a corpus comes in many files: one per task for both systems
        path.mkdir()
        shards = 2 * (os.cpu_count() or 1)
        for k in range(shards):
            with open(path / f"docs-{k:03d}.jsonl", "w", encoding="utf-8") as f:
                for d in docs[k::shards]:
                    f.write(json.dumps(d, ensure_ascii=False) + "\n")
        megabytes = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        ray_start_s, ours_s, ours = run_ours(path, tmp / "ours", args.threshold)
        theirs_s, theirs = run_datatrove(path, tmp / "dt", workers=os.cpu_count() or 1)
    planted = cluster_pairs(origin)
    result = {"benchmark": "dedup_vs_datatrove", "documents": len(docs), "megabytes": round(megabytes, 2),
              "shingle_words": 5, "bands": 14, "rows": 8, "threshold": args.threshold, "cores": os.cpu_count(),
              "planted_pairs": len(planted),
              "planted_pairs_at_or_above_threshold": sum(similarity(p) >= args.threshold for p in planted)}
    for name, secs, found in (("ours", ours_s, ours), ("datatrove", theirs_s, theirs)):
        pairs = cluster_pairs(found)
        result[name] = {"wall_s": round(secs, 2), "docs_per_s": round(len(docs) / secs, 1),
                        "mb_per_s": round(megabytes / secs, 3),
                        **threshold_scores(pairs, planted, lambda p: similarity(p) >= args.threshold),
                        "planted_recall_by_edit_rate": {
                            str(rate): round(len({p for p in planted if rate_of.get(p[1], rate_of.get(p[0])) == rate}
                                                 & pairs) / max(1, sum(1 for c, r in rate_of.items() if r == rate)), 3)
                            for rate in EDIT_RATES}}
    result["ours"]["ray_start_s"] = round(ray_start_s, 2)
    a, b = cluster_pairs(ours), cluster_pairs(theirs)
    result["pair_agreement_jaccard"] = round(len(a & b) / max(1, len(a | b)), 4)
    result["speed_ratio_ours_over_datatrove"] = round(theirs_s / ours_s, 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
