"""Keyed shuffles with few, large groups: rows get a `part` column (hash of a key modulo the partition count) and one
call of a vectorized function (pyarrow/polars) sees every row of its part. Ray Data's `map_groups` calls Python once
per distinct key, which for millions of singleton keys (LSH buckets, graph nodes) costs more than the work itself.

The sort-based pull shuffle is used: on small clusters the default hash shuffle's aggregator actors cost seconds per
shuffle and hold CPUs that the next operator waits for."""

from __future__ import annotations

from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa
import ray
from ray.data.context import ShuffleStrategy


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
