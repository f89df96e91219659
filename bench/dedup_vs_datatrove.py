"""Near-dedup: ours (Ray Data MinHash-LSH + distributed connected components) against datatrove's MinHash pipeline,
same shingles (5 words), same 14 bands × 8 rows, same corpus and machine, in one run. Prints JSON.

    .venv/bin/python bench/dedup_vs_datatrove.py [--docs 2000]   # needs `pip install datatrove` (dev extra)

The corpus: real paragraphs of Debian's Portuguese manuals with planted near-duplicates at known word-edit rates
(1%, 3%, 5%, 10%); reported per system: wall time, docs/s, MB/s, precision/recall/F1 of the duplicate pairs against
the planted truth (overall and recall per edit rate), and the agreement of the two systems' pair sets.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import tempfile
import time
from pathlib import Path

SOURCES = ["/usr/share/debian-reference/debian-reference.pt.txt.gz", "/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz"]
EDIT_RATES = (0.01, 0.03, 0.05, 0.10)


def corpus(n_docs: int, seed: int) -> tuple[list[dict], dict[str, str], dict[str, float]]:
    from amalia_ray.data.planted import plant_duplicates

    paragraphs = [p for f in SOURCES for p in re.split(r"\n\s*\n", gzip.open(f, "rt", encoding="utf-8").read())
                  if len(p.split()) >= 40]
    per_rate = max(1, n_docs // (2 * len(EDIT_RATES)))
    docs, truth, rate_of = [], {}, {}
    for k, rate in enumerate(EDIT_RATES):
        chunk = paragraphs[k * per_rate:(k + 1) * per_rate]
        d, t = plant_duplicates(chunk, copies=1, edit_rate=rate, dup_fraction=1.0, seed=seed + k, prefix=f"r{k}-")
        docs += d
        truth.update(t)
        rate_of.update({doc: rate for doc in t})
    return docs, truth, rate_of


def recall_by_rate(found: dict[str, str], truth: dict[str, str], rate_of: dict[str, float]) -> dict:
    from amalia_ray.data.planted import duplicate_pairs

    f, t = duplicate_pairs(found), duplicate_pairs(truth)
    out = {}
    for rate in EDIT_RATES:
        pairs = {p for p in t if rate_of[p[0]] == rate}
        out[str(rate)] = len(pairs & f) / max(1, len(pairs))
    return out


def run_ours(path: Path, out: Path) -> tuple[float, dict[str, str]]:
    import pyarrow.parquet as pq
    import ray

    from amalia_ray.data.dedup import dedup
    from amalia_ray.data.minhash import MinHashParams

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    dedup(path, out, MinHashParams(ngram=5, num_perm=112, bands=14), threshold=None)
    elapsed = time.perf_counter() - t0
    ray.shutdown()
    rows = pq.read_table(out / "clusters.parquet").to_pylist()
    return elapsed, {r["id"]: r["cluster_id"] for r in rows}


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
    src = str(path.parent)
    glob = path.name
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
    parser.add_argument("--docs", type=int, default=2000, help="originals + planted copies, roughly")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from amalia_ray.data.planted import duplicate_pairs, pair_scores

    docs, truth, rate_of = corpus(args.docs, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = tmp / "in" / "docs.jsonl"
        path.parent.mkdir()
        with open(path, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        megabytes = path.stat().st_size / 1e6
        ours_s, ours = run_ours(path, tmp / "ours")
        theirs_s, theirs = run_datatrove(path, tmp / "dt", workers=os.cpu_count() or 1)
    result = {"benchmark": "dedup_vs_datatrove", "documents": len(docs), "megabytes": round(megabytes, 3),
              "shingle_words": 5, "bands": 14, "rows": 8, "cores": os.cpu_count()}
    for name, secs, found in (("ours", ours_s, ours), ("datatrove", theirs_s, theirs)):
        result[name] = {"wall_s": round(secs, 2), "docs_per_s": round(len(docs) / secs, 1),
                        "mb_per_s": round(megabytes / secs, 3), **{k: round(v, 4) if isinstance(v, float) else v
                                                                   for k, v in pair_scores(found, truth).items()},
                        "recall_by_edit_rate": recall_by_rate(found, truth, rate_of)}
    a, b = duplicate_pairs(ours), duplicate_pairs(theirs)
    result["pair_agreement_jaccard"] = round(len(a & b) / max(1, len(a | b)), 4)
    result["speed_ratio_ours_over_datatrove"] = round(theirs_s / ours_s, 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
