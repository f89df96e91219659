"""`amalia data dedup` in this process, without a Ray cluster: for an input small enough to hold in memory, where
starting Ray (seconds) would cost more than the work. The same steps as on Ray (dedup.py: band rows, bucket stars,
verification, connected components, cluster sizes, the clusters attached), each applied to the whole corpus as one
part instead of to the parts of a keyed exchange, so both give the same clusters and kept documents. Memory: the
documents, their band keys (bands × 16 bytes each) and, with verification, the candidates' signatures or shingle
sets: a few times the input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.components import local_components
from amalia_ray.data.dedup import (CLUSTER_SCHEMA, HASH_BATCH_ROWS, attach_clusters, attach_values, band_rows,
                                   bucket_edges, check_columns, cluster_sizes, endpoints, input_files, keep_similar,
                                   pair_values, read_tables, repeated_id, side_rows, smallest_repeated_id,
                                   summary, unique_edges, value_rows)
from amalia_ray.data.minhash import BandKeys, MinHashParams

# inputs up to this many bytes on disk (a .gz counted at 4×) run here when no Ray cluster is given
IN_PROCESS_BYTES = 256 << 20


def fits_in_process(path: Path) -> bool:
    size = sum(Path(f).stat().st_size * (4 if f.endswith(".gz") else 1) for f in input_files(path))
    return size <= IN_PROCESS_BYTES


def _batches(table: pa.Table, fn) -> pa.Table:
    """`fn` over the table a HASH_BATCH_ROWS slice at a time (as the Ray tasks batch it), results concatenated."""
    return pa.concat_tables([fn(table.slice(i, HASH_BATCH_ROWS)) for i in range(0, max(len(table), 1),
                                                                                  HASH_BATCH_ROWS)])


def dedup_in_process(input_path: Path, output: Path, params: MinHashParams, threshold: float | None,
                     similarity: str = "estimated") -> dict:
    """The `amalia data dedup` contract (dedup.dedup) computed in this process."""
    tables = [t for f in input_files(input_path) for t in read_tables(f)]
    if not tables:
        raise AmaliaError(f"dedup input {input_path}: its files hold no documents")
    check_columns(input_path, tables[0].column_names)
    docs = pa.concat_tables(tables, promote_options="permissive")
    del tables
    if len(repeated := smallest_repeated_id(docs.select(["id"]))):
        raise repeated_id("dedup input", repeated["id"][0].as_py())

    band_keys = BandKeys(params)
    star_edges = bucket_edges(_batches(docs, lambda b: band_rows(b, band_keys)))
    if threshold is not None:
        stats = {"candidate_edges": len(star_edges)}
        edges = star_edges
        if len(star_edges):
            wanted = endpoints(star_edges)["id"]
            values_of = pair_values(params, similarity)
            values = _batches(docs, lambda b: value_rows(b, values_of, wanted))
            edges = keep_similar(attach_values(pa.concat_tables([values, side_rows(star_edges)])), threshold,
                                 similarity)
    else:
        edges = unique_edges(star_edges)
        stats = {"candidate_edges": len(edges)}
    stats["duplicate_pairs"] = len(edges)
    stats["cc_rounds"] = 0
    clusters = cluster_sizes(local_components(edges)) if len(edges) else CLUSTER_SCHEMA.empty_table()

    joined = attach_clusters(docs, clusters)
    output.mkdir(parents=True, exist_ok=True)
    pq.write_table(joined.select(CLUSTER_SCHEMA.names).sort_by("id").cast(CLUSTER_SCHEMA),
                   output / "clusters.parquet")
    kept = joined.filter(pc.equal(joined["id"], joined["cluster_id"])).drop_columns(["cluster_id"])
    shutil.rmtree(output / "kept", ignore_errors=True)
    (output / "kept").mkdir()
    pq.write_table(kept, output / "kept" / "part-000000.parquet")
    return summary(len(docs), stats, len(kept), params, threshold, similarity)
