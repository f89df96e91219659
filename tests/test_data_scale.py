"""The data stage's structure at web-archive scale, asserted on plans and small runs (time and memory growth are
bench/data_scaling.py's): shuffles sized by the bytes they move, not by the cluster's CPUs; report counts without a
shuffle; duplicate graphs of any diameter; ids checked without sorting the documents."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from amalia_ray.data.partitions import PIECE_BYTES, plan_exchange

GB = 1 << 30


def test_a_small_exchange_on_a_large_cluster_cuts_few_pieces():
    """50 MB of LSH band rows in 400 blocks on a 20 × 32-core cluster: one map task and a few parts (a shuffle of a
    task per block and two parts per CPU cut 400 × 1,281 pieces of ~100 bytes, all held by the driver)."""
    plan = plan_exchange([125_000] * 400, cpus=640)
    assert len(plan.map_groups) == 1 and sorted(i for g in plan.map_groups for i in g) == list(range(400))
    assert plan.parts <= 8 and plan.objects <= 20


@pytest.mark.parametrize("total", [10 * GB, 100 * GB, 1024 * GB])
def test_pieces_stay_over_a_megabyte_and_objects_grow_with_bytes_not_blocks(total):
    """At scale every piece is >= 1 MB (over Ray's 100 KB inline limit: kept in the object store, not the driver's
    memory), and the objects an exchange creates are about bytes / 1 MB however the input is blocked."""
    for block in (128 << 20, 8 << 20):  # Ray Data's block target, and blocks 16 times smaller
        plan = plan_exchange([block] * (total // block), cpus=640)
        assert total / (len(plan.map_groups) * plan.parts) >= PIECE_BYTES
        assert plan.objects <= 1.2 * total / PIECE_BYTES + 1000
        assert plan.total_bytes / plan.parts <= 2 * GB  # what one reduce task holds


def test_exchange_gives_each_part_all_rows_of_its_keys(ray_cluster):
    from amalia_ray.data.partitions import exchange, plan_exchange

    rows = [pa.table({"k": [f"key{(i * 7919) % 50}" for i in range(j * 40, j * 40 + 40)],
                      "v": list(range(j * 40, j * 40 + 40))}) for j in range(12)]
    ds = ray_cluster.data.from_arrow(rows)
    # three map tasks of four blocks, five parts
    plan = plan_exchange([1] * 12, cpus=1).__class__(5, ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)), 12)
    groups = exchange(ds, "k", lambda g: pa.table({"keys": [sorted(set(g["k"].to_pylist()))],
                                                    "v": [g["v"].to_pylist()]}), plan=plan).take_all()
    assert 1 < len(groups) <= 5
    seen = [k for g in groups for k in g["keys"]]
    assert len(seen) == len(set(seen)) == 50, "every key in exactly one part"
    assert sorted(v for g in groups for v in g["v"]) == list(range(480))
    for g in groups:
        assert list(g["v"]) == sorted(g["v"]), "rows of a part come in block order"


def test_report_counts_sum_per_block_group_bys(ray_cluster):
    from amalia_ray.data.partitions import count_by

    blocks = [pa.table({"source": ["a", "b", "a", None], "reason": [None, "x", None, "x"]}),
              pa.table({"source": pa.array([], pa.string()), "reason": pa.array([], pa.string())}),
              pa.table({"source": ["a"], "reason": ["x"]})]
    counts = count_by(ray_cluster.data.from_arrow(blocks), ["source", "reason"])
    assert sorted(counts, key=str) == sorted([
        {"source": "a", "reason": None, "count": 2}, {"source": "b", "reason": "x", "count": 1},
        {"source": None, "reason": "x", "count": 1}, {"source": "a", "reason": "x", "count": 1}], key=str)


def _reference_components(edges: list[tuple[str, str]]) -> dict[str, str]:
    parent: dict[str, str] = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent}


@pytest.mark.parametrize("local_edges", [0, 10_000_000], ids=["on-many-tasks", "in-one-task"])
def test_duplicate_chains_longer_than_any_round_cap_form_one_cluster(ray_cluster, local_edges):
    """A chain of 150 near-copies (each an edit of the one before) plus a random graph: each component labelled by
    its smallest id, on many tasks (star contraction, rounds ~ log² n) and in one (union-find). Label propagation
    needed 150 rounds for the chain and gave up after 64."""
    from amalia_ray.data.components import connected_components

    chain = [f"c{i:04d}" for i in range(150)]
    random.Random(1).shuffle(chain)
    rng = random.Random(2)
    edges = list(zip(chain[:-1], chain[1:])) + [
        (f"r{rng.randrange(300):03d}", f"r{rng.randrange(300):03d}") for _ in range(200)]
    edges = [(a, b) for a, b in edges if a != b]
    ds = ray_cluster.data.from_arrow([pa.table({"src": [a for a, _ in part], "dst": [b for _, b in part]})
                                      for part in (edges[:100], edges[100:220], edges[220:])])
    labels, rounds = connected_components(ds, local_edges=local_edges)
    found = {r["node"]: r["label"] for r in labels.take_all()}
    assert found == _reference_components(edges)
    assert set(found[c] for c in chain) == {"c0000"}
    assert (rounds == 0) == bool(local_edges) and rounds < 30


def test_a_repeated_id_is_found_without_sorting_the_documents(ray_cluster, keys_only_shuffles):
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.dedup import check_unique_ids

    docs = [pa.table({"id": [f"s/f#{i}" for i in range(j * 50, j * 50 + 50)], "text": ["x" * 1000] * 50})
            for j in range(6)]
    check_unique_ids(ray_cluster.data.from_arrow(docs), "test documents")
    docs[4] = docs[4].set_column(0, "id", pa.array([f"s/f#{i}" for i in range(200, 249)] + ["s/f#17"]))
    with pytest.raises(AmaliaError, match="'s/f#17' appears more than once"):
        check_unique_ids(ray_cluster.data.from_arrow(docs), "test documents")

