"""The source mix and the validation split of the packed corpus, both decided per document from a hash of its id,
so the same recipe gives the same mix and split on any cluster, block order or worker count."""

from __future__ import annotations

import pyarrow as pa

from amalia_ray.data.steps.base import unit_hash


def is_validation(doc_id: str, fraction: float) -> bool:
    """Stable train/validation split by document id, independent of block order and worker count."""
    return unit_hash(doc_id) < fraction


class MixBySource:
    """Up/down-sample documents by their source's weight: floor(w) copies of each, plus one more for a seeded
    share frac(w) of them (hash of id and seed, so the same recipe gives the same mix on any cluster)."""

    def __init__(self, weights: dict[str, float], seed: int):
        self.weights, self.seed = weights, seed

    def copies(self, doc_id: str, source: str) -> int:
        w = self.weights.get(source, 1.0)
        whole, frac = int(w), w - int(w)
        return whole + (1 if unit_hash(f"{self.seed}:{doc_id}") < frac else 0)

    def __call__(self, batch: pa.Table) -> pa.Table:
        counts = [self.copies(i, s) for i, s in zip(batch["id"].to_pylist(), batch["source"].to_pylist())]
        return batch.take(pa.array([row for row, n in enumerate(counts) for _ in range(n)], pa.int64()))
