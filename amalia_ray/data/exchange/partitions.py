"""Keyed exchanges sized by bytes (`exchange`): one call of a vectorized function (pyarrow/polars) sees every row
whose key hashes to its part, a hash shuffle on Ray tasks. Ray Data's `map_groups` calls Python once per distinct
key, which for millions of singleton keys (LSH buckets, graph nodes) costs more than the work itself. `map_blocks`
maps a dataset's blocks with Ray tasks, for the hashing steps; `count_by` counts rows per key with a group-by per
block, summed here (no shuffle).

Also here: the data context every data stage runs under (order preserved) and deterministic shard file names."""

from __future__ import annotations

import bisect

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa
import ray
from ray.data.block import BlockAccessor
from ray.data.context import ShuffleStrategy
from ray.data.datasource import FilenameProvider

from amalia_ray.data.exchange.staged import Staged, StagedFile, write_staged


class ShardNames(FilenameProvider):
    """`part-000000.parquet`, … by write task: with order preserved, the same input writes the same files under the
    same names, so a stage's output hash is the same run after run (Ray's default names carry random ids)."""

    def __init__(self):
        super().__init__(file_format="parquet")

    def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
        return f"part-{task_index:06}.parquet"


ROWS_PER_SHARD = 50_000


def write_shards(ds: ray.data.Dataset, path: Path | str) -> None:
    """Parquet files named by write task, into a folder of its own (each stage writes a fresh temporary one):
    OVERWRITE is what lets the names leave out Ray's random write id."""
    ds.write_parquet(str(path), filename_provider=ShardNames(), mode=ray.data.SaveMode.OVERWRITE)


# blocks being written by `stage` at once: the executor streams on while they are written, and no more than these
# wait in the object store
STAGE_WRITES_IN_FLIGHT = 16


def stage(ds: ray.data.Dataset, folder: Path | str) -> Staged:
    """The dataset written to `folder` (a scratch folder of the stage's) as one Parquet file per block, in order: the
    documents of one pass, which later passes read back a file at a time (staged.py: why). Streamed: each block is
    written by a task as Ray Data produces it, with at most STAGE_WRITES_IN_FLIGHT waiting."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written, pending = [], []
    for bundle in ds.iter_internal_ref_bundles():
        for ref, meta in zip(bundle.block_refs, bundle.metadata):
            if meta.num_rows == 0:
                continue
            pending.append(_write_block.remote(ref, str(folder / f"part-{len(written) + len(pending):06}.parquet")))
            if len(pending) > STAGE_WRITES_IN_FLIGHT:
                ray.wait(pending[:1])
                written.append(pending.pop(0))
    files = tuple(ray.get(written + pending))
    if files:
        return Staged(files)
    schema = ds.schema()  # Ray Data's schema: the pyarrow one is its base
    return Staged(files, schema.base_schema if schema is not None else None)


@ray.remote
def _write_block(block, path: str) -> StagedFile:
    return write_staged(as_table(block), path)


def write_ordered_shards(ds: ray.data.Dataset | Staged, path: Path | str, rows_per_file: int = ROWS_PER_SHARD,
                         rows_per_group: int | None = None) -> int:
    """The dataset's rows, in order, as `part-000000.parquet`, … of `rows_per_file` rows each (row groups of
    `rows_per_group` rows, default one per file; the last file fewer): the same rows give the same files whatever
    blocks Ray Data cut them into (the writer groups blocks into files as they come). Outputs that a later stage
    reads in file order (the curated corpus, the packed sequences) go through here, so their content
    hashes, and what training reads, repeat run after run. One Ray task per file. Returns the row count."""
    if isinstance(ds, Staged):  # the files' footers give their rows: nothing is read until a file is written
        refs, schema = list(ds.files), ds.unified_schema
        shapes = [(f.rows, schema) for f in refs]
    else:
        refs = ds.to_arrow_refs()
        shapes = ray.get([_shape.remote(r) for r in refs])
        schema = pa.unify_schemas([s for _, s in shapes], promote_options="permissive") if shapes else ds.schema()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    total, starts, ends = 0, [], []
    for n, _ in shapes:
        starts.append(total)
        total += n
        ends.append(total)
    jobs = []
    for index, lo in enumerate(range(0, total, rows_per_file)):
        hi = min(lo + rows_per_file, total)
        # the inputs overlapping [lo, hi): from the first that ends past lo (found by bisection, so the whole is
        # linear in inputs + outputs, not their product) to the last that starts before hi
        first = bisect.bisect_right(ends, lo)
        last = bisect.bisect_left(starts, hi, lo=first)
        chosen = [(refs[i], (max(lo - starts[i], 0), min(hi - starts[i], shapes[i][0]))) for i in range(first, last)]
        jobs.append(_write_file.remote(str(folder / f"part-{index:06}.parquet"), schema, [c for _, c in chosen],
                                       rows_per_group, *[r for r, _ in chosen]))
    if total == 0:
        jobs.append(_write_file.remote(str(folder / "part-000000.parquet"), schema, [], None))
    ray.get(jobs)
    return total


@ray.remote(num_cpus=0.25)
def _shape(table: pa.Table) -> tuple[int, pa.Schema]:
    return table.num_rows, table.schema


@ray.remote(num_cpus=0.5)
def _write_file(path: str, schema, cuts: list[tuple[int, int]], rows_per_group: int | None,
                *tables: pa.Table) -> None:
    import pyarrow.parquet as pq

    # a staged file is read for its cut's row groups only (a file spanning two shards is not read whole twice)
    parts = [(t.read(a, b - a) if isinstance(t, StagedFile) else as_table(t).slice(a, b - a))
             .select(schema.names).cast(schema) for t, (a, b) in zip(tables, cuts)]
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    pq.write_table(table, path, row_group_size=rows_per_group or max(1, table.num_rows))


def configure_data_context() -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    # Ray Data's own shuffles, where still used (the dedup command's cluster file sorted by id), sort-based: on a
    # small cluster the hash shuffle's aggregator actors cost seconds per shuffle and hold CPUs
    ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    # Ray Data's default splits reads into >= 200 blocks; on a small cluster the per-task overhead then dominates.
    # Two blocks per CPU keeps every core busy; large files are still split by the 128 MiB block-size target.
    ctx.read_op_min_num_blocks = 2 * int(ray.cluster_resources().get("CPU", 1))


def part_of(values: pa.Array | pa.ChunkedArray, partitions: int) -> pa.Array:
    """Stable part number (int32) of every value: seeded polars hash modulo `partitions`."""
    if len(values) == 0:
        return pa.array([], pa.int32())
    hashed = pl.Series(values).hash(seed=0).to_numpy()
    return pa.array((hashed % np.uint64(partitions)).astype(np.int32))


def map_blocks(ds: ray.data.Dataset | Staged, fn: Callable[[pa.Table], pa.Table], batch_rows: int | None = None,
               out: Path | None = None) -> ray.data.Dataset | Staged:
    """fn(batch) over every block of a dataset, one Ray task per slice of `batch_rows` rows (or per block), as a
    dataset in block order (executes `ds`). Staged documents are mapped a file per task, each task reading its own
    file; with `out`, each task writes its result there as a file of its own, and the result is staged too.

    For the CPU-heavy steps of deduplication over a dataset that is materialized anyway. Ray Data's executor learns
    the CPUs it may use from an autoscaling-coordinator actor, asynchronously and at most once a second, so every
    execution starts believing it has none and runs one task alone until the answer comes: on 2 CPUs, four
    one-second map tasks take 3.2 s instead of 2 (bench/dedup_vs_datatrove.py runs about twenty executions)."""
    fn_ref = ray.put(fn)  # serialized once, not once per task (fn may carry a large lookup table)
    tasks = []
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    for index, (ref, meta) in enumerate(_row_blocks(ds)):
        if out is not None:
            tasks.append(_map_to_file.remote(fn_ref, ref, str(Path(out) / f"part-{index:06}.parquet")))
        elif not batch_rows or meta.num_rows is None:  # one task for the block
            tasks.append(_map_slice.remote(fn_ref, ref))
        else:  # a task a slice, not a block: a few large blocks on two workers leave one idle at the end
            tasks.extend(_map_slice.remote(fn_ref, ref, lo, batch_rows)
                         for lo in range(0, max(meta.num_rows, 1), batch_rows))
    if out is not None:
        return Staged(tuple(ray.get(tasks)))
    return ray.data.from_arrow_refs(tasks)


@ray.remote
def _map_slice(fn: Callable[[pa.Table], pa.Table], block: pa.Table, start: int = 0, rows: int | None = None
               ) -> pa.Table:
    if isinstance(block, StagedFile):  # only the row groups of the slice are read
        return fn(block.read(start, rows))
    block = as_table(block)
    return fn(block.slice(start, rows) if rows is not None else block)


@ray.remote
def _map_to_file(fn: Callable[[pa.Table], pa.Table], block, path: str) -> StagedFile:
    return write_staged(fn(as_table(block)), path)


# An exchange's sizes. A part (the rows one reduce task holds) carries at least MIN_PART_BYTES while the cluster has
# CPUs to spare, so small runs still spread over the cores, and at most about sqrt(total × PIECE_BYTES): the part
# count and the map-task count then both grow as the square root of the bytes exchanged, and so does every piece
# (a map task's rows of one part), which stays >= PIECE_BYTES from about 100 MB of input on. Objects created:
# map tasks × (parts + 1), about total / PIECE_BYTES at scale (1 TB: ~1 M objects of 1 MB; a hash shuffle of one
# task per block and two parts per CPU made 7,500 × 1,281 of ~100 KB, held by the driver). A piece under Ray's
# inline limit (100 KB) is kept by the driver: only small exchanges make such pieces.
PIECE_BYTES = 1 << 20
MIN_PART_BYTES = 8 << 20
BASE_PART_BYTES = 128 << 20
MIN_MAP_BYTES = 64 << 20
MAX_MAP_BYTES = 2 << 30
# a part (or a map task's input) this large gets its memory reserved from Ray's scheduler (3x: its pieces or
# blocks, their concatenation, the output)
RESERVE_OVER_BYTES = 256 << 20


@dataclass(frozen=True)
class ExchangePlan:
    """How an exchange cuts its input: `map_groups` lists, per map task, the input blocks it reads (consecutive,
    in block order), and each map task cuts its rows into `parts` pieces."""

    parts: int
    map_groups: tuple[tuple[int, ...], ...]
    total_bytes: int

    @property
    def objects(self) -> int:
        """Ray objects the exchange creates: each map task's pieces and its row counts, then one result per part."""
        return (len(self.map_groups) * (self.parts + 1) if self.parts > 1 else 0) + self.parts


class ExchangeLedger:
    """What this process's exchanges moved, one entry per exchange: the data stage reports those of its run."""

    def __init__(self):
        self.entries: list[tuple[int, int, int, int]] = []  # bytes, objects, bytes of the largest part, parts

    def add(self, plan: ExchangePlan) -> None:
        self.entries.append((plan.total_bytes, plan.objects, plan.total_bytes // max(1, plan.parts), plan.parts))

    def mark(self) -> int:
        return len(self.entries)

    def since(self, mark: int) -> dict:
        entries = self.entries[mark:]
        return {"exchanges": len(entries), "bytes": sum(e[0] for e in entries),
                "objects": sum(e[1] for e in entries), "largest_part_bytes": max((e[2] for e in entries), default=0),
                "parts": sum(e[3] for e in entries)}


LEDGER = ExchangeLedger()


def plan_exchange(block_bytes: list[int], cpus: int) -> ExchangePlan:
    """The parts and map tasks of an exchange of blocks of these sizes on a cluster of `cpus` CPUs."""
    total = int(sum(block_bytes))
    part_bytes = max(BASE_PART_BYTES, int(math.sqrt(total * PIECE_BYTES)))
    parts = max(1, -(-total // part_bytes), min(int(cpus), total // MIN_PART_BYTES))
    map_bytes = min(max(MIN_MAP_BYTES, parts * PIECE_BYTES), MAX_MAP_BYTES)
    return ExchangePlan(parts, consecutive_runs(block_bytes, map_bytes), total)


def consecutive_runs(block_bytes: list[int], target: int) -> tuple[tuple[int, ...], ...]:
    """Block indices in runs of consecutive blocks of at least `target` bytes each (the last one less)."""
    runs, run, size = [], [], 0
    for i, n in enumerate(block_bytes):
        run.append(i)
        size += n
        if size >= target:
            runs.append(tuple(run))
            run, size = [], 0
    if run:
        runs.append(tuple(run))
    return tuple(runs)


def _row_blocks(ds: ray.data.Dataset) -> list:
    """(block reference, metadata) of each block of a dataset that has rows, in order (executes it), or of its
    first block when none has. Ray Data's map_batches turns a block with no rows into one with no columns either
    (a read task over a byte range that holds no record's start makes one): such blocks are left out."""
    if isinstance(ds, Staged):
        listed = [(f, _FileMeta(f.rows, f.nbytes)) for f in ds.files]
    else:
        listed = [(ref, meta) for bundle in ds.iter_internal_ref_bundles()
                  for ref, meta in zip(bundle.block_refs, bundle.metadata)]
    return [(ref, meta) for ref, meta in listed if meta.num_rows != 0] or listed[:1]


@dataclass(frozen=True)
class _FileMeta:
    num_rows: int
    size_bytes: int


def block_refs(ds: ray.data.Dataset | Staged) -> list[tuple[ray.ObjectRef | StagedFile, int]]:
    """(block reference, bytes) of each block of a dataset that has rows, in order (executes it); of staged
    documents, each file that has rows (read by the task it is given to)."""
    return [(ref, meta.size_bytes or 0) for ref, meta in _row_blocks(ds)]


def as_table(block) -> pa.Table:
    """A block as an Arrow table (Ray Data may hand a pandas block; a staged file is read here, in the task)."""
    if isinstance(block, StagedFile):
        return block.read()
    return block if isinstance(block, pa.Table) else BlockAccessor.for_block(block).to_arrow()


def split_by(table: pa.Table, part: np.ndarray, parts: int) -> tuple:
    """A table's rows of part 0, 1, …, parts-1 (each in table order), then the row count of each part: what a map
    task returns (num_returns = parts + 1)."""
    sizes = np.bincount(part, minlength=parts)
    ordered = table.take(pa.array(np.argsort(part, kind="stable")))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return (*[ordered.slice(starts[i], sizes[i]) for i in range(parts)], sizes)


def concat_filled(tables: list) -> pa.Table:
    """The non-empty tables of a list concatenated (the first, empty one when all are empty; no columns at all when
    the list is empty)."""
    tables = [as_table(t) for t in tables]
    filled = [t for t in tables if len(t)] or tables[:1] or [pa.table({})]
    return pa.concat_tables(filled, promote_options="permissive") if len(filled) > 1 else filled[0]


def exchange(ds: ray.data.Dataset | list[ray.data.Dataset], key: str, fn: Callable[[pa.Table], pa.Table],
             plan: ExchangePlan | None = None) -> ray.data.Dataset:
    """fn(every row whose `key` hashes to one part) for each non-empty part of a dataset (or of several with one
    schema), as a dataset whose blocks come in part order (executes `ds`).

    The number of parts and of map tasks comes from the bytes exchanged (`plan_exchange`), not from the cluster's
    CPUs: each map task reads a run of blocks and cuts its rows into one piece per part, each part's task
    concatenates its pieces in block order (so the result is deterministic) and applies `fn`. The pieces live in
    the object store and spill like Ray Data's blocks; a part is held in memory by one task, as with map_groups.
    Rows with a null key form a part of their own hash, like any other value."""
    listed = [b for one in (ds if isinstance(ds, list) else [ds]) for b in block_refs(one)]
    if not listed:
        return ds[0] if isinstance(ds, list) else ds
    blocks, sizes = [ref for ref, _ in listed], [size for _, size in listed]
    plan = plan or plan_exchange(sizes, int(ray.cluster_resources().get("CPU", 1)))
    LEDGER.add(plan)
    fn_ref = ray.put(fn)  # serialized once, not once per task
    if plan.parts == 1:  # nothing to cut: one task sees every row
        return ray.data.from_arrow_refs([_reserved(_apply, plan.total_bytes).remote(fn_ref, *blocks)])
    cuts = [_reserved(_cut, sum(sizes[i] for i in group), num_returns=plan.parts + 1).remote(
        key, plan.parts, *[blocks[i] for i in group]) for group in plan.map_groups]
    counts = np.sum(ray.get([cut[-1] for cut in cuts]), axis=0)
    part_bytes = plan.total_bytes // plan.parts
    results = [_reserved(_apply, part_bytes).remote(fn_ref, *[cut[part] for cut in cuts])
               for part in range(plan.parts) if counts[part]]
    if not results:  # no rows at all: fn's output schema still comes from fn
        results = [_apply.remote(fn_ref, *[cut[0] for cut in cuts])]
    return ray.data.from_arrow_refs(results)


def _reserved(task, nbytes: int, **options):
    if nbytes > RESERVE_OVER_BYTES:
        options["memory"] = 3 * nbytes
    return task.options(**options) if options else task


@ray.remote
def _cut(key: str, partitions: int, *blocks) -> tuple:
    """Blocks -> their rows of part 0, 1, …, partitions-1 (in block order), then the row count of each part."""
    table = concat_filled(list(blocks))
    if not len(table):
        return (*[table] * partitions, np.zeros(partitions, np.int64))
    return split_by(table, part_of(table[key], partitions).to_numpy(), partitions)


@ray.remote
def _apply(fn: Callable[[pa.Table], pa.Table], *pieces) -> pa.Table:
    table = concat_filled(list(pieces))
    return fn(table) if table.num_columns else table  # no columns: empty blocks only, nothing for fn to see


def count_by(ds: ray.data.Dataset | Staged, columns: list[str]) -> list[dict]:
    """Rows per distinct value of `columns` (nulls counted as a value), as dicts of those columns and `count`:
    one pyarrow group-by per block, summed here. A report's counts have few distinct values: no shuffle (Ray Data's
    groupby().count() sorts the whole dataset, every block's map output to every reducer)."""
    if isinstance(ds, Staged):
        ds = ds.select(columns)
    tables = [t for t in ray.get([_count.remote(columns, ref) for ref, _ in block_refs(ds)]) if len(t)]
    if not tables:
        return []
    total = pa.concat_tables(tables, promote_options="permissive").group_by(columns).aggregate([("count", "sum")])
    return [{**{c: row[c] for c in columns}, "count": int(row["count_sum"])} for row in total.to_pylist()]


@ray.remote(num_cpus=0.25)
def _count(columns: list[str], block) -> pa.Table:
    table = as_table(block)
    if not len(table):  # an empty block may have no columns at all
        return pa.table({})
    return table.select(columns).group_by(columns).aggregate([([], "count_all")]).rename_columns([*columns, "count"])
