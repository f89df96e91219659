"""Decisions taken on keys, applied where the documents are: which capture of a page stays, which copy of a text,
which member of a near-duplicate cluster. Only key rows move (a URL, a content hash, a cluster label, the score a
keep rule compares, and `_row`, where the document is); each document's text stays in its block and is written once.

`decide` runs three steps over a materialized dataset of B blocks:
1. every block gives its key rows, `_row` = block index << 32 | row index (a fixed-width key, whatever the ids);
2. one keyed exchange brings every row of a key together and `decide_fn` returns the decisions (`_row` and the
   columns to set), usually only for the rows it changes;
3. the decisions go back to their blocks (a routing exchange with one part per block) and each block sets them.

The documents may be staged (staged.py): each block is then a file, read by the task that takes its keys and again
by the one that applies its decisions, and with `out` the decided documents are written as files there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from amalia_ray.data.exchange.partitions import (
    LEDGER,
    MAX_MAP_BYTES,
    ExchangePlan,
    as_table,
    block_refs,
    concat_filled,
    consecutive_runs,
    exchange,
    split_by,
)
from amalia_ray.data.exchange.staged import Staged, write_staged

ROW = "_row"
_LOW = np.int64(0xFFFFFFFF)


def decide(docs: ray.data.Dataset | Staged, keys: Callable[[pa.Table], pa.Table], key: str,
           decide_fn: Callable[[pa.Table], pa.Table], apply_fn: Callable[[pa.Table, pa.Table], pa.Table],
           others: list[ray.data.Dataset] | None = None, out: Path | None = None) -> ray.data.Dataset | Staged:
    """`keys(block with a _row column)` -> key rows (keeping `_row`); `decide_fn(every key row of some keys)` ->
    decision rows (`_row` and the columns to set); `apply_fn(block, its decisions with _row = the row's index)` ->
    the new block. `others`: more key rows (same schema, `_row` null) for the exchange, e.g. a lookup table to join.
    Returns the documents in their block order; with `out`, staged there."""
    blocks = [ref for ref, _ in block_refs(docs)]
    if not blocks:
        return docs
    keys_ref = ray.put(keys)
    key_rows = ray.data.from_arrow_refs([_key_rows.remote(keys_ref, i, ref) for i, ref in enumerate(blocks)])
    decisions = exchange([key_rows, *(others or [])], key, decide_fn)
    return apply_to_blocks(blocks, decisions, apply_fn, out)


@ray.remote
def _key_rows(keys: Callable[[pa.Table], pa.Table], index: int, block) -> pa.Table:
    table = as_table(block)
    if not table.num_columns:  # an empty block may have no columns: it has no keys either
        return pa.table({})
    rows = pa.array((np.int64(index) << np.int64(32)) + np.arange(len(table), dtype=np.int64))
    return keys(table.append_column(ROW, rows))


# a routing piece is at least this large (when there are enough decisions): over Ray's 100 KB inline limit, so the
# pieces live in the object store, not in the driver's memory
ROUTE_PIECE_BYTES = 256 << 10


def apply_to_blocks(blocks: list, decisions: ray.data.Dataset, apply_fn: Callable[[pa.Table, pa.Table], pa.Table],
                    out: Path | None = None) -> ray.data.Dataset | Staged:
    """Each block with its decisions applied (`apply_fn(block, decisions)`, `_row` there the row's index); with
    `out`, each written there as a file by its task (staged).

    The decisions are cut by runs of consecutive blocks, as many blocks to a run as keep a piece over
    ROUTE_PIECE_BYTES; each block's task reads its run's pieces and keeps its own rows."""
    listed = block_refs(decisions)
    refs, sizes = [ref for ref, _ in listed], [size for _, size in listed]
    apply_ref = ray.put(apply_fn)
    groups = consecutive_runs(sizes, MAX_MAP_BYTES)  # decisions are a few numbers per changed document: few tasks
    total = sum(sizes)
    runs = max(1, min(len(blocks), total // (max(1, len(groups)) * ROUTE_PIECE_BYTES)))
    per_run = -(-len(blocks) // runs)
    plan = ExchangePlan(-(-len(blocks) // per_run), groups, total)
    LEDGER.add(plan)
    cuts = [_route.options(num_returns=plan.parts + 1).remote(plan.parts, per_run, *[refs[i] for i in g])
            for g in plan.map_groups]
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        return Staged(tuple(ray.get([
            _apply_to_file.remote(apply_ref, i, block, str(Path(out) / f"part-{i:06}.parquet"),
                                  *[cut[i // per_run] for cut in cuts]) for i, block in enumerate(blocks)])))
    return ray.data.from_arrow_refs([_apply_block.remote(apply_ref, i, block, *[cut[i // per_run] for cut in cuts])
                                     for i, block in enumerate(blocks)])


@ray.remote
def _route(runs: int, per_run: int, *tables) -> tuple:
    """Decision tables -> their rows for the blocks of run 0, 1, …, runs-1 (`per_run` consecutive blocks each),
    then the count for each (as exchange's cut)."""
    table = concat_filled(list(tables))
    if not len(table):
        return (*[pa.table({ROW: pa.array([], pa.int64())})] * runs, np.zeros(runs, np.int64))
    return split_by(table, (table[ROW].to_numpy() >> np.int64(32)) // per_run, runs)


@ray.remote
def _apply_to_file(apply_fn: Callable[[pa.Table, pa.Table], pa.Table], index: int, block, path: str, *pieces):
    return write_staged(_applied(apply_fn, index, block, pieces), path)


@ray.remote
def _apply_block(apply_fn: Callable[[pa.Table, pa.Table], pa.Table], index: int, block, *pieces) -> pa.Table:
    return _applied(apply_fn, index, block, pieces)


def _applied(apply_fn: Callable[[pa.Table, pa.Table], pa.Table], index: int, block, pieces) -> pa.Table:
    table = concat_filled(list(pieces))
    decisions = None
    if len(table):
        rows = table[ROW].to_numpy()
        mine = (rows >> np.int64(32)) == index
        if mine.any():
            decisions = table.filter(pa.array(mine))
            decisions = decisions.set_column(decisions.schema.get_field_index(ROW), ROW,
                                             pa.array(rows[mine] & _LOW))
    return apply_fn(as_table(block), decisions)


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

