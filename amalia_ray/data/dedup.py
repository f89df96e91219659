"""Near-duplicate removal with MinHash-LSH on Ray Data: signatures → band buckets → candidate edges → connected
components (distributed) → keep the smallest id of each cluster, with `cluster_size` kept as a column so documents
can be re-weighted later (FineWeb-2 rehydration). Deterministic: same input and seed → same kept ids."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray.data.expressions import col

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.components import connected_components
from amalia_ray.data.steps import shuffle_partitions
from amalia_ray.data.minhash import BandKeys, MinHashParams, Signatures, bucket_edges

CLUSTER_SCHEMA = pa.schema([("id", pa.string()), ("cluster_id", pa.string()), ("cluster_size", pa.int64())])


def read_documents(path: Path) -> ray.data.Dataset:
    """jsonl (plain or .gz) or Parquet, file or folder, with at least `id` and `text`."""
    if not path.exists():
        raise AmaliaError(f"dedup input not found: {path}")
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    parquet = [str(p) for p in files if p.suffix == ".parquet"]
    jsonl = [str(p) for p in files if p.name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz"))]
    if parquet and not jsonl:
        ds = ray.data.read_parquet(parquet)
    elif jsonl and not parquet:
        ds = ray.data.read_json(jsonl, lines=True)
    else:
        raise AmaliaError(f"dedup input {path}: expected .jsonl[.gz] or .parquet files, found "
                          f"{len(parquet)} Parquet and {len(jsonl)} jsonl")
    missing = {"id", "text"} - set(ds.schema().names)
    if missing:
        raise AmaliaError(f"dedup input {path}: missing column(s) {sorted(missing)}; have {ds.schema().names}")
    return ds


def _as_string_id(batch: pa.Table) -> pa.Table:
    i = batch.schema.get_field_index("id")
    return batch.set_column(i, "id", batch["id"].cast(pa.string()))


def near_duplicate_clusters(docs: ray.data.Dataset, params: MinHashParams, threshold: float | None
                            ) -> tuple[ray.data.Dataset, dict]:
    """`docs` (id, text, …) -> dataset of every document's (id, cluster_id, cluster_size) and stats."""
    parts = shuffle_partitions()
    ids = docs.select_columns(["id"]).materialize()
    n_docs = ids.count()
    edges = (docs.select_columns(["id", "text"])
             .map_batches(Signatures(params), batch_format="pyarrow")
             .map_batches(BandKeys(params), batch_format="pyarrow")
             .groupby(["band", "key"], num_partitions=parts).map_groups(bucket_edges(threshold), batch_format="pyarrow")
             .materialize())
    n_edges = edges.count()
    labels, rounds = (connected_components(edges, parts) if n_edges else (None, 0))
    # every document gets a label: its component's smallest id, or itself
    own = ids.map_batches(lambda b: pa.table({"node": b["id"], "label": b["id"], "own": pa.array([True] * len(b))}),
                          batch_format="pyarrow")
    if labels is not None:
        own = own.union(labels.map_batches(
            lambda b: b.append_column("own", pa.array([False] * len(b))), batch_format="pyarrow"))
    clusters = (own.groupby("node", num_partitions=parts).map_groups(_resolve_label, batch_format="pyarrow")
                .groupby("cluster_id", num_partitions=parts).map_groups(_add_size, batch_format="pyarrow")
                .materialize())
    stats = {"documents": n_docs, "candidate_edges": n_edges, "cc_rounds": rounds}
    return clusters, stats


def _resolve_label(group: pa.Table) -> pa.Table:
    if sum(group["own"].to_pylist()) > 1:
        raise AmaliaError(f"dedup input: ids must be unique; '{group['node'][0].as_py()}' appears more than once")
    return pa.table({"id": [group["node"][0].as_py()], "cluster_id": [min(group["label"].to_pylist())]})


def _add_size(group: pa.Table) -> pa.Table:
    return group.append_column("cluster_size", pa.array([len(group)] * len(group), pa.int64()))


def dedup(input_path: Path, output: Path, params: MinHashParams, threshold: float | None) -> dict:
    """The `amalia data dedup` contract: OUTPUT/kept/*.parquet (kept documents, all columns + cluster_size) and
    OUTPUT/clusters.parquet (id, cluster_id, cluster_size for every input document)."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    docs = read_documents(input_path).map_batches(_as_string_id, batch_format="pyarrow").materialize()
    clusters, stats = near_duplicate_clusters(docs, params, threshold)
    output.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(output / "clusters.parquet", CLUSTER_SCHEMA) as writer:
        for batch in clusters.sort("id").iter_batches(batch_format="pyarrow", batch_size=65536):
            writer.write_table(batch.select(CLUSTER_SCHEMA.names).cast(CLUSTER_SCHEMA))
    kept_clusters = clusters.filter(expr=col("id") == col("cluster_id")).select_columns(["id", "cluster_size"])
    kept = docs.join(kept_clusters, join_type="inner", num_partitions=shuffle_partitions(), on=("id",))
    kept.write_parquet(str(output / "kept"))
    n_kept = sum(pq.ParquetFile(p).metadata.num_rows for p in (output / "kept").rglob("*.parquet"))
    return {**stats, "kept": n_kept, "removed": stats["documents"] - n_kept, "num_perm": params.num_perm,
            "bands": params.bands, "rows": params.rows, "ngram": params.ngram, "threshold": threshold}
