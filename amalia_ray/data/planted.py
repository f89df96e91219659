"""A corpus with planted near-duplicates of known edit rates, built from real documents, to measure dedup quality
(precision / recall / F1 of the duplicate pairs found against the planted ones)."""

from __future__ import annotations

import itertools
import random


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
                words = text.split()
                out = []
                for w in words:
                    r = rng.random()
                    if r < edit_rate / 3:
                        continue  # delete
                    if r < 2 * edit_rate / 3:
                        out.append(rng.choice(vocab))  # replace
                        continue
                    out.append(w)
                    if r < edit_rate:
                        out.append(rng.choice(vocab))  # insert
                dup = f"{base}-dup{c}"
                docs.append({"id": dup, "text": " ".join(out)})
                origin[dup] = base
    rng.shuffle(docs)
    return docs, origin


def duplicate_pairs(cluster_of: dict[str, str]) -> set[tuple[str, str]]:
    """All unordered pairs of ids that share a cluster."""
    groups: dict[str, list[str]] = {}
    for doc, cluster in cluster_of.items():
        groups.setdefault(cluster, []).append(doc)
    return {tuple(sorted(p)) for members in groups.values() for p in itertools.combinations(sorted(members), 2)}


def pair_scores(found: dict[str, str], truth: dict[str, str]) -> dict:
    f, t = duplicate_pairs(found), duplicate_pairs(truth)
    tp = len(f & t)
    precision = tp / len(f) if f else 1.0
    recall = tp / len(t) if t else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "found_pairs": len(f), "true_pairs": len(t)}
