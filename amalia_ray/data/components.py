"""Connected components of a duplicate graph on Ray tasks over Ray Data blocks, without any process holding all
edges.

Min-label propagation: every node starts with the smallest id among itself and its neighbours; each round the nodes
whose label changed send it to their neighbours, and every node keeps the smallest label it hears. A round is one
keyed shuffle (by node); rounds stop when no label changes. LSH buckets give star-shaped edges, so components have a
small diameter and few rounds are needed.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import ray

from amalia_ray.data.partitions import map_blocks, per_part, to_arrow, with_part

STATE = pa.schema([("part", pa.int32()), ("node", pa.string()), ("label", pa.string()),
                   ("nbrs", pa.list_(pa.string())), ("is_self", pa.bool_()), ("changed", pa.bool_())])


def connected_components(edges: ray.data.Dataset, partitions: int, max_rounds: int = 64
                         ) -> tuple[ray.data.Dataset, int]:
    """Edges (`src`, `dst`) -> (dataset of `node`, `label` for every node on an edge, rounds used). The label is the
    smallest id of the node's component."""

    def both_directions(batch: pa.Table) -> pa.Table:
        src, dst = batch["src"].combine_chunks(), batch["dst"].combine_chunks()
        table = pa.table({"node": pa.concat_arrays([src, dst]), "nbr": pa.concat_arrays([dst, src])})
        return with_part(table, "node", partitions)

    def send(batch: pa.Table) -> pa.Table:
        """Messages: a node whose label changed last round sends it to each neighbour (the others already did)."""
        df = pl.from_arrow(batch)
        msgs = (df.filter(pl.col("changed")).select(node=pl.col("nbrs"), label=pl.col("label")).explode("node")
                .with_columns(nbrs=pl.lit(None, pl.List(pl.String)), is_self=pl.lit(False), changed=pl.lit(False),
                              part=pl.lit(0, pl.Int32)))
        return with_part(to_arrow(msgs, STATE), "node", partitions)

    state = per_part(map_blocks(edges, both_directions), _init_state, partitions)
    rounds = 0
    while True:
        rounds += 1
        if rounds > max_rounds:
            raise RuntimeError(f"connected components did not converge in {max_rounds} rounds")
        state = per_part([state, map_blocks(state, send)], _receive, partitions)
        if not sum(ray.get([_changed.remote(block) for block in state.to_arrow_refs()])):
            break
    return map_blocks(state, lambda b: b.select(["node", "label"])), rounds


@ray.remote
def _changed(state: pa.Table) -> int:
    return pc.sum(state["changed"]).as_py() or 0 if len(state) else 0


def _init_state(group: pa.Table) -> pa.Table:
    df = (pl.from_arrow(group).group_by("node")
          .agg(part=pl.col("part").first(), nbrs=pl.col("nbr").unique().sort(), smallest=pl.col("nbr").min())
          .with_columns(label=pl.when(pl.col("smallest") < pl.col("node")).then(pl.col("smallest"))
                        .otherwise(pl.col("node")), is_self=pl.lit(True), changed=pl.lit(True)))
    return to_arrow(df, STATE)


def _receive(group: pa.Table) -> pa.Table:
    df = pl.from_arrow(group)
    heard = df.filter(~pl.col("is_self")).group_by("node").agg(heard=pl.col("label").min())
    df = (df.filter(pl.col("is_self")).join(heard, on="node", how="left")
          .with_columns(changed=pl.col("heard").is_not_null() & (pl.col("heard") < pl.col("label")))
          .with_columns(label=pl.when(pl.col("changed")).then(pl.col("heard")).otherwise(pl.col("label"))))
    return to_arrow(df, STATE)
