"""Cleaning and filtering steps over Arrow batches. Each step is a small callable; the stage chains them.

Filters do not delete: they fill `drop_reason`, so the stage can report kept/dropped counts per filter and source
and keep the dropped documents aside instead of losing them.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

import pyarrow as pa
import pyarrow.compute as pc

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
        cleaned = [self.clean(t) for t in batch["text"].to_pylist()]
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
    if "drop_reason" not in batch.column_names:
        batch = batch.append_column("drop_reason", pa.nulls(len(batch), pa.string()))
    current = batch["drop_reason"]
    new = pc.if_else(pc.and_(mask, pc.is_null(current)), pa.scalar(reason), current)
    return batch.set_column(batch.schema.get_field_index("drop_reason"), "drop_reason", new)


class ContentHash:
    """Adds `content_hash`: sha1 of the normalized text, the key of exact deduplication."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        hashes = [hashlib.sha1(t.encode("utf-8")).hexdigest() for t in batch["text"].to_pylist()]
        return batch.append_column("content_hash", pa.array(hashes, pa.string()))


def keep_first_of_group(group: pa.Table) -> pa.Table:
    """Within one content_hash group keep the smallest id (deterministic whatever the block order) and record how
    many copies there were."""
    ids = group["id"].to_pylist()
    first = min(range(len(ids)), key=ids.__getitem__)
    return group.slice(first, 1).append_column("duplicates", pa.array([len(ids)], pa.int64()))


def is_validation(doc_id: str, fraction: float) -> bool:
    """Stable train/validation split by document id, independent of block order and worker count."""
    bucket = int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "big") / 2**64
    return bucket < fraction


def shuffle_partitions(requested: int | None = None) -> int:
    """Partitions for groupby shuffles: Ray Data's default (200) schedules hundreds of tiny tasks on a laptop;
    two per CPU of the cluster keeps every core busy without that overhead. Large corpora set it explicitly."""
    if requested:
        return requested
    import ray

    return max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
