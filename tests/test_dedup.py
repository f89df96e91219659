"""Near-duplicate removal: MinHash units (fast) and the `amalia data dedup` contract on Ray (e2e)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from amalia_ray.data.minhash import MinHashParams, estimated_jaccard, shingle_hashes, signature, simplify
from amalia_ray.data.planted import pair_scores, plant_duplicates

REFERENCE = Path("/usr/share/debian-reference/debian-reference.pt.txt.gz")


def jaccard(a: str, b: str, k: int = 5) -> float:
    sa, sb = set(shingle_hashes(a, k).tolist()), set(shingle_hashes(b, k).tolist())
    return len(sa & sb) / len(sa | sb)


def test_simplify_folds_case_punctuation_and_space():
    assert simplify("Olá,  MUNDO!\n\tAção: já.") == "olá mundo ação já"


def test_signature_agreement_estimates_jaccard():
    p = MinHashParams(num_perm=256, bands=32)
    a, b = p.coefficients()
    words = [f"palavra{i}" for i in range(400)]
    x, y = " ".join(words[:300]), " ".join(words[100:])  # share 196 of 400 five-word shingles
    est = estimated_jaccard(signature(shingle_hashes(x, 5), a, b), signature(shingle_hashes(y, 5), a, b))
    assert abs(est - jaccard(x, y)) < 0.08


def test_params_validate_bands():
    with pytest.raises(ValueError, match="not a multiple of bands"):
        MinHashParams(num_perm=100, bands=14)
    assert MinHashParams().rows == 8


def test_pair_scores():
    truth = {"a": "a", "b": "a", "c": "c"}
    assert pair_scores({"a": "a", "b": "a", "c": "c"}, truth)["f1"] == 1.0
    assert pair_scores({"a": "a", "b": "b", "c": "c"}, truth)["recall"] == 0.0


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    if not REFERENCE.exists():
        pytest.skip("debian-reference-pt not installed (make corpus)")
    text = gzip.open(REFERENCE, "rt", encoding="utf-8").read()
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if len(p) > 500][:150]
    docs, truth = plant_duplicates(paragraphs, copies=2, edit_rate=0.01, dup_fraction=0.3, seed=3)
    folder = tmp_path_factory.mktemp("dedup")
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({**d, "source": "debian-reference"}, ensure_ascii=False) + "\n")
    return folder, docs, truth


@pytest.mark.e2e
def test_dedup_cli_contract_on_planted_duplicates(ray_cluster, planted):
    from typer.testing import CliRunner

    from amalia_ray.cli import app

    folder, docs, truth = planted
    outputs = []
    for run in ("a", "b"):
        result = CliRunner().invoke(app, ["data", "dedup", str(folder / "docs.jsonl"), str(folder / run)])
        assert result.exit_code == 0, result.output
        outputs.append(folder / run)
    clusters = pq.read_table(outputs[0] / "clusters.parquet")
    assert clusters.column_names == ["id", "cluster_id", "cluster_size"]
    rows = clusters.to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in docs), "every input document has a row"
    found = {r["id"]: r["cluster_id"] for r in rows}
    scores = pair_scores(found, truth)
    assert scores["precision"] >= 0.95 and scores["recall"] >= 0.9, scores
    sizes = {}
    for r in rows:
        sizes[r["cluster_id"]] = sizes.get(r["cluster_id"], 0) + 1
    assert all(r["cluster_size"] == sizes[r["cluster_id"]] for r in rows)

    kept = pq.read_table(outputs[0] / "kept")
    assert sorted(kept["id"].to_pylist()) == sorted(sizes), "one kept document per cluster: its smallest id"
    assert {"text", "source", "cluster_size"} <= set(kept.column_names), "kept rows keep their columns"
    again = pq.read_table(outputs[1] / "clusters.parquet")
    assert again.equals(clusters), "same input and seed give the same clusters"
    assert np.all(np.array(kept["cluster_size"].to_pylist()) >= 1)


def test_dedup_cli_rejects_bad_input(tmp_path):
    from typer.testing import CliRunner

    from amalia_ray.cli import app

    result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path / "missing.jsonl"), str(tmp_path / "out")])
    assert result.exit_code == 1 and "dedup input not found" in result.output
    result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path), str(tmp_path / "o"), "--num-perm", "100"])
    assert result.exit_code == 1 and "not a multiple of bands" in result.output
