"""Connected components of a duplicate graph, labelled by the smallest id of each component.

An edge list that fits one task (`LOCAL_EDGES`) is solved there by scipy's union-find over integer codes of the
ids. A larger one is contracted on Ray tasks by alternating large-star and small-star steps (Kiveris et al., 2014,
"Connected Components in MapReduce and Beyond"), each one keyed exchange by node: the rounds grow with the log of
the component's size whatever its shape (a chain of near-copies, one edit after another, takes O(log² n) rounds,
not the n of label propagation) and no process holds all edges. It stops when a round changes no edge: at that
point every component is a star around its smallest id.
"""

from __future__ import annotations

import logging

import numpy as np
import polars as pl
import pyarrow as pa
import ray

from amalia_ray.data.dedup.dedup_steps import LABELS, local_components
from amalia_ray.data.exchange.frames import to_arrow
from amalia_ray.data.exchange.partitions import as_table, block_refs, exchange, map_blocks

log = logging.getLogger(__name__)

ARCS = pa.schema([("u", pa.large_string()), ("v", pa.large_string())])
# edges solved in one task: ~100 bytes each in strings, codes and the sparse matrix (1 GB at 10 M)
LOCAL_EDGES = 10_000_000


def connected_components(edges: ray.data.Dataset, local_edges: int = LOCAL_EDGES) -> tuple[ray.data.Dataset, int]:
    """Edges (`src`, `dst`) -> (dataset of `node`, `label` for every node on an edge, rounds of the distributed
    contraction; 0 when solved in one task)."""
    if edges.count() <= local_edges:
        return ray.data.from_arrow_refs([_local_components.remote(*[ref for ref, _ in block_refs(edges)])]), 0
    return _star_contraction(edges)


@ray.remote
def _local_components(*blocks: pa.Table) -> pa.Table:
    return local_components(*map(as_table, blocks))


def _star_contraction(edges: ray.data.Dataset) -> tuple[ray.data.Dataset, int]:
    arcs = map_blocks(edges, _both_directions)
    rounds, before = 0, None
    while True:
        rounds += 1
        arcs = map_blocks(exchange(arcs, "u", _large_star), _both_directions)
        arcs = exchange(arcs, "u", _small_star)
        fingerprint = tuple(np.sum(ray.get([_fingerprint.remote(ref) for ref, _ in block_refs(arcs)]), axis=0,
                                   dtype=np.uint64))
        log.info("connected components: round %d, %d edges", rounds, fingerprint[0])
        if fingerprint == before:
            break
        before = fingerprint
        arcs = map_blocks(arcs, _both_directions)
    # every component is now a star: its centre, the smallest id, is each edge's `v`
    labels = map_blocks(arcs, lambda b: pa.table({"node": pa.concat_arrays([b["u"].combine_chunks(),
                                                                          b["v"].combine_chunks()]),
                                                 "label": pa.concat_arrays([b["v"].combine_chunks()] * 2)}))
    return exchange(labels, "node", lambda g: to_arrow(pl.from_arrow(g).unique("node").sort("node"), LABELS)), rounds


def _both_directions(batch: pa.Table) -> pa.Table:
    """Edges (`src`, `dst`) or arcs (`u`, `v`) -> arcs both ways, so an exchange by `u` gives a node all its
    neighbours."""
    a, b = (batch["src"], batch["dst"]) if "src" in batch.column_names else (batch["u"], batch["v"])
    a, b = a.cast(pa.large_string()).combine_chunks(), b.cast(pa.large_string()).combine_chunks()
    return pa.table({"u": pa.concat_arrays([a, b]), "v": pa.concat_arrays([b, a])}, schema=ARCS)


def _large_star(group: pa.Table) -> pa.Table:
    """Each node u links every larger neighbour to the smallest of u and its neighbours."""
    df = pl.from_arrow(group).unique()
    smallest = df.group_by("u").agg(m=pl.col("v").min())
    out = (df.join(smallest, on="u").filter(pl.col("v") > pl.col("u"))
           .select(u=pl.col("v"), v=pl.min_horizontal("m", "u")).filter(pl.col("u") != pl.col("v")))
    return to_arrow(out.unique(), ARCS)


def _small_star(group: pa.Table) -> pa.Table:
    """Each node u links itself and every smaller neighbour to the smallest of them. Arcs come out as
    (member, smaller centre), each once."""
    df = pl.from_arrow(group).unique().filter(pl.col("v") < pl.col("u"))
    smallest = df.group_by("u").agg(m=pl.col("v").min())
    linked = df.join(smallest, on="u")
    out = pl.concat([linked.select(u=pl.col("v"), v=pl.col("m")), smallest.select(u=pl.col("u"), v=pl.col("m"))])
    return to_arrow(out.filter(pl.col("u") != pl.col("v")).unique(), ARCS)


@ray.remote(num_cpus=0.25)
def _fingerprint(block: pa.Table) -> np.ndarray:
    """Arc count and an order-free checksum of the arcs (duplicates across parts counted once per part)."""
    if not len(block):
        return np.zeros(2, np.uint64)
    hashed = pl.from_arrow(block).hash_rows(seed=1).to_numpy().astype(np.uint64)
    return np.array([len(hashed), np.sum(hashed, dtype=np.uint64)], np.uint64)
