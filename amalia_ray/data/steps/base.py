"""What a step of the data stage is: a callable from an Arrow batch of documents to the same rows, their text
rewritten, columns added, or a `drop_reason` set (as datatrove's `PipelineStep`, on Arrow batches). Filters do not
delete: they fill `drop_reason`, so the stage can report kept and dropped counts per filter and source and keep
the dropped documents aside instead of losing them. The helpers below are the one way steps do that."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import ClassVar

import pyarrow as pa


class DocumentStep(ABC):
    """One step over an Arrow batch of documents (`id`, `source`, `text`, their metadata, and `drop_reason` once a
    filter ran). Ray Data runs it with `map_batches(step, batch_format="pyarrow")`, in tasks; a step that loads a
    model once per process sets `in_actors` and is run in an actor pool instead (its class is constructed there)."""

    in_actors: ClassVar[bool] = False
    init_args: tuple = ()  # what an actor of the pool constructs the step's class with (in_actors)

    @abstractmethod
    def __call__(self, batch: pa.Table) -> pa.Table:
        """The batch's rows, in order, each kept, rewritten or marked dropped."""


def map_text(batch: pa.Table, fn, *per_row: list) -> pa.Table:
    """Apply fn(text, *per-row values) to every row not dropped yet (quarantined rows keep their raw content)."""
    done = already_dropped(batch)
    rows = zip(batch["text"].to_pylist(), done, *per_row)
    cleaned = [row[0] if row[1] else fn(row[0], *row[2:]) for row in rows]
    return batch.set_column(batch.schema.get_field_index("text"), "text", pa.array(cleaned, pa.string()))


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


def unit_hash(key: str) -> float:
    """A stable pseudo-random number in [0, 1) for a string: the same on every worker, run and cluster."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
