"""Bad input through every reader: invalid UTF-8, NUL bytes, a 50 MB single line, truncated .gz/.zst, wrong JSON
types, empty files, broken WARC records. No reader raises; every good record is kept and every bad one is
quarantined with its reason and location — the counts are exact."""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from amalia_ray.core.config import SourceConfig
from amalia_ray.data.read.readers import read_file
from tests.test_readers import warc_record

pytestmark = pytest.mark.reliability

TEXT = "A biblioteca municipal abriu uma nova sala de leitura para os mais novos."
HUGE = 50 << 20


def src(fmt, **kw):
    return SourceConfig(name="s", paths=["x"], format=fmt, **kw)


def outcome(path: Path, source: SourceConfig) -> tuple[list[str], collections.Counter]:
    """The texts kept and the count of each quarantine reason."""
    rows = read_file(str(path), source).to_pylist()
    kept = [r["text"] for r in rows if r["drop_reason"] is None]
    bad = collections.Counter(r["drop_reason"].removeprefix("quarantine:") for r in rows if r["drop_reason"])
    for r in rows:
        assert r["location"] and r["path"] == str(path), r
        if r["drop_reason"]:
            assert len(r["text"]) <= 2100, "a quarantined record keeps only a preview of its raw content"
    return kept, bad


def good(i: int) -> str:
    return f"{TEXT} Documento número {i}."


def jsonl_lines() -> tuple[list[bytes], int]:
    lines = [
        json.dumps({"id": "g0", "text": good(0)}).encode(),
        b'{"id": "u1", "text": "caf\xe9 sem UTF-8"}',                      # invalid UTF-8 (latin-1 byte)
        json.dumps({"id": "g1", "text": good(1)}).encode(),
        json.dumps({"id": "n1", "text": "nulo\u0000no meio"}).encode(),   # NUL in the text
        b'{"id": "n2", "text": "raw \x00 byte"}',                            # raw NUL: invalid JSON
        json.dumps({"id": "big", "text": "x" * HUGE}).encode(),            # a 50 MB single line
        json.dumps({"id": "g2", "text": good(2)}).encode(),
        json.dumps({"id": "t1", "text": 42}).encode(),                     # wrong types
        json.dumps({"id": "t2", "text": ["lista"]}).encode(),
        json.dumps({"id": {"nested": 1}, "text": good(99)}).encode(),
        json.dumps(["not", "an", "object"]).encode(),
        b"null",
        b"{truncated json",
        json.dumps({"id": 7, "text": good(3)}).encode(),
    ]
    return lines, 4


JSONL_BAD = {"invalid UTF-8": 1, "NUL bytes in text": 1, "invalid JSON": 2, "record too large": 1,
             "field 'text' missing or not a non-empty string": 2, "field 'id' not a string or integer": 1,
             "record is not an object": 2}


def test_jsonl_plain_gz_zst(tmp_path):
    lines, n_good = jsonl_lines()
    payload = b"\n".join(lines) + b"\n"
    for name, data in {"p.jsonl": payload, "p.jsonl.gz": gzip.compress(payload, compresslevel=1),
                       "p.jsonl.zst": zstandard.ZstdCompressor(level=1).compress(payload)}.items():
        (tmp_path / name).write_bytes(data)
        kept, bad = outcome(tmp_path / name, src("jsonl"))
        assert kept == [good(i) for i in range(n_good)], name
        assert bad == JSONL_BAD, name


def test_truncated_gz_and_zst_keep_what_came_before(tmp_path):
    n = 20_000  # zstd hands out whole blocks (128 KiB): enough of them that half the file holds some
    payload = "".join(json.dumps({"text": good(i)}) + "\n" for i in range(n)).encode()
    compressed = {"t.jsonl.gz": gzip.compress(payload), "t.jsonl.zst": zstandard.ZstdCompressor().compress(payload)}
    for name, data in compressed.items():
        (tmp_path / name).write_bytes(data[: len(data) // 2])
        kept, bad = outcome(tmp_path / name, src("jsonl"))
        assert 0 < len(kept) < n and kept == [good(i) for i in range(len(kept))], name
        assert bad == {"truncated file": 1}, name  # the cut-off tail, with where it stopped
    text = "\n\n".join(good(i) for i in range(2000)).encode()
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(text)[: len(gzip.compress(text)) // 2])
    kept, bad = outcome(tmp_path / "t.txt.gz", src("text"))
    assert 0 < len(kept) < 2000 and kept == [good(i) for i in range(len(kept))]
    assert bad == {"truncated file": 1}, "the last paragraph may be cut: quarantined, not kept"
    whole = gzip.compress(f"{good(0)}\n\n{good(1)}\n\n".encode())  # the file is cut right after a boundary
    (tmp_path / "u.txt.gz").write_bytes(whole + gzip.compress(good(2).encode())[:20])
    kept, bad = outcome(tmp_path / "u.txt.gz", src("text"))
    assert kept == [good(0), good(1)] and bad == {"truncated file": 1}, "the cut is reported even between documents"


def test_text_files(tmp_path):
    paragraphs = [good(0).encode(), "Pagamento em dinheiro: caf\xe9".encode("latin-1"), good(1).encode(),
                  b"bin\x00rio", b"y" * HUGE, good(2).encode()]
    (tmp_path / "t.txt").write_bytes(b"\n\n".join(paragraphs))
    kept, bad = outcome(tmp_path / "t.txt", src("text"))
    assert kept == [good(i) for i in range(3)]
    assert bad == {"invalid utf-8": 1, "NUL bytes in text": 1, "record too large": 1}
    # a legacy encoding, declared: nothing is lost
    (tmp_path / "l.txt").write_bytes("Coração e pão.\n\nAção.".encode("latin-1"))
    kept, bad = outcome(tmp_path / "l.txt", src("text", encoding="latin-1"))
    assert kept == ["Coração e pão.", "Ação."] and not bad


def test_empty_files_of_every_format(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    for name, fmt in [("e.jsonl", "jsonl"), ("e.jsonl.gz", "jsonl"), ("e.txt", "text"), ("e.html", "html"),
                      ("e.warc", "warc"), ("e.parquet", "parquet")]:
        if not (tmp_path / name).exists():
            (tmp_path / name).write_bytes(gzip.compress(b"") if name.endswith(".gz") else b"")
        kept, bad = outcome(tmp_path / name, src(fmt))
        assert not kept and bad == {"no documents in file": 1}, name


def test_parquet_wrong_types_and_a_corrupt_file(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": [good(0), None, "nul\x00"]}), tmp_path / "p.parquet")
    kept, bad = outcome(tmp_path / "p.parquet", src("parquet"))
    assert kept == [good(0)] and bad == {"field 'text' missing or not a non-empty string": 1, "NUL bytes in text": 1}
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    assert outcome(tmp_path / "ints.parquet", src("parquet"))[1] == {
        "field 'text' missing or not a non-empty string": 2}
    (tmp_path / "c.parquet").write_bytes(b"PAR1" + b"\x00" * 100)
    kept, bad = outcome(tmp_path / "c.parquet", src("parquet"))
    assert not kept and bad == {"unreadable file": 1}


def html_page(i: int) -> str:
    return f"<html><body><article><h1>Notícia</h1><p>{good(i)}</p></article></body></html>"


def test_warc_with_broken_records(tmp_path):
    def ok(i):
        return warc_record(f"https://arquivo.pt/{i}", html_page(i))

    wrong_length = ok(3).replace(b"Content-Length: ", b"Content-Length: 9", 1)  # runs into the records after it
    parts = [
        ok(0),
        b"JUNK BETWEEN RECORDS\r\n\r\n",
        ok(1),
        ok(2)[: len(ok(2)) // 3],                                  # cut short inside its header, the next follows
        ok(4),
        wrong_length,
        ok(5),
        warc_record("https://arquivo.pt/img.png", "PNG", content_type="image/png"),  # skipped: not HTML
        ok(6).replace(b"Content-Length: ", b"Content-Length: x", 1),  # not a number
        ok(7),
        ok(8)[: -40],                                              # the file ends inside the last record
    ]
    data = b"".join(parts)
    for name, blob in {"a.warc": data, "a.warc.gz": gzip.compress(data)}.items():
        (tmp_path / name).write_bytes(blob)
        kept, bad = outcome(tmp_path / name, src("warc"))
        assert [t.split("número ")[1] for t in kept] == ["0.", "1.", "4.", "5.", "7."], name
        assert bad == {"broken WARC record": 5}, name
    # gzip member by member (as crawlers write them), the file cut in the middle of a member
    members = b"".join(gzip.compress(ok(i)) for i in range(4))
    (tmp_path / "m.warc.gz").write_bytes(members[: len(members) - 60])
    kept, bad = outcome(tmp_path / "m.warc.gz", src("warc"))
    assert len(kept) == 3 and sum(bad.values()) >= 1 and set(bad) <= {"broken WARC record", "truncated file"}


@pytest.mark.e2e
def test_the_data_stage_quarantines_every_bad_record_and_keeps_the_rest(ray_cluster, tmp_path):
    """All of it at once through the curation stage on Ray Data: the stage completes, the kept documents are exactly
    the good ones, and `quarantine/` holds every bad record with its file, location, reason and error."""
    from amalia_ray.core.config import DataConfig
    from amalia_ray.data.curate import curate

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines, n_jsonl = jsonl_lines()
    (corpus / "a.jsonl.gz").write_bytes(gzip.compress(b"\n".join(lines) + b"\n", compresslevel=1))
    (corpus / "b.jsonl").write_bytes(b"")
    cut = gzip.compress("".join(json.dumps({"text": good(i)}) + "\n" for i in range(50, 5000)).encode())
    (corpus / "c.jsonl.gz").write_bytes(cut[: len(cut) // 2])
    n_cut = len(read_file(str(corpus / "c.jsonl.gz"), SourceConfig(name="json", paths=["x"], format="jsonl"))) - 1
    pages = [warc_record(f"https://arquivo.pt/{i}", html_page(7000 + i)) for i in range(3)]
    (corpus / "d.warc.gz").write_bytes(gzip.compress(pages[0] + b"JUNK\r\n\r\n" + pages[1] + pages[2][:-30]))
    (corpus / "e.txt").write_bytes(b"\n\n".join([good(8000).encode(), b"\xff\xfe bytes", good(8001).encode()]))
    cfg = DataConfig(min_chars=10, sources=[
        SourceConfig(name="json", paths=[str(corpus / "*.jsonl*")], format="jsonl"),
        SourceConfig(name="web", paths=[str(corpus / "*.warc.gz")], format="warc"),
        SourceConfig(name="txt", paths=[str(corpus / "*.txt")], format="text"),
    ])
    stats = curate(cfg, Path, tmp_path / "out")
    kept = pq.read_table(tmp_path / "out" / "kept").to_pylist()
    want = {good(i) for i in [*range(n_jsonl), *range(50, 50 + n_cut), 7000, 7001, 8000, 8001]}
    got = {r["text"].split("\n")[-1] for r in kept}
    assert got == want, (got - want, want - got)
    assert stats["documents_kept"] == len(want)
    quarantine = pq.read_table(tmp_path / "out" / "quarantine").to_pylist()
    reasons = collections.Counter((Path(r["path"]).name, r["drop_reason"]) for r in quarantine)
    assert reasons == {
        **{("a.jsonl.gz", f"quarantine:{k}"): v for k, v in JSONL_BAD.items()},
        ("b.jsonl", "quarantine:no documents in file"): 1,
        ("c.jsonl.gz", "quarantine:truncated file"): 1,
        ("d.warc.gz", "quarantine:broken WARC record"): 2,
        ("e.txt", "quarantine:invalid utf-8"): 1,
    }
    assert stats["quarantined"] == sum(reasons.values())
    assert all(r["location"] for r in quarantine) and all(json.loads(r["metadata"])["error"] for r in quarantine)


def test_an_error_that_is_not_the_inputs_fails_the_stage_naming_the_file(tmp_path, monkeypatch):
    """Only what the input's bytes cause is quarantined: a reader that runs out of memory (or any bug) fails the
    stage with the file named, instead of turning the rest of the file into a quarantine row."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.read import readers

    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": good(0)}) + "\n")

    def out_of_memory(p, src):
        yield from readers.read_jsonl(p, src)
        raise MemoryError

    monkeypatch.setitem(readers.READERS, "jsonl", out_of_memory)
    with pytest.raises(AmaliaError, match=rf"data source 's': reading {path} failed after 1 records, not because "
                                          "of its content: MemoryError"):
        read_file(str(path), src("jsonl"))


def test_mostly_unreadable_input_fails_the_stage_with_the_counts_per_reason(tmp_path):
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.curate import check_quarantine

    per_filter = [{"source": "web", "drop_reason": "quarantine:broken WARC record", "count": 30},
                  {"source": "json", "drop_reason": "quarantine:invalid JSON", "count": 5},
                  {"source": "json", "drop_reason": "min_chars", "count": 40}, {"source": "json",
                                                                                  "drop_reason": None, "count": 25}]
    check_quarantine(per_filter, 100, 0.35, tmp_path)  # 35 of 100: at the limit
    with pytest.raises(AmaliaError, match=r"35 of 100 records \(35%\) could not be read, over "
                                          r"data.max_quarantine_fraction=0.2: broken WARC record in web \(30\), "
                                          r"invalid JSON in json \(5\); the records are in "):
        check_quarantine(per_filter, 100, 0.2, tmp_path)


def test_a_read_task_holds_a_bounded_part_of_a_large_file(tmp_path):
    """A 200 MB jsonl read in a fresh process, its tables handed on as they fill: the process's peak memory grows by
    far less than the file (reading it whole grew by more than the file)."""
    import subprocess
    import sys

    path = tmp_path / "big.jsonl"
    line = (json.dumps({"id": "x", "text": good(1) * 12}) + "\n").encode()
    with open(path, "wb") as f:
        for _ in range((200 << 20) // (len(line) * 1000)):
            f.write(line * 1000)
    probe = (
        "import resource, sys\n"
        "from amalia_ray.core.config import SourceConfig\n"
        "from amalia_ray.data.read.readers import read_file_tables\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "rows = sum(t.num_rows for t in read_file_tables(sys.argv[1], SourceConfig(name='s', paths=['x'], "
        "format='jsonl')))\n"
        "print(rows, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows, grew = map(int, done.stdout.split())
    assert rows * len(line) == path.stat().st_size
    assert grew < 160 << 20, f"peak grew by {grew >> 20} MB reading a {path.stat().st_size >> 20} MB file"
