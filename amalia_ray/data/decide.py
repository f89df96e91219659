"""Decisions taken on keys, applied where the documents are: which capture of a page stays, which copy of a text,
which member of a near-duplicate cluster. Only key rows move (a URL, a content hash, a cluster label, the score a
keep rule compares, and `_row`, where the document is); each document's text stays in its block and is written once.

`decide` runs three steps over a materialized dataset of B blocks:
1. every block gives its key rows, `_row` = block index << 32 | row index (a fixed-width key, whatever the ids);
2. one keyed exchange brings every row of a key together and `decide_fn` returns the decisions (`_row` and the
   columns to set), usually only for the rows it changes;
3. the decisions go back to their blocks (a routing exchange with one part per block) and each block sets them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data.block import BlockAccessor

from amalia_ray.data.partitions import LEDGER, MAX_MAP_BYTES, ExchangePlan, exchange

ROW = "_row"
_LOW = np.int64(0xFFFFFFFF)


def block_refs(ds: ray.data.Dataset) -> list:
    return [ref for bundle in ds.iter_internal_ref_bundles() for ref in bundle.block_refs]


def decide(docs: ray.data.Dataset, keys: Callable[[pa.Table], pa.Table], key: str,
           decide_fn: Callable[[pa.Table], pa.Table], apply_fn: Callable[[pa.Table, pa.Table], pa.Table],
           others: list[ray.data.Dataset] | None = None) -> ray.data.Dataset:
    """`keys(block with a _row column)` -> key rows (keeping `_row`); `decide_fn(every key row of some keys)` ->
    decision rows (`_row` and the columns to set); `apply_fn(block, its decisions with _row = the row's index)` ->
    the new block. `others`: more key rows (same schema, `_row` null) for the exchange, e.g. a lookup table to join.
    Returns the documents in their block order."""
    blocks = block_refs(docs)
    if not blocks:
        return docs
    keys_ref = ray.put(keys)
    key_rows = ray.data.from_arrow_refs([_key_rows.remote(keys_ref, i, ref) for i, ref in enumerate(blocks)])
    decisions = exchange([key_rows, *(others or [])], key, decide_fn)
    return apply_to_blocks(blocks, decisions, apply_fn)


@ray.remote
def _key_rows(keys: Callable[[pa.Table], pa.Table], index: int, block) -> pa.Table:
    table = _arrow(block)
    rows = pa.array((np.int64(index) << np.int64(32)) + np.arange(len(table), dtype=np.int64))
    return keys(table.append_column(ROW, rows))


def apply_to_blocks(blocks: list, decisions: ray.data.Dataset, apply_fn: Callable[[pa.Table, pa.Table], pa.Table]
                    ) -> ray.data.Dataset:
    """Each block with its decisions applied (`apply_fn(block, decisions)`, `_row` there the row's index)."""
    sizes, refs = [], []
    for bundle in decisions.iter_internal_ref_bundles():
        for ref, meta in zip(bundle.block_refs, bundle.metadata):
            refs.append(ref)
            sizes.append(meta.size_bytes or 0)
    apply_ref = ray.put(apply_fn)
    # decisions are a few numbers per changed document: few map tasks, each cutting one piece per block
    groups, group, size = [], [], 0
    for i, n in enumerate(sizes):
        group.append(i)
        size += n
        if size >= MAX_MAP_BYTES:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    plan = ExchangePlan(len(blocks), tuple(tuple(g) for g in groups), sum(sizes))
    LEDGER.add(plan)
    cuts = [_route.options(num_returns=plan.parts + 1).remote(plan.parts, *[refs[i] for i in g])
            for g in plan.map_groups]
    if plan.parts == 1:  # a single block: the cut's one piece is its decisions
        return ray.data.from_arrow_refs([_apply_block.remote(apply_ref, blocks[0], *[c[0] for c in cuts])])
    return ray.data.from_arrow_refs([_apply_block.remote(apply_ref, block, *[cut[i] for cut in cuts])
                                     for i, block in enumerate(blocks)])


@ray.remote
def _route(blocks: int, *tables) -> tuple:
    """Decision tables -> their rows for block 0, 1, …, blocks-1, then the count for each (as exchange's cut)."""
    tables = [t for t in map(_arrow, tables) if len(t)]
    if not tables:
        return (*[pa.table({ROW: pa.array([], pa.int64())})] * blocks, np.zeros(blocks, np.int64))
    table = pa.concat_tables(tables, promote_options="permissive")
    rows = table[ROW].to_numpy()
    block = (rows >> np.int64(32)).astype(np.int64)
    sizes = np.bincount(block, minlength=blocks)
    order = np.argsort(block, kind="stable")
    table = table.take(pa.array(order)).set_column(table.schema.get_field_index(ROW), ROW,
                                                    pa.array(rows[order] & _LOW))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return (*[table.slice(starts[i], sizes[i]) for i in range(blocks)], sizes)


@ray.remote
def _apply_block(apply_fn: Callable[[pa.Table, pa.Table], pa.Table], block, *pieces) -> pa.Table:
    pieces = [p for p in map(_arrow, pieces) if len(p)]
    decisions = (pa.concat_tables(pieces, promote_options="permissive") if len(pieces) > 1 else pieces[0]) \
        if pieces else None
    return apply_fn(_arrow(block), decisions)


def set_columns(block: pa.Table, decisions: pa.Table | None, defaults: dict[str, pa.Scalar] | None = None
                ) -> pa.Table:
    """The block with each decision column's values set at the decided rows; a column the block lacks is added,
    `defaults[name]` (or null) elsewhere."""
    defaults = defaults or {}
    names = [c for c in (decisions.column_names if decisions is not None else defaults) if c != ROW]
    if decisions is None or not len(decisions):
        for name in names:
            if name not in block.column_names:
                block = block.append_column(name, pa.repeat(defaults.get(name), len(block)))
        return block
    at = np.full(len(block), -1, np.int64)
    at[decisions[ROW].to_numpy()] = np.arange(len(decisions))
    decided = pa.array(at >= 0)
    index = pa.array(np.maximum(at, 0))
    for name in names:
        new = decisions[name].take(index)
        if name in block.column_names:
            old = block[name]
            block = block.set_column(block.schema.get_field_index(name), name,
                                     pc.if_else(decided, new, old.cast(new.type)))
        else:
            fill = defaults.get(name)
            base = pa.repeat(fill if fill is not None else pa.scalar(None, new.type), len(block)).cast(new.type)
            block = block.append_column(name, pc.if_else(decided, new, base))
    return block


def _arrow(block) -> pa.Table:
    return block if isinstance(block, pa.Table) else BlockAccessor.for_block(block).to_arrow()
