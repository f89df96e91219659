import pyarrow as pa

from amalia_ray.data.readers import split_documents
from amalia_ray.data.steps import ContentHash, MinLength, Normalize, is_validation, keep_first_per_hash


def test_normalize_nfc_and_whitespace():
    decomposed = "Informac\u0327a\u0303o   sobre\t o  sistema  \r\n\n\n\n  segunda linha  "
    assert Normalize("NFC").clean(decomposed) == "Informação sobre o sistema\n\nsegunda linha"


def test_min_length_marks_instead_of_dropping():
    batch = pa.table({"id": ["a", "b"], "text": ["curto", "x" * 50]})
    out = MinLength(10)(batch)
    assert out.num_rows == 2
    assert out["drop_reason"].to_pylist() == ["min_chars", None]


def test_exact_dedup_keeps_smallest_id_and_counts_copies():
    group = pa.table({"id": ["src/b#2", "src/a#9", "src/c#1", "src/d#4", "src/e#0"], "text": ["t", "t", "u", "t", "u"]})
    kept = keep_first_per_hash(ContentHash(partitions=1)(group)).sort_by("id")
    assert kept["id"].to_pylist() == ["src/a#9", "src/c#1"]
    assert kept["duplicates"].to_pylist() == [3, 2]
    assert "part" not in kept.column_names


def test_split_documents():
    text = "primeiro parágrafo\ncontinua\n\n  \nsegundo"
    assert split_documents(text, "paragraph", "%") == ["primeiro parágrafo\ncontinua", "segundo"]
    assert split_documents("a\n%\nb\n%\n", "separator", "%") == ["a\n", "\nb\n", ""]
    assert split_documents(text, "file", "%") == [text]


def test_validation_split_is_stable_and_near_fraction():
    ids = [f"doc{i}" for i in range(4000)]
    chosen = [i for i in ids if is_validation(i, 0.1)]
    assert chosen == [i for i in ids if is_validation(i, 0.1)]
    assert 300 < len(chosen) < 500


def test_mix_by_source_weights_are_epochs_and_deterministic():
    from amalia_ray.data.steps import MixBySource

    n = 2000
    batch = pa.table({"id": [f"d{i}" for i in range(n)], "source": ["pt"] * (n // 2) + ["br"] * (n // 2),
                      "text": ["t"] * n})
    mix = MixBySource({"pt": 2.0, "br": 0.25}, seed=1)
    out = mix(batch)
    sources = out["source"].to_pylist()
    assert sources.count("pt") == n  # every pt document twice
    assert 200 < sources.count("br") < 300  # a quarter of the br documents, by hash
    assert out.equals(MixBySource({"pt": 2.0, "br": 0.25}, seed=1)(batch))
    assert not out.equals(MixBySource({"pt": 2.0, "br": 0.25}, seed=2)(batch))
