"""Decontamination as a data-stage step: every document that shares word n-grams with a benchmark item is dropped
(`contamination:<task>`) or flagged; its `contamination` column lists the items (`<task>/<item id>`)."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa

from amalia_ray.core.ngrams import ItemIndex
from amalia_ray.data.steps.base import DocumentStep, add_drop_reasons, already_dropped


class Decontaminate(DocumentStep):
    def __init__(self, index: ItemIndex, min_overlap: int, action: str):
        self.index, self.min_overlap, self.action = index, min_overlap, action

    def __call__(self, batch: pa.Table) -> pa.Table:
        done = already_dropped(batch)
        found = [None if d else self.index.overlaps(t, self.min_overlap)
                 for t, d in zip(batch["text"].to_pylist(), done)]
        listed = [[f"{self.index.items[i][0]}/{self.index.items[i][1]}" for i in f] if f else None for f in found]
        batch = batch.append_column("contamination", pa.array(listed, pa.list_(pa.string())))
        if self.action != "drop":
            return batch
        return add_drop_reasons(batch, [f"contamination:{self.index.items[f[0]][0]}" if f else None for f in found])


def contamination_report(index: ItemIndex, flagged: Iterable[list[str]], tasks: dict[str, int]) -> dict:
    """Per task: its items, how many were checked, how many overlap some document, how many documents overlap."""
    items: dict[str, set[str]] = {t: set() for t in tasks}
    docs: dict[str, int] = {t: 0 for t in tasks}
    for entries in flagged:
        for task in {e.split("/", 1)[0] for e in entries}:
            docs[task] += 1
        for e in entries:
            task, item = e.split("/", 1)
            items[task].add(item)
    return {t: {"items": n, "items_checked": n - index.too_short.get(t, 0), "items_overlapping": len(items[t]),
                "documents_overlapping": docs[t]} for t, n in tasks.items()}
