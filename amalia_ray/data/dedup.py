"""Near-duplicate removal with MinHash-LSH on Ray Data: shingles + signatures → band buckets → candidate pairs →
exact Jaccard verification (NeMo Curator style) → connected components (distributed) → keep the smallest id of each
cluster, with `cluster_size` kept as a column so documents can be re-weighted later (FineWeb-2 rehydration).
Deterministic: same input and seed → same kept ids.

Documents are read and written by Ray Data; the steps in between run as Ray tasks over its blocks (`map_blocks`,
`exchange` in partitions.py: why there). Every shuffle is a keyed exchange sized by the bytes it moves, done with
vectorized pyarrow/polars inside."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
from ray.data.expressions import col

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.components import LOCAL_EDGES, connected_components
from amalia_ray.data.decide import ROW, decide, set_columns
from amalia_ray.data.minhash import BandKeys, MinHashParams, ShingleSets, SignatureSets, pair_jaccard
from amalia_ray.data.partitions import configure_data_context, exchange, map_blocks, to_arrow, write_shards

CLUSTER_SCHEMA = pa.schema([("id", pa.string()), ("cluster_id", pa.string()), ("cluster_size", pa.int64())])
EDGES = pa.schema([("src", pa.string()), ("dst", pa.string())])
# rows of the verification shuffle: a document's shingles, or one side of a candidate pair (side 0 = src, 1 = dst)
VERIFY = pa.schema([("id", pa.string()), ("values", pa.large_list(pa.uint64())),
                    ("src", pa.string()), ("dst", pa.string()), ("side", pa.int8())])
# lookup tables up to this many rows are sent to every task instead of being joined by a shuffle
BROADCAST_ROWS = 5_000_000
# documents hashed by one task: bounds its memory (word and shingle arrays are a few times the text's size) and
# keeps every worker busy to the end
HASH_BATCH_ROWS = 8_192


def input_files(path: Path) -> list[str]:
    """The jsonl (plain or .gz) or Parquet files of a dedup input, a file or a folder (one kind only)."""
    if not path.exists():
        raise AmaliaError(f"dedup input not found: {path}")
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    parquet = [str(p) for p in files if p.suffix == ".parquet"]
    jsonl = [str(p) for p in files if p.name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz"))]
    if not (parquet or jsonl) or (parquet and jsonl):
        raise AmaliaError(f"dedup input {path}: expected .jsonl[.gz] or .parquet files, found "
                          f"{len(parquet)} Parquet and {len(jsonl)} jsonl")
    return parquet or jsonl


def check_columns(path: Path, names: list[str]) -> None:
    missing = {"id", "text"} - set(names)
    if missing:
        raise AmaliaError(f"dedup input {path}: missing column(s) {sorted(missing)}; have {names}")


def read_documents(path: Path) -> ray.data.Dataset:
    """jsonl (plain or .gz) or Parquet, file or folder, with at least `id` (as a string) and `text`. One Ray task
    per file streams it in tables of about READ_TABLE_BYTES (pyarrow's readers): a file of any size is held a part at
    a time, and a corpus of small files reads in a fraction of what Ray Data's datasource start costs."""
    readers = [_read_tables.remote(f) for f in input_files(path)]  # all started before any is waited on
    refs = [ref for reader in readers for ref in reader]
    if not refs:
        raise AmaliaError(f"dedup input {path}: its files hold no documents")
    check_columns(path, ray.get(_column_names.remote(refs[0])))
    return ray.data.from_arrow_refs(refs)


READ_TABLE_BYTES = 64 << 20


def read_tables(path: str):
    """A jsonl or Parquet file's documents as tables of about READ_TABLE_BYTES, `id` as a string."""
    import pyarrow.json as pj

    if path.endswith(".parquet"):
        batches = pq.ParquetFile(path).iter_batches(batch_size=8192)
    else:  # newline-delimited JSON, decompressed by its extension
        batches = pj.open_json(path, read_options=pj.ReadOptions(block_size=4 << 20))
    held, size = [], 0
    for batch in batches:
        held.append(batch)
        size += batch.nbytes
        if size >= READ_TABLE_BYTES:
            yield _as_string_id(pa.Table.from_batches(held))
            held, size = [], 0
    if held:
        yield _as_string_id(pa.Table.from_batches(held))


_read_tables = ray.remote(num_returns="streaming")(read_tables)


def _as_string_id(batch: pa.Table) -> pa.Table:
    i = batch.schema.get_field_index("id")
    return batch.set_column(i, "id", batch["id"].cast(pa.string())) if i >= 0 else batch


@ray.remote(num_cpus=0.25)
def _column_names(table: pa.Table) -> list[str]:
    return table.column_names


def near_duplicate_clusters(docs: ray.data.Dataset, params: MinHashParams, threshold: float | None,
                            broadcast_rows: int = BROADCAST_ROWS, local_edges: int = LOCAL_EDGES,
                            similarity: str = "estimated") -> tuple[ray.data.Dataset, dict]:
    """`docs` (id, text, …) -> dataset of (id, cluster_id, cluster_size) for every document that has a near
    duplicate, and stats. Candidate pairs are kept when their Jaccard is >= threshold (None: all), estimated from
    their signatures or exact over their shingle sets (`similarity`). Duplicate graphs of more than `local_edges`
    edges are split into components on many tasks."""

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


def band_rows(batch: pa.Table, band_keys: BandKeys) -> pa.Table:
    """A batch of documents -> one (key, id) row per document and band."""
    keyed = band_keys(batch)
    bands = band_keys.params.bands
    keys = pa.concat_arrays([keyed[f"key_{b}"].combine_chunks() for b in range(bands)])
    ids = pa.concat_arrays([keyed["id"].combine_chunks()] * bands)
    return pa.table({"key": keys, "id": ids})


def _collect(ds: ray.data.Dataset) -> pa.Table:
    return pa.concat_tables([t for t in ray.get(ds.to_arrow_refs()) if len(t)] or [ds.schema().base_schema.empty_table()])


def bucket_edges(group: pa.Table) -> pa.Table:
    """Rows (key, id) of one part -> star edges from each bucket's smallest id to its other members."""
    df = pl.from_arrow(group.select(["key", "id"]))
    roots = df.group_by("key").agg(src=pl.col("id").min(), n=pl.len()).filter(pl.col("n") > 1)
    edges = (df.join(roots, on="key").filter(pl.col("id") != pl.col("src")).select("src", dst="id")
             .unique().sort("src", "dst"))
    return to_arrow(edges, EDGES)


def unique_edges(group: pa.Table) -> pa.Table:
    return to_arrow(pl.from_arrow(group.select(["src", "dst"])).unique().sort("src", "dst"), EDGES)


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


def endpoints(batch: pa.Table) -> pa.Table:
    """The ids of a batch of pairs, each once."""
    ids = pa.concat_arrays([batch["src"].combine_chunks(), batch["dst"].combine_chunks()])
    return pa.table({"id": pc.unique(ids)})


def pair_values(params: MinHashParams, similarity: str) -> ShingleSets | SignatureSets:
    """What a pair's Jaccard is computed from: shingle sets (`exact`) or signatures."""
    return ShingleSets(params) if similarity == "exact" else SignatureSets(params)


def value_rows(batch: pa.Table, values_of: ShingleSets | SignatureSets, wanted: pa.Array | None) -> pa.Table:
    """Verification rows of documents (those in `wanted`, if given): their id and values."""
    if wanted is not None:
        batch = batch.filter(pc.is_in(batch["id"], value_set=wanted))
    batch = values_of(batch)
    n = len(batch)
    return pa.table({"id": batch["id"], "values": batch["values"], "src": pa.nulls(n, pa.string()),
                     "dst": pa.nulls(n, pa.string()), "side": pa.nulls(n, pa.int8())}, schema=VERIFY)


def side_rows(batch: pa.Table) -> pa.Table:
    """Verification rows of pairs: each side keyed by its document's id."""
    n = len(batch)
    sides = []
    for side, key in ((0, "src"), (1, "dst")):
        sides.append(pa.table({"id": batch[key], "values": pa.nulls(n, VERIFY.field("values").type),
                               "src": batch["src"], "dst": batch["dst"], "side": pa.array([side] * n, pa.int8())},
                              schema=VERIFY))
    return pa.concat_tables(sides)


def attach_values(group: pa.Table) -> pa.Table:
    """Each pair side with its document's values."""
    is_side = pc.is_valid(group["side"])
    docs, sides = group.filter(pc.invert(is_side)), group.filter(is_side)
    sides = pl.from_arrow(sides).unique(["src", "dst", "side"]).sort("src", "dst", "side").to_arrow().cast(VERIFY)
    found = pc.index_in(sides["id"], value_set=docs["id"])
    return sides.set_column(sides.schema.get_field_index("values"), "values", docs["values"].take(found))


def keep_similar(group: pa.Table, threshold: float, similarity: str) -> pa.Table:
    """The pairs whose two sides' Jaccard is >= threshold, each once."""
    df = pl.from_arrow(group.select(["src", "dst", "side", "values"]))
    pairs = (df.filter(pl.col("side") == 0).join(df.filter(pl.col("side") == 1), on=["src", "dst"])
             .sort("src", "dst"))
    if not len(pairs):
        return EDGES.empty_table()
    similar = pair_jaccard(pairs["values"].to_arrow(), pairs["values_right"].to_arrow(), similarity) >= threshold
    return to_arrow(pairs.filter(pl.Series(similar)).select("src", "dst"), EDGES)


def cluster_sizes(group: pa.Table) -> pa.Table:
    df = (pl.from_arrow(group.select(["node", "label"]))
          .with_columns(cluster_size=pl.len().over("label").cast(pl.Int64))
          .select(id="node", cluster_id="label", cluster_size="cluster_size"))
    return to_arrow(df, CLUSTER_SCHEMA)


def with_clusters(docs: ray.data.Dataset, clusters: ray.data.Dataset, broadcast_rows: int = BROADCAST_ROWS
                  ) -> ray.data.Dataset:
    """Every document with `cluster_id` and `cluster_size` (itself and 1 when it has no near duplicate), whatever
    its other columns. A small cluster table is sent to every task; a large one meets the documents' ids (not the
    documents) in one keyed exchange, and each block sets its rows' clusters (`decide`)."""
    if clusters.count() <= broadcast_rows:
        table = _collect(clusters)
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
    return decide(docs.materialize(), id_rows, "id", join, attach, others=[links])


def attach_clusters(rows: pa.Table, clusters: pa.Table) -> pa.Table:
    found = pc.index_in(rows["id"], value_set=clusters["id"])
    cluster_id = pc.coalesce(clusters["cluster_id"].take(found), rows["id"])
    size = pc.coalesce(clusters["cluster_size"].take(found), pa.scalar(1, pa.int64()))
    return rows.append_column("cluster_id", cluster_id).append_column("cluster_size", size)


def check_unique_ids(docs: ray.data.Dataset, what: str) -> None:
    """Stop at an id that appears more than once (the smallest such id is named): near-dedup joins documents to
    their clusters by id, so a repeated id would silently merge or drop documents. Only the ids move (one keyed
    exchange); the documents stay where they are."""
    ids = map_blocks(docs, lambda b: b.select(["id"]))
    repeated = [t for t in ray.get(exchange(ids, "id", smallest_repeated_id).to_arrow_refs()) if len(t)]
    if repeated:
        dup = pc.min(pa.concat_tables(repeated)["id"]).as_py()
        raise repeated_id(what, dup)


def repeated_id(what: str, dup: str) -> AmaliaError:
    return AmaliaError(f"{what}: ids must be unique; '{dup}' appears more than once")


def smallest_repeated_id(group: pa.Table) -> pa.Table:
    """The part's smallest repeated id, if any: the driver gathers one row per part, however many ids repeat."""
    counts = pc.value_counts(group["id"].combine_chunks())
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    return pa.table({"id": pa.array([pc.min(repeated).as_py()] if len(repeated) else [], pa.string())})


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


def summary(n_docs: int, stats: dict, n_kept: int, params: MinHashParams, threshold: float | None,
            similarity: str) -> dict:
    """What `amalia data dedup` prints."""
    return {"documents": n_docs, **stats, "kept": n_kept, "removed": n_docs - n_kept, "num_perm": params.num_perm,
            "bands": params.bands, "rows": params.rows, "ngram": params.ngram, "threshold": threshold,
            **({"similarity": similarity} if threshold else {})}
