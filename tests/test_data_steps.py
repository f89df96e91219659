import re

import pyarrow as pa

from amalia_ray.data.dedup.keep import ExactKeys, exact_copies
from amalia_ray.data.steps.quality import MinLength
from amalia_ray.data.steps.cleaning import Normalize
from amalia_ray.data.tokenize.mix import is_validation


def test_normalize_nfc_and_whitespace():
    decomposed = "Informac\u0327a\u0303o   sobre\t o  sistema  \r\n\n\n\n  segunda linha  "
    assert Normalize("NFC").clean(decomposed) == "Informação sobre o sistema\n\nsegunda linha"


def test_min_length_marks_instead_of_dropping():
    batch = pa.table({"id": ["a", "b"], "text": ["curto", "x" * 50]})
    out = MinLength(10)(batch)
    assert out.num_rows == 2
    assert out["drop_reason"].to_pylist() == ["min_chars", None]


def test_exact_dedup_keeps_smallest_id_and_counts_copies():
    """Decided on key rows (hash, id, where the document is): the text itself does not move."""
    group = pa.table({"id": ["src/b#2", "src/a#9", "src/c#1", "src/d#4", "src/e#0", "src/f#1"],
                      "text": ["t", "t", "u", "t", "u", "only once"], "_row": pa.array(range(6), pa.int64())})
    keys = ExactKeys("smallest_id")(group)
    assert "text" not in keys.column_names
    decided = exact_copies()(keys)
    ids = group["id"].to_pylist()
    columns = (decided[c].to_pylist() for c in ("_row", "duplicates", "is_copy"))
    by_id = {ids[r]: (n, copy) for r, n, copy in zip(*columns)}
    assert by_id == {"src/a#9": (3, False), "src/b#2": (3, True), "src/d#4": (3, True),
                     "src/c#1": (2, False), "src/e#0": (2, True)}, "a text found once gets no decision"


def test_text_documents_are_split_as_the_file_streams(tmp_path, monkeypatch):
    """Paragraphs, separator blocks and whole files, read a few bytes at a time (so every boundary, and a
    character, falls across blocks): the same documents as splitting the whole text at once."""
    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read import readers

    monkeypatch.setattr(readers, "_CHUNK", 3)
    text = "primeiro parágrafo\ncontinua\n\n  \nsegundo ção\n\n\n\nterceiro\n"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    (tmp_path / "f.txt").write_text("a\n%\nb ão\nb2\n%\n\n%\nc\n%", encoding="utf-8")

    def docs(name, split):
        src = SourceConfig(name="s", paths=["x"], format="text", split=split)
        file = readers.InputFile(str(tmp_path / name))
        return [(where, doc) for _, where, doc, _, problem in readers.read_text(file, src)]

    assert docs("t.txt", "paragraph") == [("paragraph 0", "primeiro parágrafo\ncontinua"),
                                          ("paragraph 1", "segundo ção"), ("paragraph 2", "terceiro\n")]
    assert [d for _, d in docs("f.txt", "separator")] == ["a\n", "b ão\nb2\n", "c\n"]
    assert docs("t.txt", "file") == [("file 0", text)]


def test_text_documents_follow_the_boundary_rule_whatever_the_blocks(tmp_path, monkeypatch):
    """Random texts of words, spaces, tabs, CRs, newlines and separator-like lines, read in blocks of 1 to 4,096
    bytes: the documents are those of splitting the whole text at `\r?\n(?:[ \t\r]*\n)+` (paragraphs: blank lines
    may hold spaces, tabs and CRs, and a CRLF line end before them is not the paragraph's) or at lines of
    the separator (blocks), and a document over max_record_bytes is cut to its head wherever the blocks end."""
    import random

    from amalia_ray.core.config import SourceConfig
    from amalia_ray.data.read import readers
    from amalia_ray.data.read.records import preview

    rng = random.Random(11)
    pieces = ["ção", "a", "b c", " ", "\t", "\r", "\n", "\n", "\n", "%", "%%", "% \t"]
    cases = [("a\n\n" + " " * 2595 + "x" + " " * 2000 + "\n\nfim", 4096),  # a block ends in a long line's spaces
             ("a" * 1000 + "\n%" + " " * 3000, 64)]  # a separator line at the very end, without its newline
    for trial in range(400):
        text = "".join(rng.choices(pieces, k=rng.randint(0, 60)))
        chunk = rng.choice([1, 2, 3, 7, 64, 2100, 4096])  # below and above what a document keeps
        if trial < len(cases):
            text, chunk = cases[trial]
        elif trial % 10 == 0:  # a document over the limit, one of exactly the limit, a long blank line
            text += rng.choice(["longo " * 400, "x" * 1024, " " * 3000 + "x", " " * 3000, " " * 2595 + "x"]) + \
                rng.choice(["\n\n", "\n%\n", "\n \n", "\n%", "\n%" + " " * 2500, ""]) + rng.choice(["fim", ""])
        (tmp_path / "t.txt").write_text(text, encoding="utf-8")
        monkeypatch.setattr(readers, "_CHUNK", chunk)
        for split in ("paragraph", "separator"):
            src = SourceConfig(name="s", paths=["x"], format="text", split=split, max_record_bytes=1024)
            got = [(doc, problem.reason if problem else None)
                   for _, _, doc, _, problem in readers.read_text(readers.InputFile(str(tmp_path / "t.txt")), src)]
            assert [where for _, where, *_ in readers.read_text(readers.InputFile(str(tmp_path / "t.txt")), src)] \
                == [f"{split} {i}" for i in range(len(got))]
            if split == "paragraph":
                expected = re.split(r"\r?\n(?:[ \t\r]*\n)+", text)
            else:
                expected = re.split(r"(?m)^%[ \t\r]*\n", text)
                expected[-1] = re.sub(r"(?m)^%\s*\Z", "", expected[-1])
            expected = [(d, None) if len(d) <= 1024 else (preview(d[:2000].encode()), "record too large")
                        for d in expected if d.strip()]
            assert got == expected, (split, text)


def test_validation_split_is_stable_and_near_fraction():
    ids = [f"doc{i}" for i in range(4000)]
    chosen = [i for i in ids if is_validation(i, 0.1)]
    assert chosen == [i for i in ids if is_validation(i, 0.1)]
    assert 300 < len(chosen) < 500


def test_mix_by_source_weights_are_epochs_and_deterministic():
    from amalia_ray.data.tokenize.mix import MixBySource

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


def test_a_selection_of_staged_files_takes_its_schema_from_the_whole_ones(tmp_path):
    """A column null in one staged file and typed in another unifies to the type; a selection made after the
    whole schema is known takes it from there (no footer read again) and equals one read from the footers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from amalia_ray.data.exchange.staged import Staged, StagedFile

    tables = [pa.table({"id": ["a"], "text": ["x"], "score": pa.array([None], pa.null())}),
              pa.table({"id": ["b"], "text": ["y"], "score": pa.array([0.5], pa.float64())})]
    files = []
    for i, t in enumerate(tables):
        pq.write_table(t, tmp_path / f"{i}.parquet")
        files.append(StagedFile(str(tmp_path / f"{i}.parquet"), 1, 10))
    whole = Staged(tuple(files))
    fresh = whole.select(["score", "id"]).unified_schema
    assert whole.unified_schema.field("score").type == pa.float64()
    for f in tmp_path.iterdir():
        f.unlink()  # a footer read now would fail
    assert whole.select(["score", "id"]).unified_schema == fresh == pa.schema([("score", pa.float64()),
                                                                              ("id", pa.string())])
