"""Near-duplicate removal with MinHash-LSH on Ray Data: shingles + signatures → band buckets → candidate pairs →
optional Jaccard verification (estimated from the signatures, or exact on the shingles as NeMo Curator does) →
connected components (distributed) → keep the smallest id of each cluster, with `cluster_size` kept as a column
so documents can be re-weighted later (FineWeb-2 rehydration).
Deterministic: same input and seed → same kept ids.

Documents are read and written by Ray Data; the steps in between run as Ray tasks over its blocks (`map_blocks`,
`exchange` in partitions.py: why there). Every shuffle is a keyed exchange sized by the bytes it moves, done with
vectorized pyarrow/polars inside."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
from ray.data.expressions import col

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.dedup.components import LOCAL_EDGES, connected_components
from amalia_ray.data.exchange.decide import ROW, decide, set_columns
from amalia_ray.data.dedup.dedup_steps import (
    CLUSTER_SCHEMA, HASH_BATCH_ROWS, attach_clusters, attach_values, band_rows, bucket_edges, check_columns,
    cluster_sizes, endpoints, input_files, keep_similar, pair_values, read_tables, repeated_id, side_rows,
    smallest_repeated_id, summary, unique_edges, value_rows)
from amalia_ray.data.dedup.minhash import BandKeys, MinHashParams
from amalia_ray.data.exchange.partitions import configure_data_context, exchange, map_blocks, write_shards
from amalia_ray.data.exchange.staged import Staged

# lookup tables up to this many rows are sent to every task instead of being joined by a shuffle
BROADCAST_ROWS = 5_000_000


def read_documents(path: Path) -> ray.data.Dataset:
    """jsonl (plain or .gz) or Parquet, file or folder, with at least `id` (as a string) and `text`. One Ray task
    per file streams it in tables of about READ_TABLE_BYTES (pyarrow's readers): a file of any size is held a part at
    a time, and a corpus of small files reads in a fraction of what Ray Data's datasource start costs."""
    readers = [_read_tables.remote(f) for f in input_files(path)]  # all started before any is waited on
    refs = [ref for reader in readers for ref in reader]
    if not refs:
        raise AmaliaError(f"dedup input {path}: its files hold no documents")
    for names in ray.get([_column_names.remote(ref) for ref in refs]):  # every table: files may differ
        check_columns(path, names)
    return ray.data.from_arrow_refs(refs)


_read_tables = ray.remote(num_returns="streaming")(read_tables)


@ray.remote(num_cpus=0.25)
def _column_names(table: pa.Table) -> list[str]:
    return table.column_names


def near_duplicate_clusters(docs: ray.data.Dataset | Staged, params: MinHashParams, threshold: float | None,
                            broadcast_rows: int = BROADCAST_ROWS, local_edges: int = LOCAL_EDGES,
                            similarity: str = "estimated") -> tuple[ray.data.Dataset, dict]:
    """`docs` (id, text, …) -> dataset of (id, cluster_id, cluster_size) for every document that has a near
    duplicate, and stats. Candidate pairs are kept when their Jaccard is >= threshold (None: all), estimated from
    their signatures or exact over their shingle sets (`similarity`). Duplicate graphs of more than `local_edges`
    edges are split into components on many tasks. Staged documents are read for their ids and text only."""
    if isinstance(docs, Staged):
        docs = docs.select(["id", "text"])
    star_edges = exchange(map_blocks(docs, partial(band_rows, band_keys=BandKeys(params)), HASH_BATCH_ROWS), "key",
                          bucket_edges)
    if threshold is not None:
        # a pair found in several bands comes once per band here; verification keeps each pair once
        candidates = star_edges.materialize()
        stats = {"candidate_edges": candidates.count()}
        edges = (_verified(candidates, docs, params, threshold, broadcast_rows, similarity).materialize()
                 if stats["candidate_edges"] else candidates)
    else:
        # one more keyed shuffle (by src) keeps each pair once
        edges = exchange(star_edges, "src", unique_edges).materialize()
        stats = {"candidate_edges": edges.count()}
    stats["duplicate_pairs"] = edges.count()
    if not stats["duplicate_pairs"]:
        return ray.data.from_arrow(CLUSTER_SCHEMA.empty_table()), {**stats, "cc_rounds": 0}
    labels, stats["cc_rounds"] = connected_components(edges, local_edges)
    return exchange(labels, "label", cluster_sizes), stats


def _collect(ds: ray.data.Dataset) -> pa.Table:
    return pa.concat_tables([t for t in ray.get(ds.to_arrow_refs()) if len(t)] or [ds.schema().base_schema.empty_table()])


def _verified(candidates: ray.data.Dataset, docs: ray.data.Dataset, params: MinHashParams, threshold: float,
              broadcast_rows: int, similarity: str) -> ray.data.Dataset:
    """Candidate pairs whose Jaccard is >= threshold. Shuffle 1 brings each side of a pair to the part of its
    document and attaches that document's values (its signature, num_perm numbers, or its shingle hashes for
    `exact`); shuffle 2 brings both sides together by pair. When the candidates' ids are few enough to send to every
    task, only those documents are hashed and shuffled."""
    wanted = None
    if 2 * candidates.count() <= broadcast_rows:  # their ids (not the pairs) are few enough to go to every task
        wanted = pc.unique(_collect(map_blocks(candidates, endpoints))["id"].combine_chunks())
    values = partial(value_rows, values_of=pair_values(params, similarity), wanted=wanted)
    attached = exchange([map_blocks(docs, values, HASH_BATCH_ROWS), map_blocks(candidates, side_rows)], "id",
                        attach_values)
    return exchange(attached, "src", partial(keep_similar, threshold=threshold, similarity=similarity))


def with_clusters(docs: ray.data.Dataset | Staged, clusters: ray.data.Dataset, broadcast_rows: int = BROADCAST_ROWS,
                  out: Path | None = None) -> ray.data.Dataset | Staged:
    """Every document with `cluster_id` and `cluster_size` (itself and 1 when it has no near duplicate), whatever
    its other columns. A small cluster table is sent to every task; a large one meets the documents' ids (not the
    documents) in one keyed exchange, and each block sets its rows' clusters (`decide`). Staged documents are
    staged again in `out`."""
    if clusters.count() <= broadcast_rows:
        table = _collect(clusters)
        if isinstance(docs, Staged):
            return map_blocks(docs, lambda b: attach_clusters(b, table), out=out)
        return docs.map_batches(lambda b: attach_clusters(b, table), batch_format="pyarrow")
    schema = pa.schema([*CLUSTER_SCHEMA, pa.field(ROW, pa.int64())])

    def id_rows(batch: pa.Table) -> pa.Table:
        n = len(batch)
        return pa.table({"id": batch["id"], "cluster_id": pa.nulls(n, pa.string()),
                         "cluster_size": pa.nulls(n, pa.int64()), ROW: batch[ROW]}, schema=schema)

    def link_rows(batch: pa.Table) -> pa.Table:
        return pa.table({**{c: batch[c] for c in CLUSTER_SCHEMA.names}, ROW: pa.nulls(len(batch), pa.int64())},
                        schema=schema)

    def join(group: pa.Table) -> pa.Table:
        is_doc = pc.is_valid(group[ROW])
        rows, links = group.filter(is_doc), group.filter(pc.invert(is_doc))
        found = pc.index_in(rows["id"], value_set=links["id"])
        matched = pc.is_valid(found)
        return pa.table({ROW: rows[ROW].filter(matched),
                         "cluster_id": links["cluster_id"].take(found.filter(matched)),
                         "cluster_size": links["cluster_size"].take(found.filter(matched))})

    def attach(block: pa.Table, decisions: pa.Table | None) -> pa.Table:
        block = set_columns(block, decisions, {"cluster_id": None, "cluster_size": None})
        block = block.set_column(block.schema.get_field_index("cluster_id"), "cluster_id",
                                 pc.coalesce(block["cluster_id"].cast(pa.string()), block["id"]))
        return block.set_column(block.schema.get_field_index("cluster_size"), "cluster_size",
                                pc.coalesce(block["cluster_size"].cast(pa.int64()), pa.scalar(1, pa.int64())))

    links = clusters.map_batches(link_rows, batch_format="pyarrow")
    return decide(docs if isinstance(docs, Staged) else docs.materialize(), id_rows, "id", join, attach,
                  others=[links], out=out)


def check_unique_ids(docs: ray.data.Dataset | Staged, what: str) -> None:
    """Stop at an id that appears more than once (the smallest such id is named): near-dedup joins documents to
    their clusters by id, so a repeated id would silently merge or drop documents. Only the ids move (one keyed
    exchange); the documents stay where they are."""
    ids = map_blocks(docs.select(["id"]) if isinstance(docs, Staged) else docs, lambda b: b.select(["id"]))
    repeated = [t for t in ray.get(exchange(ids, "id", smallest_repeated_id).to_arrow_refs()) if len(t)]
    if repeated:
        dup = pc.min(pa.concat_tables(repeated)["id"]).as_py()
        raise repeated_id(what, dup)


def unique_ids(batches, what: str):
    """Pass on the batches of a dataset sorted by id, stopping at the first id that repeats: near-dedup joins
    documents to their clusters by id, so a repeated id would silently merge or drop documents."""
    last = None
    for batch in batches:
        ids = batch["id"]
        if len(ids) and (pc.count_distinct(ids).as_py() < len(ids) or ids[0].as_py() == last):
            counts = pc.value_counts(pa.concat_arrays([pa.array([last], pa.string()), ids.combine_chunks()
                                                       if isinstance(ids, pa.ChunkedArray) else ids]))
            dup = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
            raise repeated_id(what, dup)
        last = ids[-1].as_py() if len(ids) else last
        yield batch


def _write_sorted_clusters(joined: ray.data.Dataset, path: Path) -> None:
    """clusters.parquet sorted by id; a repeated id (the input's ids must be unique) stops it with an error."""
    try:
        with pq.ParquetWriter(path, CLUSTER_SCHEMA) as writer:
            batches = (joined.select_columns(CLUSTER_SCHEMA.names).sort("id")
                       .iter_batches(batch_format="pyarrow", batch_size=65536))
            for batch in unique_ids(batches, "dedup input"):
                writer.write_table(batch.select(CLUSTER_SCHEMA.names).cast(CLUSTER_SCHEMA))
    except AmaliaError:
        path.unlink(missing_ok=True)
        raise


def dedup(input_path: Path, output: Path, params: MinHashParams, threshold: float | None,
          broadcast_rows: int = BROADCAST_ROWS, similarity: str = "estimated") -> dict:
    """The `amalia data dedup` contract: OUTPUT/kept/*.parquet (kept documents, all columns + cluster_size) and
    OUTPUT/clusters.parquet (id, cluster_id, cluster_size for every input document)."""
    configure_data_context()
    docs = read_documents(input_path).materialize()
    n_docs = docs.count()
    clusters, stats = near_duplicate_clusters(docs, params, threshold, broadcast_rows, similarity=similarity)
    joined = with_clusters(docs, clusters.materialize(), broadcast_rows).materialize()
    output.mkdir(parents=True, exist_ok=True)
    _write_sorted_clusters(joined, output / "clusters.parquet")
    kept = joined.filter(expr=col("id") == col("cluster_id")).drop_columns(["cluster_id"])
    write_shards(kept, output / "kept")
    n_kept = sum(pq.ParquetFile(p).metadata.num_rows for p in (output / "kept").rglob("*.parquet"))
    return summary(n_docs, stats, n_kept, params, threshold, similarity)
