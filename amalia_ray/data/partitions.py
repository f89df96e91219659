"""Keyed shuffles with few, large groups: rows get a `part` column (hash of a key modulo the partition count) and one
call of a vectorized function (pyarrow/polars) sees every row of its part (`per_part`, a hash shuffle on Ray tasks).
Ray Data's `map_groups` calls Python once per distinct key, which for millions of singleton keys (LSH buckets, graph
nodes) costs more than the work itself. `map_blocks` maps a dataset's blocks with Ray tasks, for the hashing steps.

Ray Data's own shuffles, where they are still used (sort), take the sort-based pull strategy: on small clusters the
default hash shuffle's aggregator actors cost seconds per shuffle and hold CPUs that the next operator waits for.

Also here: the data context every data stage runs under (order preserved) and deterministic shard file names."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa
import ray
from ray.data.block import BlockAccessor
from ray.data.context import ShuffleStrategy
from ray.data.datasource import FilenameProvider


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


def write_ordered_shards(ds: ray.data.Dataset, path: Path | str, rows_per_file: int = ROWS_PER_SHARD,
                         rows_per_group: int | None = None) -> int:
    """The dataset's rows, in order, as `part-000000.parquet`, … of `rows_per_file` rows each (row groups of
    `rows_per_group` rows, default one per file; the last file fewer): the same rows give the same files whatever blocks Ray Data cut them into — a sort's block
    boundaries come from random samples, and the writer groups blocks into files as they come. Outputs that a
    later stage reads in file order (the sorted corpus, the packed sequences) go through here, so their content
    hashes, and what training reads, repeat run after run. One Ray task per file. Returns the row count."""
    refs = ds.to_arrow_refs()
    shapes = ray.get([_shape.remote(r) for r in refs])
    schema = pa.unify_schemas([s for _, s in shapes], promote_options="permissive") if shapes else ds.schema()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    total, starts = 0, []
    for n, _ in shapes:
        starts.append(total)
        total += n
    jobs = []
    for index, lo in enumerate(range(0, total, rows_per_file)):
        hi = min(lo + rows_per_file, total)
        chosen = [(ref, (max(lo - s, 0), min(hi - s, n))) for ref, s, (n, _) in zip(refs, starts, shapes)
                  if s < hi and s + n > lo]
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

    parts = [t.slice(a, b - a).select(schema.names).cast(schema) for t, (a, b) in zip(tables, cuts)]
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    pq.write_table(table, path, row_group_size=rows_per_group or max(1, table.num_rows))


def configure_data_context() -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
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


def with_part(table: pa.Table, key: str, partitions: int) -> pa.Table:
    part = part_of(table[key], partitions)
    if "part" in table.column_names:
        return table.set_column(table.schema.get_field_index("part"), "part", part)
    return table.append_column("part", part)


def map_blocks(ds: ray.data.Dataset, fn: Callable[[pa.Table], pa.Table], batch_rows: int | None = None
               ) -> ray.data.Dataset:
    """fn(batch) over every block of a dataset, one Ray task per slice of `batch_rows` rows (or per block), as a
    dataset in block order (executes `ds`).

    For the CPU-heavy steps of deduplication over a dataset that is materialized anyway. Ray Data's executor learns
    the CPUs it may use from an autoscaling-coordinator actor, asynchronously and at most once a second, so every
    execution starts believing it has none and runs one task alone until the answer comes: on 2 CPUs, four
    one-second map tasks take 3.2 s instead of 2 (bench/dedup_vs_datatrove.py runs about twenty executions)."""
    fn_ref = ray.put(fn)  # serialized once, not once per task (fn may carry a large lookup table)
    if not batch_rows:
        return ray.data.from_arrow_refs([_map_slice.remote(fn_ref, block) for block in ds.to_arrow_refs()])
    # a task a slice, not a block: a few large blocks on two workers leave one idle at the end
    tasks = []
    for bundle in ds.iter_internal_ref_bundles():
        for ref, meta in zip(bundle.block_refs, bundle.metadata):
            if meta.num_rows is None:  # not known without reading the block: one task for all of it
                tasks.append(_map_slice.remote(fn_ref, ref))
            else:
                tasks.extend(_map_slice.remote(fn_ref, ref, lo, batch_rows)
                             for lo in range(0, max(meta.num_rows, 1), batch_rows))
    return ray.data.from_arrow_refs(tasks)


@ray.remote
def _map_slice(fn: Callable[[pa.Table], pa.Table], block: pa.Table, start: int = 0, rows: int | None = None
               ) -> pa.Table:
    if not isinstance(block, pa.Table):  # a block of another format (pandas)
        block = BlockAccessor.for_block(block).to_arrow()
    return fn(block.slice(start, rows) if rows is not None else block)


def per_part(ds: ray.data.Dataset | list[ray.data.Dataset], fn: Callable[[pa.Table], pa.Table],
             partitions: int) -> ray.data.Dataset:
    """fn(every row of one part) for each non-empty part of a dataset (or of several with one schema) that has a
    `part` column, as a dataset whose blocks come in part order (executes `ds`).

    A hash shuffle on Ray tasks: each block is cut into its parts by one task, one task per part concatenates its
    pieces (in block order, so the result is deterministic) and applies `fn`. Ray Data's groupby + map_groups does
    the same through a sort (sample, map, merge) that costs a few tenths of a second per shuffle on a small cluster,
    and deduplication runs up to ten of them. The pieces live in the object store and spill like Ray Data's blocks;
    a part is held in memory by one task, as with map_groups."""
    blocks = [ref for one in (ds if isinstance(ds, list) else [ds]) for ref in one.to_arrow_refs()]
    if not blocks:
        return ds[0] if isinstance(ds, list) else ds
    cuts = [_cut.options(num_returns=partitions + 1).remote(block, partitions) for block in blocks]
    sizes = np.sum(ray.get([cut[-1] for cut in cuts]), axis=0)
    fn_ref = ray.put(fn)
    results = [_apply.remote(fn_ref, *[cut[part] for cut in cuts]) for part in range(partitions) if sizes[part]]
    if not results:  # no rows at all: fn's output schema still comes from fn
        results = [_apply.remote(fn_ref, *[cut[0] for cut in cuts])]
    return ray.data.from_arrow_refs(results)


@ray.remote
def _cut(table: pa.Table, partitions: int) -> tuple:
    """A block -> its rows of part 0, 1, …, partitions-1 (in block order), then the row count of each part."""
    if not len(table):
        return (*[table] * partitions, np.zeros(partitions, np.int64))
    part = table["part"].to_numpy(zero_copy_only=False)
    if part.min() < 0 or part.max() >= partitions:
        raise ValueError(f"part numbers must lie in [0, {partitions}); got {part.min()}..{part.max()}")
    sizes = np.bincount(part, minlength=partitions)
    ordered = table.take(pa.array(np.argsort(part, kind="stable")))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return (*[ordered.slice(starts[i], sizes[i]) for i in range(partitions)], sizes)


@ray.remote
def _apply(fn: Callable[[pa.Table], pa.Table], *pieces: pa.Table) -> pa.Table:
    filled = [piece for piece in pieces if len(piece)] or list(pieces[:1])
    return fn(pa.concat_tables(filled, promote_options="permissive") if len(filled) > 1 else filled[0])


def to_arrow(df: pl.DataFrame, schema: pa.Schema) -> pa.Table:
    """polars -> Arrow with a fixed schema, so blocks from different tasks concatenate (polars emits large_string)."""
    return df.to_arrow().select(schema.names).cast(schema)


def partition_count(rows: int) -> int:
    """Two parts per CPU of the cluster, and more when a part would exceed ~2 million rows."""
    return max(2, 2 * int(ray.cluster_resources().get("CPU", 1)), -(-rows // 2_000_000))
