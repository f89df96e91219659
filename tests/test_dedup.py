"""Near-duplicate removal: MinHash units (fast) and the `amalia data dedup` contract on Ray (e2e)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import pyarrow as pa

from amalia_ray.data.dedup.minhash import (
    MinHashParams,
    band_keys,
    estimated_jaccard,
    exact_jaccard,
    shingles,
    signatures,
    words,
)
from amalia_ray.data.dedup.planted import (
    duplicate_pairs,
    plant_duplicates,
    reference_jaccard,
    threshold_scores,
)

REFERENCE = Path("/usr/share/debian-reference/debian-reference.pt.txt.gz")
P = MinHashParams()


def letters(i: int) -> str:
    """i written in letters (a, b, …, z, ba, bb, …): words that stay apart when numbers are folded to 0."""
    out = ""
    while True:
        i, r = divmod(i, 26)
        out = chr(97 + r) + out
        if not i:
            return out


def shingle_set(text: str, params: MinHashParams = P) -> set[int]:
    return set(shingles(pa.array([text]), params).hashes.tolist())


def test_words_fold_case_punctuation_space_numbers_and_diacritics():
    """datatrove's normalization: accents dropped (precomposed or not), numbers written 0, punctuation a space;
    spacing marks (Devanagari vowel signs) stay inside their words."""
    flat, counts = words(pa.array(["Olá,  MUNDO!\n\tAção: já.", "", None, "A\u0301gua\u00a0fria 12,5 € 2024",
                                   "हिन्दी भाषा"]))
    assert flat.to_pylist() == ["ola", "mundo", "acao", "ja", "agua", "fria", "0", "0", "हिनदी", "भाषा"]
    assert counts.tolist() == [4, 0, 0, 4, 2]


def test_shingles_per_text_do_not_depend_on_the_batch():
    texts = ["a b", "um dois três quatro cinco seis", "", "x", "Um dois, três quatro cinco seis!"]
    sh = shingles(pa.array(texts), P)
    assert sh.counts().tolist() == [1, 2, 0, 1, 2], "short text: one shingle; empty: none"
    for i, t in enumerate(texts):
        assert sh.hashes[sh.offsets[i]:sh.offsets[i + 1]].tolist() == shingles(pa.array([t]), P).hashes.tolist()
    assert shingle_set(texts[1]) == shingle_set(texts[4])
    assert shingle_set("a b") != shingle_set("b a") and shingle_set("a b") != shingle_set("a b c")


def test_shingle_hashes_match_a_per_text_loop():
    """The vectorized position arithmetic against the definition, text by text: the n-gram at every word position
    that has n-1 words after it (a text shorter than n: its whole word sequence), hashed position by position."""
    import polars as pl

    from amalia_ray.data.dedup.minhash import mix64

    texts = [" ".join(f"w{letters(j)}" for j in range(n)) for n in range(9)] + ["x y", "", "a b c d e f", "um"]
    for k in (1, 2, 5):
        p = MinHashParams(ngram=k)
        mult = p.position_multipliers(k)
        sh = shingles(pa.array(texts), p)
        for i, text in enumerate(texts):
            ws = text.split()
            hashed = pl.Series(ws, dtype=pl.String).hash(seed=p.seed).to_numpy().astype(np.uint64)
            grams = [hashed[s:s + k] for s in range(len(ws) - k + 1)] if len(ws) >= k else ([hashed] if ws else [])
            expected = [int(mix64(np.array([sum((g * mult[:len(g)]).tolist()) % 2**64], np.uint64))[0]) for g in grams]
            assert sh.hashes[sh.offsets[i]:sh.offsets[i + 1]].tolist() == expected, (k, text)


def test_signatures_match_the_definition_and_estimate_jaccard():
    p = MinHashParams(num_perm=256, bands=32)
    a, b = p.coefficients()
    words_ = [f"palavra{letters(i)}" for i in range(400)]
    x, y = " ".join(words_[:300]), " ".join(words_[100:])  # share 196 of 400 five-word shingles
    sh = shingles(pa.array([x, "", y]), p)
    sigs = signatures(sh, a, b, chunk=64)  # runs smaller than a text, to exercise the chunking
    naive = [min(((int(ai) * int(h) + int(bi)) % 2**64) >> 32 for h in shingle_set(x, p)) for ai, bi in zip(a, b)]
    assert sigs[0].tolist() == naive
    assert (sigs[1] == 2**32 - 1).all()
    assert abs(estimated_jaccard(sigs[0], sigs[2]) - 196 / 404) < 0.08
    keys = band_keys(np.stack([sigs[0], sigs[0]]), p)
    assert (keys[0] == keys[1]).all() and len(set(keys[0].tolist())) == p.bands
    from amalia_ray.data.dedup.minhash import SignatureSets, pair_jaccard

    rows = SignatureSets(p)(pa.table({"id": ["x", "e", "y"], "text": [x, "", y]}))["values"].combine_chunks()
    assert rows[0].as_py() == sigs[0].tolist() and rows[1].as_py() == sigs[1].tolist()
    estimated = pair_jaccard(rows.take([0, 0, 1]), rows.take([2, 0, 1]), "estimated")
    assert estimated.tolist() == [estimated_jaccard(sigs[0], sigs[2]), 1.0, 1.0]


def test_exact_jaccard_takes_sets():
    lists = pa.large_list(pa.uint64())
    got = exact_jaccard(pa.array([[1, 2, 2, 3], [], [5]], lists), pa.array([[2, 3, 4], [], [6]], lists))
    assert got.tolist() == [0.5, 1.0, 0.0]


def test_params_validate_bands():
    with pytest.raises(ValueError, match="not a multiple of bands"):
        MinHashParams(num_perm=100, bands=14)
    assert MinHashParams().rows == 8


def test_pair_scores():
    truth = {"a": "a", "b": "a", "c": "c"}
    planted = duplicate_pairs(truth)

    def scores(found):
        return threshold_scores(duplicate_pairs(found), planted, lambda p: p in planted)

    assert scores({"a": "a", "b": "a", "c": "c"})["f1"] == 1.0
    assert scores({"a": "a", "b": "b", "c": "c"})["recall"] == 0.0


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    if not REFERENCE.exists():
        pytest.skip("debian-reference-pt not installed (make corpus)")
    text = gzip.open(REFERENCE, "rt", encoding="utf-8").read()
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if len(p) > 500][:150]
    docs, truth = plant_duplicates(paragraphs, copies=1, edit_rate=0.01, dup_fraction=0.5, seed=3)
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
    for run, executor in (("a", "auto"), ("b", "ray"), ("c", "in-process")):
        result = CliRunner().invoke(app, ["data", "dedup", str(folder / "docs.jsonl"), str(folder / run),
                                          "--executor", executor])
        assert result.exit_code == 0, result.output
        assert re.search(r'"executor": "([^"]+)"', result.output)[1] == (
            "in-process" if executor == "in-process" else "ray"), "auto: on the Ray cluster this process is on"
        outputs.append(folder / run)
    clusters = pq.read_table(outputs[0] / "clusters.parquet")
    assert clusters.column_names == ["id", "cluster_id", "cluster_size"]
    rows = clusters.to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in docs), "every input document has a row"
    found = {r["id"]: r["cluster_id"] for r in rows}
    text_of = {d["id"]: d["text"] for d in docs}
    similar = {}

    def similarity(pair):
        if pair not in similar:
            similar[pair] = reference_jaccard(text_of[pair[0]], text_of[pair[1]])
        return similar[pair]

    planted_pairs = duplicate_pairs(truth)
    scores = threshold_scores(duplicate_pairs(found), planted_pairs, lambda p: similarity(p) >= 0.8)
    assert scores["precision"] >= 0.95 and scores["recall"] >= 0.9, scores
    clear = {p for p in planted_pairs if similarity(p) >= 0.9}
    assert len(clear) >= 30 and clear <= duplicate_pairs(found), "every planted pair with Jaccard >= 0.9 is found"
    sizes = {}
    for r in rows:
        sizes[r["cluster_id"]] = sizes.get(r["cluster_id"], 0) + 1
    assert all(r["cluster_size"] == sizes[r["cluster_id"]] for r in rows)

    kept = pq.read_table(outputs[0] / "kept")
    assert sorted(kept["id"].to_pylist()) == sorted(sizes), "one kept document per cluster: its smallest id"
    assert {"text", "source", "cluster_size"} <= set(kept.column_names), "kept rows keep their columns"
    for again in outputs[1:]:
        assert pq.read_table(again / "clusters.parquet").equals(clusters), \
            "same input and seed give the same clusters, on Ray or in this process"
        assert pq.read_table(again / "kept").sort_by("id").equals(kept.sort_by("id"))

    from amalia_ray.data.dedup.ray_executor import dedup
    from amalia_ray.data.dedup.in_process import dedup_in_process

    dedup(folder / "docs.jsonl", folder / "shuffled", MinHashParams(), 0.8, broadcast_rows=0)
    assert pq.read_table(folder / "shuffled" / "clusters.parquet").equals(clusters), \
        "joins by shuffle (large lookup tables) give what joins by broadcast give"
    assert sorted(pq.read_table(folder / "shuffled" / "kept")["id"].to_pylist()) == sorted(kept["id"].to_pylist())
    assert np.all(np.array(kept["cluster_size"].to_pylist()) >= 1)
    for threshold, similarity in ((None, "estimated"), (0.8, "exact")):  # unverified, verified exactly
        on_ray = dedup(folder / "docs.jsonl", folder / "r", MinHashParams(), threshold, similarity=similarity)
        here = dedup_in_process(folder / "docs.jsonl", folder / "p", MinHashParams(), threshold, similarity)
        assert here["duplicate_pairs"] == on_ray["duplicate_pairs"] and here["kept"] == on_ray["kept"]
        assert pq.read_table(folder / "p" / "clusters.parquet").equals(pq.read_table(folder / "r" / "clusters.parquet"))


def test_the_in_process_executor_does_not_import_ray():
    """Running in this process is for inputs where starting Ray costs more than the work: importing it would cost
    seconds too."""
    import subprocess
    import sys

    code = "import sys, amalia_ray.data.dedup.in_process; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == \
        "False"


def test_dedup_cli_rejects_bad_input(tmp_path):
    from typer.testing import CliRunner

    from amalia_ray.cli import app

    result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path / "missing.jsonl"), str(tmp_path / "out")])
    assert result.exit_code == 1 and "dedup input not found" in result.output
    result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path), str(tmp_path / "o"), "--num-perm", "100"])
    assert result.exit_code == 1 and "not a multiple of bands" in result.output
    result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path), str(tmp_path / "o"), "--executor", "spark"])
    assert result.exit_code == 1 and "--executor must be auto, ray or in-process" in result.output
    (tmp_path / "twice.jsonl").write_text('{"id": "a", "text": "um"}\n{"id": "b", "text": "dois"}\n'
                                          '{"id": "a", "text": "três"}\n')
    (tmp_path / "bare.jsonl").write_text('{"text": "sem id"}\n')
    (tmp_path / "mixed").mkdir()  # a second file without the text column
    (tmp_path / "mixed" / "a.jsonl").write_text('{"id": "a", "text": "um texto", "n": 1}\n')
    (tmp_path / "mixed" / "b.jsonl").write_text('{"id": "b", "body": "outro", "n": "dois"}\n')
    for name, error in (("twice.jsonl", "ids must be unique; 'a' appears more than once"),
                        ("bare.jsonl", "missing column(s) ['id']"), ("mixed", "missing column(s) ['text']")):
        result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path / name), str(tmp_path / "o"),
                                          "--executor", "in-process"])
        assert result.exit_code == 1 and error in result.output, result.output
    assert not (tmp_path / "o" / "clusters.parquet").exists(), "nothing written for a refused input"
    (tmp_path / "mixed" / "b.jsonl").write_text('{"id": "b", "text": "outro", "n": "dois"}\n')
    result = CliRunner().invoke(app, ["data", "dedup", str(tmp_path / "mixed"), str(tmp_path / "o"),
                                      "--executor", "in-process"])
    assert result.exit_code == 0, result.output  # columns of other types in another file: each kept as it came
    kept = sorted((r for f in (tmp_path / "o" / "kept").iterdir() for r in pq.read_table(f).to_pylist()),
                  key=lambda r: r["id"])
    assert [(r["id"], r["n"], r["cluster_size"]) for r in kept] == [("a", 1, 1), ("b", "dois", 1)]


@pytest.mark.e2e
@pytest.mark.reliability
def test_two_sources_with_the_same_file_names_and_record_ids_lose_nothing(ray_cluster, tmp_path,
                                                                          documents_stay_staged,
                                                                          keys_only_shuffles):
    """Two exports numbered the way most are (`part-0.jsonl` each, records "0", "1", …), one record of the second a
    near copy of one of the first: every document gets an id of its own (source, file, line), the records' own ids
    stay in the metadata, and near-dedup finds the one near duplicate across the sources and nothing else."""
    from amalia_ray.core.config import DataConfig, NearDedupConfig, SourceConfig
    from amalia_ray.data.curate import curate

    texts = [" ".join(f"{w}{letters((i * 7 + k) % 97)}" for k, w in enumerate(
        ["palavra", "texto", "frase", "linha", "termo", "nome", "coisa", "parte"] * 4)) for i in range(80)]
    near = texts[3].rsplit(" ", 1)[0] + " diferente"  # one word of 32 changed
    exports = {"a": texts[:40], "b": [*texts[40:52], near, *texts[53:80]]}
    for name, rows in exports.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "part-0.jsonl").write_text(
            "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(rows)))
    cfg = DataConfig(min_chars=10, near_dedup=NearDedupConfig(threshold=0.7), sources=[
        SourceConfig(name=name, paths=[str(tmp_path / name / "*.jsonl")], format="jsonl") for name in exports])
    stats = curate(cfg, Path, tmp_path / "out")
    assert stats["documents_after_filters"] == 80 and stats["near_duplicates_removed"] == 1, stats
    kept = pq.read_table(tmp_path / "out" / "kept").to_pylist()
    assert len({r["id"] for r in kept}) == len(kept) == 79
    removed = pq.read_table(tmp_path / "out" / "near_duplicates").to_pylist()
    assert [(r["id"], r["cluster_id"]) for r in removed] == [("b/part-0.jsonl#line 13", "a/part-0.jsonl#line 4")]
    assert {json.loads(r["metadata"])["record_id"] for r in kept if r["source"] == "b"} == {
        str(i) for i in range(40)} - {"12"}
