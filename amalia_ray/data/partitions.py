"""Keyed shuffles with few, large groups: rows get a `part` column (hash of a key modulo the partition count) and one
call of a vectorized function (pyarrow/polars) sees every row of its part. Ray Data's `map_groups` calls Python once
per distinct key, which for millions of singleton keys (LSH buckets, graph nodes) costs more than the work itself.

The sort-based pull shuffle is used: on small clusters the default hash shuffle's aggregator actors cost seconds per
shuffle and hold CPUs that the next operator waits for.

Also here: the data context every data stage runs under (order preserved) and deterministic shard file names."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa
import ray
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


def write_ordered_shards(ds: ray.data.Dataset, path: Path | str, rows_per_file: int = ROWS_PER_SHARD) -> int:
    """The dataset's rows, in order, as `part-000000.parquet`, … of `rows_per_file` rows each (one row group; the
    last file fewer): the same rows give the same files whatever blocks Ray Data cut them into — a sort's block
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
                                       *[r for r, _ in chosen]))
    if total == 0:
        jobs.append(_write_file.remote(str(folder / "part-000000.parquet"), schema, []))
    ray.get(jobs)
    return total


@ray.remote(num_cpus=0.25)
def _shape(table: pa.Table) -> tuple[int, pa.Schema]:
    return table.num_rows, table.schema


@ray.remote(num_cpus=0.5)
def _write_file(path: str, schema, cuts: list[tuple[int, int]], *tables: pa.Table) -> None:
    import pyarrow.parquet as pq

    parts = [t.slice(a, b - a).select(schema.names).cast(schema) for t, (a, b) in zip(tables, cuts)]
    table = pa.concat_tables(parts) if parts else schema.empty_table()
    pq.write_table(table, path, row_group_size=max(1, table.num_rows))


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


def per_part(ds: ray.data.Dataset, fn: Callable[[pa.Table], pa.Table], partitions: int) -> ray.data.Dataset:
    """fn(every row of one part) for each part of a dataset that has a `part` column."""
    return ds.groupby("part", num_partitions=partitions).map_groups(fn, batch_format="pyarrow")


def to_arrow(df: pl.DataFrame, schema: pa.Schema) -> pa.Table:
    """polars -> Arrow with a fixed schema, so blocks from different tasks concatenate (polars emits large_string)."""
    return df.to_arrow().select(schema.names).cast(schema)


def partition_count(rows: int) -> int:
    """Two parts per CPU of the cluster, and more when a part would exceed ~2 million rows."""
    return max(2, 2 * int(ray.cluster_resources().get("CPU", 1)), -(-rows // 2_000_000))
