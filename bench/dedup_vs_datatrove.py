"""Near-dedup: `amalia data dedup` (Ray Data MinHash-LSH, optional exact Jaccard verification, distributed connected
components) against datatrove's MinHash pipeline, same shingles (5 words), same 14 bands × 8 rows, same corpus and
machine, in one run. Prints JSON.

    .venv/bin/python bench/dedup_vs_datatrove.py [--docs 40000] [--threshold 0.8] [--hash-seeds 1,2,3]

The corpus is made of real Portuguese sentences (Debian's manuals, fortunes-br): each original document is a seeded
random draw of 3–15 sentences; half of the originals get a copy with words replaced, deleted or inserted at a known
rate (1, 2, 3, 5, 10 or 20%). The truth is the planted pairs, known by construction and independent of both tools'
similarity measures; recall is also given per edit rate. Each side runs as a whole command, timed from process
start to its output on disk: ours `amalia data dedup` (with `--executor auto`: in this process for an input of up to
256 MB, else on a Ray it starts; when it ran in-process, the verified run is repeated on Ray and reported as
`ours_on_ray`), datatrove a script running its
four-step MinHash pipeline on its `LocalPipelineExecutor` with as many workers as cores. Both write the kept
documents as Parquet. Ours runs three times: with Jaccard verification at `--threshold` estimated from the
signatures (the default), with it computed exactly over the shingle sets (`--similarity exact`), and without
verification (`--threshold 0`: every LSH candidate pair kept, the same rule datatrove applies). The two sides
draw different hash functions, so their F1 differs by chance too: `--hash-seeds` runs both unverified again with
other seeds and reports the F1 of each. datatrove comes with the dev extra.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import subprocess
import sys
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
    from amalia_ray.data.dedup.planted import edit_words

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


DATATROVE_SCRIPT = """
import sys
from pathlib import Path

import xxhash
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import MinhashDedupBuckets, MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature
from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import ParquetWriter
from datatrove.utils.hashes import xxhash as dt_xxhash
from datatrove.utils.word_tokenizers import WordTokenizer


class Whitespace(WordTokenizer):
    # words split on white space, as our shingling does (datatrove's default needs spaCy models)
    def word_tokenize(self, text):
        return text.split()

    def sent_tokenize(self, text):
        return [text]

    def span_tokenize(self, text):
        return [(0, len(text))]


# datatrove 0.10 passes str to xxhash, which xxhash >= 4 (pulled in by vLLM) only takes as bytes
dt_xxhash.xxhash64 = lambda d: xxhash.xxh64_intdigest(d.encode() if isinstance(d, str) else d)
dt_xxhash.xxhash32 = lambda d: xxhash.xxh32_intdigest(d.encode() if isinstance(d, str) else d)

if __name__ == "__main__":
    src, work, workers, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8, seed=seed)
    LocalPipelineExecutor([JsonlReader(src, glob_pattern="*.jsonl"),
                           MinhashDedupSignature(str(work / "sigs"), config=cfg, language=Whitespace())],
                          tasks=workers, workers=workers, logging_dir=str(work / "logs1")).run()
    LocalPipelineExecutor([MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=cfg)],
                          tasks=cfg.num_buckets, workers=workers, logging_dir=str(work / "logs2")).run()
    LocalPipelineExecutor([MinhashDedupCluster(str(work / "buckets"), str(work / "clusters"), config=cfg,
                                               save_cluster_id=True)],
                          tasks=1, workers=1, logging_dir=str(work / "logs3")).run()
    LocalPipelineExecutor([JsonlReader(src, glob_pattern="*.jsonl"),
                           MinhashDedupFilter(str(work / "clusters"), load_cluster_ids=True,
                                              exclusion_writer=ParquetWriter(str(work / "removed"))),
                           ParquetWriter(str(work / "kept"))],
                          tasks=workers, workers=workers, logging_dir=str(work / "logs4")).run()
"""


def timed(cmd: list[str]) -> tuple[float, str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} … failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return elapsed, proc.stdout


def run_ours(path: Path, out: Path, threshold: float, similarity: str = "estimated", seed: int = 1,
             executor: str = "auto") -> tuple[float, dict[str, str], str]:
    """(seconds, cluster of each id, the executor the command chose or was given)."""
    import pyarrow.parquet as pq

    amalia = Path(sys.executable).parent / "amalia"
    elapsed, printed = timed([str(amalia), "data", "dedup", str(path), str(out), "--threshold", str(threshold),
                              "--similarity", similarity, "--ngram", "5", "--num-perm", "112", "--bands", "14",
                              "--seed", str(seed), "--executor", executor])
    rows = pq.read_table(out / "clusters.parquet").to_pylist()
    return elapsed, {r["id"]: r["cluster_id"] for r in rows}, re.search(r'"executor": "([^"]+)"', printed)[1]


def run_datatrove(path: Path, work: Path, workers: int, seed: int = 1) -> tuple[float, dict[str, str]]:
    import pyarrow.parquet as pq

    script = work.parent / "datatrove_minhash.py"
    script.write_text(DATATROVE_SCRIPT)
    elapsed, _ = timed([sys.executable, str(script), str(path), str(work), str(workers), str(seed)])
    found = {}
    for f in list((work / "kept").rglob("*.parquet")) + list((work / "removed").rglob("*.parquet")):
        for doc in pq.read_table(f).to_pylist():
            cluster = (doc.get("metadata") or {}).get("minhash_cluster_id")
            found[doc["id"]] = f"c{cluster}" if cluster is not None and cluster != -1 else doc["id"]
    return elapsed, found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=40000, help="originals + planted copies")
    parser.add_argument("--threshold", type=float, default=0.8, help="ours: Jaccard verification; both: the truth")
    parser.add_argument("--seed", type=int, default=0, help="the corpus")
    parser.add_argument("--hash-seeds", default="1", help="comma-separated MinHash seeds: past the first, both "
                        "sides run again unverified with each, to show how F1 varies with the hash functions")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from amalia_ray.data.dedup.planted import duplicate_pairs as cluster_pairs
    from amalia_ray.data.dedup.planted import reference_jaccard, threshold_scores

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
        seeds = [int(s) for s in args.hash_seeds.split(",")]
        ours_s, ours, executor = run_ours(path, tmp / "ours", args.threshold, seed=seeds[0])
        exact_s, exact, _ = run_ours(path, tmp / "ours-exact", args.threshold, "exact", seed=seeds[0])
        lsh_s, lsh, _ = run_ours(path, tmp / "ours-lsh", 0.0, seed=seeds[0])
        # the same verified run on a Ray cluster started by the command, when the command chose to run in-process
        on_ray = run_ours(path, tmp / "ours-ray", args.threshold, seed=seeds[0], executor="ray") \
            if executor != "ray" else None
        (tmp / "dt").mkdir()
        theirs_s, theirs = run_datatrove(path, tmp / "dt", workers=os.cpu_count() or 1, seed=seeds[0])
        planted = cluster_pairs(origin)
        f1_by_seed = {name: [threshold_scores(cluster_pairs(found), planted, lambda p: p in planted)["f1"]]
                      for name, found in (("ours_lsh_only", lsh), ("datatrove", theirs))}
        for seed in seeds[1:]:
            _, found, _ = run_ours(path, tmp / f"ours-lsh-{seed}", 0.0, seed=seed)
            f1_by_seed["ours_lsh_only"].append(threshold_scores(cluster_pairs(found), planted,
                                                                lambda p: p in planted)["f1"])
            (tmp / f"dt-{seed}").mkdir()
            _, found = run_datatrove(path, tmp / f"dt-{seed}", workers=os.cpu_count() or 1, seed=seed)
            f1_by_seed["datatrove"].append(threshold_scores(cluster_pairs(found), planted,
                                                            lambda p: p in planted)["f1"])
    result = {"benchmark": "dedup_vs_datatrove", "timing": "whole commands, process start to output on disk",
              "documents": len(docs), "megabytes": round(megabytes, 2), "ours_executor": executor,
              "shingle_words": 5, "bands": 14, "rows": 8, "threshold": args.threshold, "cores": os.cpu_count(),
              "truth": "the planted pairs", "planted_pairs": len(planted),
              "planted_pairs_at_or_above_threshold": sum(similarity(p) >= args.threshold for p in planted)}
    runs = [("ours", ours_s, ours), ("ours_exact_jaccard", exact_s, exact), ("ours_lsh_only", lsh_s, lsh),
            ("datatrove", theirs_s, theirs)] + ([("ours_on_ray", on_ray[0], on_ray[1])] if on_ray else [])
    for name, secs, found in runs:
        pairs = cluster_pairs(found)
        result[name] = {"wall_s": round(secs, 2), "docs_per_s": round(len(docs) / secs, 1),
                        "mb_per_s": round(megabytes / secs, 3),
                        **threshold_scores(pairs, planted, lambda p: p in planted),
                        "planted_recall_by_edit_rate": {
                            str(rate): round(len({p for p in planted if rate_of.get(p[1], rate_of.get(p[0])) == rate}
                                                 & pairs) / max(1, sum(1 for c, r in rate_of.items() if r == rate)), 3)
                            for rate in EDIT_RATES}}
    for name, scores in f1_by_seed.items():  # the first seed's F1 is the one reported above
        result[name]["f1_by_hash_seed"] = dict(zip(args.hash_seeds.split(","), scores))
        result[name]["f1_mean_over_hash_seeds"] = round(sum(scores) / len(scores), 4)
    a, b = cluster_pairs(lsh), cluster_pairs(theirs)
    result["pair_agreement_jaccard_lsh_only_vs_datatrove"] = round(len(a & b) / max(1, len(a | b)), 4)
    result["speed_ratio_ours_over_datatrove"] = round(theirs_s / ours_s, 3)
    result["speed_ratio_ours_exact_jaccard_over_datatrove"] = round(theirs_s / exact_s, 3)
    result["speed_ratio_ours_lsh_only_over_datatrove"] = round(theirs_s / lsh_s, 3)
    if on_ray:
        result["speed_ratio_ours_on_ray_over_datatrove"] = round(theirs_s / on_ray[0], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
