"""polars frames to Arrow tables of a fixed schema: what every step that computes with polars hands on."""

from __future__ import annotations

import polars as pl
import pyarrow as pa


def to_arrow(df: pl.DataFrame, schema: pa.Schema) -> pa.Table:
    """polars -> Arrow with a fixed schema, so blocks from different tasks concatenate (polars emits large_string)."""
    return df.to_arrow().select(schema.names).cast(schema)
