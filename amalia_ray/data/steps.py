"""Cleaning and filtering steps over Arrow batches. Each step is a small callable; the stage chains them.

Filters do not delete: they fill `drop_reason`, so the stage can report kept/dropped counts per filter and source
and keep the dropped documents aside instead of losing them.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from amalia_ray.data.decide import ROW

_SPACES = re.compile(r"[ \t\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")


class Normalize:
    """Unicode normalization, per-line whitespace cleanup and blank-line collapsing."""

    def __init__(self, form: str = "NFC"):
        self.form = form

    def clean(self, text: str) -> str:
        text = unicodedata.normalize(self.form, text).replace("\r\n", "\n").replace("\r", "\n")
        lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
        return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()

    def __call__(self, batch: pa.Table) -> pa.Table:
        return map_text(batch, self.clean)


def map_text(batch: pa.Table, fn, *per_row: list) -> pa.Table:
    """Apply fn(text, *per-row values) to every row not dropped yet (quarantined rows keep their raw content)."""
    done = already_dropped(batch)
    rows = zip(batch["text"].to_pylist(), done, *per_row)
    cleaned = [row[0] if row[1] else fn(row[0], *row[2:]) for row in rows]
    return batch.set_column(batch.schema.get_field_index("text"), "text", pa.array(cleaned, pa.string()))


class MinLength:
    """Marks documents shorter than `min_chars` characters."""

    reason = "min_chars"

    def __init__(self, min_chars: int):
        self.min_chars = min_chars

    def __call__(self, batch: pa.Table) -> pa.Table:
        short = pc.less(pc.utf8_length(batch["text"]), self.min_chars)
        return mark_dropped(batch, short, self.reason)


def mark_dropped(batch: pa.Table, mask: pa.Array, reason: str) -> pa.Table:
    """Set drop_reason where mask holds and no earlier filter already dropped the row."""
    return add_drop_reasons(batch, [reason if m else None for m in mask.to_pylist()])


def add_drop_reasons(batch: pa.Table, reasons: list[str | None]) -> pa.Table:
    """Record each row's drop reason; a row already dropped keeps the reason of the filter that dropped it first."""
    if "drop_reason" not in batch.column_names:
        return batch.append_column("drop_reason", pa.array(reasons, pa.string()))
    merged = pa.array([old or new for old, new in zip(batch["drop_reason"].to_pylist(), reasons)], pa.string())
    return batch.set_column(batch.schema.get_field_index("drop_reason"), "drop_reason", merged)


def already_dropped(batch: pa.Table) -> list[bool]:
    if "drop_reason" not in batch.column_names:
        return [False] * len(batch)
    return [r is not None for r in batch["drop_reason"].to_pylist()]


_RANK = {"smallest_id": [], "longest": [("_length", "descending")], "quality": [("quality_score", "descending")],
         "latest": [("captured_at", "descending")]}


def best_first(rows: pa.Table, group: str, keep: str) -> tuple[pa.Table, np.ndarray]:
    """Rows sorted by `group`, the best of each group first by the keep rule (smallest_id, longest, quality,
    latest; a missing score or date ranks last, ties go to the smallest id: deterministic whatever the block
    order), and the mask of each group's first row. `longest` reads `_length` (`keep_keys`) or else `text`."""
    measured = keep == "longest" and "_length" not in rows.column_names
    if measured:
        rows = rows.append_column("_length", pc.utf8_length(rows["text"]))
    rows = rows.sort_by([(group, "ascending"), *_RANK[keep], ("id", "ascending")], null_placement="at_end")
    if measured:
        rows = rows.drop_columns(["_length"])
    keys = rows[group].to_numpy(zero_copy_only=False)
    first = np.ones(len(rows), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    return rows, first


def keep_keys(batch: pa.Table, columns: list[str], keep: str) -> pa.Table:
    """Key rows that leave the text behind: `columns` of the batch and what the keep rule compares (`best_first`):
    `_length` for longest, `quality_score` for quality, `captured_at` for latest, nothing more for smallest_id."""
    keys = batch.select(columns)
    if keep == "longest":
        return keys.append_column("_length", pc.utf8_length(batch["text"]))
    column = {"quality": "quality_score", "latest": "captured_at"}.get(keep)
    return keys.append_column(column, batch[column]) if column else keys


class ExactKeys:
    """Documents -> their exact-dedup key rows: `content_hash` (sha1 of the normalized text), `id`, `_row` and the
    keep rule's score."""

    def __init__(self, keep: str):
        self.keep = keep

    def __call__(self, batch: pa.Table) -> pa.Table:
        hashes = [hashlib.sha1(t.encode("utf-8")).hexdigest() for t in batch["text"].to_pylist()]
        return keep_keys(batch.append_column("content_hash", pa.array(hashes, pa.string())),
                         ["content_hash", "id", ROW], self.keep)


def exact_copies(keep: str = "smallest_id"):
    """Key rows of one part (`ExactKeys`) -> for every text found more than once, a row per copy: `_row`,
    `duplicates` (how many copies there are) and `is_copy` (false for the one the keep rule picks)."""
    def pick(group: pa.Table) -> pa.Table:
        rows, first = best_first(group, "content_hash", keep)
        starts = np.flatnonzero(first)
        copies = np.diff(np.append(starts, len(rows)))
        per_row = np.repeat(copies, copies)
        repeated = per_row > 1
        return pa.table({ROW: rows[ROW].filter(pa.array(repeated)),
                         "duplicates": pa.array(per_row[repeated], pa.int64()),
                         "is_copy": pa.array(~first[repeated])})
    return pick


def best_of_cluster(keep: str):
    """Rows of one part, with `cluster_id` -> the same rows, `cluster_id` now the id of the member the keep rule
    picks (the one that stays)."""
    def pick(group: pa.Table) -> pa.Table:
        rows, first = best_first(group, "cluster_id", keep)
        starts = np.flatnonzero(first)
        best = rows["id"].take(pa.array(np.repeat(starts, np.diff(np.append(starts, len(rows))))))
        return rows.set_column(rows.schema.get_field_index("cluster_id"), "cluster_id", best)
    return pick


def unit_hash(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for a string: the same on every worker, run and cluster."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


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
