"""Connected components of a duplicate graph on Ray Data, without any process holding all edges.

Min-label propagation: every node starts with the smallest id among itself and its neighbours; each round a node
sends its label to its neighbours and keeps the smallest label it hears. Each round is one shuffle (groupby node);
rounds stop when no label changes. LSH buckets give star-shaped edges, so components have a small diameter and few
rounds are needed.
"""

from __future__ import annotations

import pyarrow as pa
import ray
from ray.data.expressions import col

STATE_SCHEMA = pa.schema([("node", pa.string()), ("label", pa.string()), ("nbrs", pa.list_(pa.string())),
                          ("is_self", pa.bool_()), ("changed", pa.bool_())])


def _both_directions(batch: pa.Table) -> pa.Table:
    return pa.table({"node": pa.concat_arrays([batch["src"].combine_chunks(), batch["dst"].combine_chunks()]),
                     "nbr": pa.concat_arrays([batch["dst"].combine_chunks(), batch["src"].combine_chunks()])})


def _init_state(group: pa.Table) -> pa.Table:
    node = group["node"][0].as_py()
    nbrs = sorted(set(group["nbr"].to_pylist()))
    return pa.table({"node": [node], "label": [min(node, nbrs[0])], "nbrs": [nbrs], "is_self": [True],
                     "changed": [True]}, schema=STATE_SCHEMA)


def _send(batch: pa.Table) -> pa.Table:
    """Each node row stays (is_self) and sends its label to every neighbour."""
    nodes, labels, nbrs = batch["node"].to_pylist(), batch["label"].to_pylist(), batch["nbrs"].to_pylist()
    out_node, out_label = list(nodes), list(labels)
    for label, ns in zip(labels, nbrs):
        out_node.extend(ns)
        out_label.extend([label] * len(ns))
    n_msgs = len(out_node) - len(nodes)
    return pa.table({
        "node": out_node, "label": out_label, "nbrs": list(nbrs) + [[]] * n_msgs,
        "is_self": [True] * len(nodes) + [False] * n_msgs, "changed": [False] * len(out_node),
    }, schema=STATE_SCHEMA)


def _receive(group: pa.Table) -> pa.Table:
    is_self = group["is_self"].to_pylist()
    me = is_self.index(True)
    old = group["label"][me].as_py()
    new = min(group["label"].to_pylist())
    return pa.table({"node": [group["node"][me].as_py()], "label": [new], "nbrs": [group["nbrs"][me].as_py()],
                     "is_self": [True], "changed": [new != old]}, schema=STATE_SCHEMA)


def connected_components(edges: ray.data.Dataset, partitions: int, max_rounds: int = 64) -> tuple[ray.data.Dataset, int]:
    """Edges (`src`, `dst`) -> (dataset of `node`, `label` for every node on an edge, rounds used). The label is the
    smallest id of the node's component."""
    state = (edges.map_batches(_both_directions, batch_format="pyarrow")
             .groupby("node", num_partitions=partitions).map_groups(_init_state, batch_format="pyarrow").materialize())
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        state = (state.map_batches(_send, batch_format="pyarrow")
                 .groupby("node", num_partitions=partitions).map_groups(_receive, batch_format="pyarrow").materialize())
        if not state.filter(expr=col("changed")).count():
            break
    else:
        raise RuntimeError(f"connected components did not converge in {max_rounds} rounds")
    return state.select_columns(["node", "label"]), rounds
