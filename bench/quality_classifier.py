"""The trained quality classifier (`amalia data train-quality`) on labelled text available offline: held-out
precision and recall, and scoring throughput in documents per core-second beside the heuristic filters. Prints JSON.

    .venv/bin/python bench/quality_classifier.py

Positives (curated): paragraphs of at least 40 words of Debian's European-Portuguese manuals (debian-reference-pt,
debian-faq-pt). Negatives (stand-ins for raw web text, which cannot be downloaded here): blocks of at least 40 words
of the installed packages' changelogs and licence files. A fifth of each side, chosen by a hash, is held back; the
model never sees it. A harder negative is reported apart: the held-back positives with their words shuffled (word
salad, as spam pages are), which a bag of word uni- and bigrams can only partly tell from prose.
Throughput: one process, one thread, the held-back documents ten times over through the classifier and through the heuristic filters
(Gopher repetition, Gopher quality, FineWeb lines, with the heuristic score), each timed alone.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pyarrow as pa  # noqa: E402

from amalia_ray.core.config import QualityConfig  # noqa: E402
from amalia_ray.data.steps.quality import HeuristicScore, quality_steps  # noqa: E402
from amalia_ray.data.steps.quality_model import QualityModel, train_quality_model  # noqa: E402
from amalia_ray.data.steps.base import unit_hash  # noqa: E402

REPEAT = 10  # the held-back documents, scored this many times over for the throughput
MANUALS = ["/usr/share/debian-reference/debian-reference.pt.txt.gz", "/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz"]


def blocks(text: str, min_words: int = 40) -> list[str]:
    return [b.strip() for b in re.split(r"\n\s*\n", text) if len(b.split()) >= min_words]


def positives() -> list[str]:
    return [b for path in MANUALS for b in blocks(gzip.decompress(Path(path).read_bytes()).decode("utf-8"))]


def negatives() -> list[str]:
    out = []
    for path in sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz")):
        out += blocks(gzip.decompress(path.read_bytes()).decode("utf-8", "replace"))
    for path in sorted(Path("/usr/share/doc").glob("*/copyright")):
        out += blocks(path.read_text(errors="replace"))
    return out


def held_back(texts: list[str]) -> tuple[list[str], list[str]]:
    held = [unit_hash(f"bench:{t[:300]}") < 0.2 for t in texts]
    return [t for t, h in zip(texts, held) if not h], [t for t, h in zip(texts, held) if h]


def rates(scores, positive: bool) -> float:
    return float(((scores >= 0.5) if positive else (scores < 0.5)).mean())


def main() -> None:
    pos_train, pos_test = held_back(positives())
    neg_all = negatives()
    random.Random(0).shuffle(neg_all)
    neg_train, neg_test = held_back(neg_all[: 3 * len(pos_train)])  # the web outnumbers curated text
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, texts in (("pos", pos_train), ("neg", neg_train)):
            (tmp / f"{name}.jsonl").write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts))
        started = time.perf_counter()
        train_quality_model(tmp / "model", [str(tmp / "pos.jsonl")], [str(tmp / "neg.jsonl")], holdout=0.0,
                            min_chars=0)
        train_s = time.perf_counter() - started
        model = QualityModel(tmp / "model")
    p, n = model.score(pos_test), model.score(neg_test)
    tp, fp = int((p >= 0.5).sum()), int((n >= 0.5).sum())
    rng = random.Random(1)
    salad = []
    for t in pos_test:
        words = t.split()
        rng.shuffle(words)
        salad.append(" ".join(words))

    docs = (pos_test + neg_test) * REPEAT
    started = time.process_time()
    for lo in range(0, len(docs), 1024):  # the data stage's batches
        model.score(docs[lo:lo + 1024])
    model_cpu = time.process_time() - started
    batch = pa.table({"id": [str(i) for i in range(len(docs))], "text": docs, "drop_reason": pa.nulls(len(docs),
                                                                                                  pa.string())})
    steps = [*quality_steps(QualityConfig()), HeuristicScore("pt")]
    started = time.process_time()
    for step in steps:
        batch = step(batch)
    heuristic_cpu = time.process_time() - started
    print(json.dumps({
        "train": {"positive": len(pos_train), "negative": len(neg_train), "train_s": round(train_s, 2)},
        "heldout": {"positive": len(pos_test), "negative": len(neg_test),
                    "precision": round(tp / max(1, tp + fp), 4), "recall": round(rates(p, True), 4),
                    "negatives_rejected": round(rates(n, False), 4)},
        "word_salad": {"documents": len(salad), "rejected": round(rates(model.score(salad), False), 4)},
        "throughput_docs_per_core_s": {"classifier": round(len(docs) / model_cpu, 1),
                                       "heuristic_filters": round(len(docs) / heuristic_cpu, 1),
                                       "documents": len(docs),
                                       "mean_chars": round(sum(map(len, docs)) / len(docs))},
    }, indent=2))


if __name__ == "__main__":
    main()
