"""The steps of near-duplicate removal, each a function of Arrow tables with no cluster in it, so that the Ray
executor (ray_executor.py: steps over blocks and the parts of keyed exchanges) and the in-process one
(in_process.py: each step over the whole corpus as one part) run the same code and find the same clusters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.exchange.frames import to_arrow
from amalia_ray.data.dedup.minhash import BandKeys, MinHashParams, ShingleSets, SignatureSets, pair_jaccard

# large_string: ids add up to more than 2 GiB (32-bit offsets) in a task that holds millions of edges
LABELS = pa.schema([("node", pa.large_string()), ("label", pa.large_string())])
CLUSTER_SCHEMA = pa.schema([("id", pa.string()), ("cluster_id", pa.string()), ("cluster_size", pa.int64())])
EDGES = pa.schema([("src", pa.string()), ("dst", pa.string())])
# rows of the verification shuffle: a document's shingles, or one side of a candidate pair (side 0 = src, 1 = dst)
VERIFY = pa.schema([("id", pa.string()), ("values", pa.large_list(pa.uint64())),
                    ("src", pa.string()), ("dst", pa.string()), ("side", pa.int8())])
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


def _as_string_id(batch: pa.Table) -> pa.Table:
    i = batch.schema.get_field_index("id")
    return batch.set_column(i, "id", batch["id"].cast(pa.string())) if i >= 0 else batch


def band_rows(batch: pa.Table, band_keys: BandKeys) -> pa.Table:
    """A batch of documents -> one (key, id) row per document and band."""
    keyed = band_keys(batch)
    bands = band_keys.params.bands
    keys = pa.concat_arrays([keyed[f"key_{b}"].combine_chunks() for b in range(bands)])
    ids = pa.concat_arrays([keyed["id"].combine_chunks()] * bands)
    return pa.table({"key": keys, "id": ids})


def bucket_edges(group: pa.Table) -> pa.Table:
    """Rows (key, id) of one part -> star edges from each bucket's smallest id to its other members."""
    df = pl.from_arrow(group.select(["key", "id"]))
    roots = df.group_by("key").agg(src=pl.col("id").min(), n=pl.len()).filter(pl.col("n") > 1)
    edges = (df.join(roots, on="key").filter(pl.col("id") != pl.col("src")).select("src", dst="id")
             .unique().sort("src", "dst"))
    return to_arrow(edges, EDGES)


def unique_edges(group: pa.Table) -> pa.Table:
    return to_arrow(pl.from_arrow(group.select(["src", "dst"])).unique().sort("src", "dst"), EDGES)


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


def attach_clusters(rows: pa.Table, clusters: pa.Table) -> pa.Table:
    found = pc.index_in(rows["id"], value_set=clusters["id"])
    cluster_id = pc.coalesce(clusters["cluster_id"].take(found), rows["id"])
    size = pc.coalesce(clusters["cluster_size"].take(found), pa.scalar(1, pa.int64()))
    return rows.append_column("cluster_id", cluster_id).append_column("cluster_size", size)


def repeated_id(what: str, dup: str) -> AmaliaError:
    return AmaliaError(f"{what}: ids must be unique; '{dup}' appears more than once")


def smallest_repeated_id(group: pa.Table) -> pa.Table:
    """The part's smallest repeated id, if any: the driver gathers one row per part, however many ids repeat."""
    counts = pc.value_counts(group["id"].combine_chunks())
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    return pa.table({"id": pa.array([pc.min(repeated).as_py()] if len(repeated) else [], pa.string())})


def local_components(*tables: pa.Table) -> pa.Table:
    """Edges (`src`, `dst`) in one process -> `node`, `label` (the component's smallest id) for every node on an
    edge: scipy's union-find over integer codes of the ids."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components as scipy_components

    tables = [t.select(["src", "dst"]) for t in tables if len(t)]
    if not tables:
        return LABELS.empty_table()
    edges = pa.concat_tables(tables)
    ends = pa.concat_arrays([edges[c].cast(pa.large_string()).combine_chunks() for c in ("src", "dst")])
    encoded = pc.dictionary_encode(ends)
    nodes, codes = encoded.dictionary, encoded.indices.to_numpy(zero_copy_only=False)
    n, m = len(nodes), len(edges)
    graph = coo_matrix((np.ones(m, np.int8), (codes[:m], codes[m:])), shape=(n, n))
    _, component = scipy_components(graph, directed=False)
    df = pl.DataFrame({"node": pl.from_arrow(nodes), "component": component})
    return to_arrow(df.with_columns(label=pl.col("node").min().over("component")).select("node", "label"), LABELS)


def summary(n_docs: int, stats: dict, n_kept: int, params: MinHashParams, threshold: float | None,
            similarity: str) -> dict:
    """What `amalia data dedup` prints."""
    return {"documents": n_docs, **stats, "kept": n_kept, "removed": n_docs - n_kept, "num_perm": params.num_perm,
            "bands": params.bands, "rows": params.rows, "ngram": params.ngram, "threshold": threshold,
            **({"similarity": similarity} if threshold else {})}
