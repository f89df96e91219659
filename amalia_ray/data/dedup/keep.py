"""The keep rules every duplicate decision uses (which capture of a page, which copy of a text, which member of a
near-duplicate cluster stays): smallest_id, longest, quality, latest, deterministic whatever the block order; and
the exact-copy keys (sha1 of the normalized text) exact dedup decides on."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from amalia_ray.data.exchange.decide import ROW

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
