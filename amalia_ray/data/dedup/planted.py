"""A corpus with planted near-duplicates of known edit rates, built from real documents, to measure dedup quality
(precision / recall / F1 of the duplicate pairs found against the planted ones)."""

from __future__ import annotations

import itertools
import random
import re
import unicodedata


def plant_duplicates(texts: list[str], copies: int = 2, edit_rate: float = 0.05, dup_fraction: float = 0.3,
                     seed: int = 0, prefix: str = "doc") -> tuple[list[dict], dict[str, str]]:
    """Returns documents (`id`, `text`) and the truth: id -> id of the original it was derived from (originals map
    to themselves). A copy replaces, deletes or inserts words at `edit_rate`."""
    rng = random.Random(seed)
    docs, origin = [], {}
    vocab = [w for t in texts[:200] for w in t.split()] or ["palavra"]
    for i, text in enumerate(texts):
        base = f"{prefix}{i:06d}"
        docs.append({"id": base, "text": text})
        origin[base] = base
        if rng.random() < dup_fraction:
            for c in range(copies):
                dup = f"{base}-dup{c}"
                docs.append({"id": dup, "text": edit_words(text, edit_rate, rng, vocab)})
                origin[dup] = base
    rng.shuffle(docs)
    return docs, origin


def edit_words(text: str, rate: float, rng: random.Random, vocab: list[str]) -> str:
    """Each word is deleted, replaced by a vocabulary word, or followed by an inserted one, each with rate / 3."""
    out = []
    for w in text.split():
        r = rng.random()
        if r < rate / 3:
            continue
        if r < 2 * rate / 3:
            out.append(rng.choice(vocab))
            continue
        out.append(w)
        if r < rate:
            out.append(rng.choice(vocab))
    return " ".join(out)


def duplicate_pairs(cluster_of: dict[str, str]) -> set[tuple[str, str]]:
    """All unordered pairs of ids that share a cluster."""
    groups: dict[str, list[str]] = {}
    for doc, cluster in cluster_of.items():
        groups.setdefault(cluster, []).append(doc)
    return {tuple(sorted(p)) for members in groups.values() for p in itertools.combinations(sorted(members), 2)}


def reference_shingles(text: str, k: int = 5) -> set[str]:
    """Word k-grams in plain Python, independent of the vectorized implementation, to score it against: the text
    lower-cased, numbers written 0, nonspacing marks dropped after NFD, all but letters, digits, marks and `_` a
    space."""
    folded = re.sub(r"\d+([.,،٫⎖⎗⎘]\d+)?", "0", text.lower())
    folded = "".join(c for c in unicodedata.normalize("NFD", folded) if unicodedata.category(c) != "Mn")
    words = "".join(c if c == "_" or unicodedata.category(c)[0] in "LNM" else " " for c in folded).split()
    return {" ".join(words[i:i + k]) for i in range(max(1, len(words) - k + 1))} if words else set()


def reference_jaccard(a: str, b: str, k: int = 5) -> float:
    sa, sb = reference_shingles(a, k), reference_shingles(b, k)
    return len(sa & sb) / len(sa | sb) if sa or sb else 1.0


def threshold_scores(found: set[tuple[str, str]], planted: set[tuple[str, str]], is_duplicate) -> dict:
    """Precision/recall/F1 of found pairs where the truth is every planted or found pair that `is_duplicate`
    (e.g. exact Jaccard >= threshold): planted copies edited past the threshold are not near-duplicates."""
    truth = {p for p in planted | found if is_duplicate(p)}
    tp = len(found & truth)
    precision = tp / len(found) if found else 1.0
    recall = tp / len(truth) if truth else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": round(precision, 4), "recall": round(recall, 4), "f1": round(f1, 4),
            "found_pairs": len(found), "true_pairs": len(truth)}
