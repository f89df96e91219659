"""`amalia data dedup` in this process, without a Ray cluster: for an input small enough to hold in memory, where
starting Ray (seconds) would cost more than the work. The same steps as on Ray (ray_executor.py: band rows, bucket
stars, verification, connected components, cluster sizes, the clusters attached), each applied to the whole corpus
as one part instead of to the parts of a keyed exchange, so both give the same clusters and kept documents. Memory:
the documents, their band keys (bands × 16 bytes each) and, with verification, the candidates' signatures or shingle
sets: a few times the input. The statistics match the Ray executor's but for `candidate_edges` when verifying: on
Ray a pair found in several bands is counted once per exchange part it lands in, here once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.dedup.dedup_steps import (
    CLUSTER_SCHEMA, HASH_BATCH_ROWS, attach_clusters, attach_values, band_rows, bucket_edges, check_columns,
    cluster_sizes, endpoints, input_files, keep_similar, local_components, pair_values, read_tables, repeated_id,
    side_rows, smallest_repeated_id, summary, unique_edges, value_rows)
from amalia_ray.data.dedup.minhash import BandKeys, MinHashParams

# inputs up to this many bytes (a .gz counted at 4×, Parquet at its uncompressed size) run here when no Ray cluster
# is given
IN_PROCESS_BYTES = 256 << 20


def fits_in_process(path: Path) -> bool:
    size = 0
    for f in input_files(path):
        if f.endswith(".parquet"):
            meta = pq.ParquetFile(f).metadata
            size += sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        else:
            size += Path(f).stat().st_size * (4 if f.endswith(".gz") else 1)
    return size <= IN_PROCESS_BYTES


def _batches(table: pa.Table, fn) -> pa.Table:
    """`fn` over the table a HASH_BATCH_ROWS slice at a time (as the Ray tasks batch it), results concatenated."""
    return pa.concat_tables([fn(table.slice(i, HASH_BATCH_ROWS)) for i in range(0, max(len(table), 1),
                                                                                  HASH_BATCH_ROWS)])


def dedup_in_process(input_path: Path, output: Path, params: MinHashParams, threshold: float | None,
                     similarity: str = "estimated") -> dict:
    """The `amalia data dedup` contract (dedup.dedup) computed in this process. The steps see only ids and texts
    (the tables' own buffers, not copies); each input table is then written to kept/ with its own columns."""
    tables = [t for f in input_files(input_path) for t in read_tables(f)]
    if not tables:
        raise AmaliaError(f"dedup input {input_path}: its files hold no documents")
    for table in tables:
        check_columns(input_path, table.column_names)
    docs = pa.concat_tables([t.select(["id", "text"]) for t in tables], promote_options="permissive")
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
            del values
    else:
        edges = unique_edges(star_edges)
        stats = {"candidate_edges": len(edges)}
    stats["duplicate_pairs"] = len(edges)
    stats["cc_rounds"] = 0
    clusters = cluster_sizes(local_components(edges)) if len(edges) else CLUSTER_SCHEMA.empty_table()

    output.mkdir(parents=True, exist_ok=True)
    ids = attach_clusters(docs.select(["id"]), clusters)
    pq.write_table(ids.sort_by("id").cast(CLUSTER_SCHEMA), output / "clusters.parquet")
    shutil.rmtree(output / "kept", ignore_errors=True)
    (output / "kept").mkdir()
    kept = 0
    for index, table in enumerate(tables):  # kept documents with all their columns, a file per input table
        joined = attach_clusters(table, clusters)
        joined = joined.filter(pc.equal(joined["id"], joined["cluster_id"])).drop_columns(["cluster_id"])
        pq.write_table(joined, output / "kept" / f"part-{index:06d}.parquet")
        kept += len(joined)
    return summary(len(docs), stats, kept, params, threshold, similarity)
