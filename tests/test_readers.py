"""Readers for every format: good records become documents, bad ones are quarantined with their location."""

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from amalia_ray.core.config import SourceConfig
from amalia_ray.data.read.readers import read_file

TEXT = "A biblioteca municipal abriu uma nova sala de leitura para os mais novos."


def src(fmt, **kw):
    return SourceConfig(name="s", paths=["x"], format=fmt, **kw)


def rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def test_jsonl_plain_gz_zst_with_quarantine(tmp_path):
    lines = [json.dumps({"id": "a1", "text": TEXT, "url": "https://exemplo.pt"}), "{broken json",
             json.dumps({"id": "a2", "body": "sem campo text"}), json.dumps({"text": TEXT + " Segunda."})]
    payload = ("\n".join(lines) + "\n").encode()
    files = {"plain.jsonl": payload, "c.jsonl.gz": gzip.compress(payload),
             "c.jsonl.zst": zstandard.ZstdCompressor().compress(payload)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out = rows(read_file(str(tmp_path / name), src("jsonl")))
        good = [r for r in out if r["drop_reason"] is None]
        bad = [r for r in out if r["drop_reason"]]
        assert [r["id"] for r in good] == [f"s/{name}#line 1", f"s/{name}#line 4"]
        assert json.loads(good[0]["metadata"]) == {"record_id": "a1", "url": "https://exemplo.pt"}
        assert [(r["location"], r["drop_reason"].split(" (")[0]) for r in bad] == [
            ("line 2", "quarantine:invalid JSON"),
            ("line 3", "quarantine:field 'text' missing or not a non-empty string"),
        ]
        assert "sem campo text" in bad[1]["text"], "the raw record is kept for inspection"


def test_parquet_custom_fields(tmp_path):
    pq.write_table(pa.table({"doc": ["d1", "d2"], "conteudo": [TEXT, None]}), tmp_path / "p.parquet")
    out = rows(read_file(str(tmp_path / "p.parquet"), src("parquet", text_field="conteudo", id_field="doc")))
    assert out[0]["id"] == "s/p.parquet#row 0" and out[0]["text"] == TEXT and out[0]["drop_reason"] is None
    assert json.loads(out[0]["metadata"]) == {"record_id": "d1"}
    assert out[1]["location"] == "row 1" and out[1]["drop_reason"].startswith("quarantine:field 'conteudo'")


def test_html_main_text(tmp_path):
    page = (f"<html><head><title>t</title></head><body><nav><a href='/'>Início</a> | Menu</nav>"
            f"<article><h1>Notícia</h1><p>{TEXT}</p></article><footer>Todos os direitos reservados</footer>"
            "</body></html>")
    (tmp_path / "p.html").write_text(page, encoding="utf-8")
    (out,) = rows(read_file(str(tmp_path / "p.html"), src("html")))
    assert TEXT in out["text"] and "Menu" not in out["text"] and out["drop_reason"] is None


def warc_record(uri: str, html: str, content_type: str = "text/html; charset=utf-8") -> bytes:
    body = html.encode()
    http = (f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    head = (f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Record-ID: <urn:uuid:{abs(hash(uri)):032x}>\r\n"
            f"WARC-Target-URI: {uri}\r\nWARC-Date: 2024-05-01T10:00:00Z\r\n"
            f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n").encode()
    return head + http + b"\r\n\r\n"


def test_warc_html_responses(tmp_path):
    data = (warc_record("https://arquivo.pt/a", f"<html><body><p>{TEXT}</p></body></html>")
            + warc_record("https://arquivo.pt/img.png", "PNG", content_type="image/png")
            + warc_record("https://arquivo.pt/b", "<html><body><p>Outra página com texto.</p></body></html>"))
    (tmp_path / "a.warc.gz").write_bytes(gzip.compress(data))
    out = rows(read_file(str(tmp_path / "a.warc.gz"), src("warc")))
    assert [json.loads(r["metadata"])["url"] for r in out] == ["https://arquivo.pt/a", "https://arquivo.pt/b"]
    assert out[0]["id"].startswith("s/a.warc.gz#") and TEXT in out[0]["text"]
    assert json.loads(out[0]["metadata"])["record_id"].startswith("<urn:uuid:")
    first = warc_record("https://arquivo.pt/a", f"<html><body><p>{TEXT}</p></body></html>")
    (tmp_path / "tail.warc").write_bytes(first + b"lixo no fim do ficheiro\r\n")  # no record after it
    out = rows(read_file(str(tmp_path / "tail.warc"), src("warc")))
    assert [r["drop_reason"] for r in out] == [None, "quarantine:broken WARC record"]
    assert out[1]["location"] == f"record at byte {len(first)}" and "are not a WARC record" in out[1]["metadata"]


def arc_record(url: str, html: str, content_type: str = "text/html", version: int = 1, length_off: int = 0) -> bytes:
    body = html.encode()
    http = f"HTTP/1.0 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    extra = "200 - - 0 x.arc " if version == 2 else ""
    return f"{url} 10.0.0.1 20010915103000 {content_type} {extra}{len(http) + length_off}\n".encode() + http + b"\n"


def test_arc_files_version_1_and_2_plain_and_member_by_member(tmp_path):
    """The web archive format before WARC (much of Arquivo.pt's older crawl): the file's description record and
    non-HTML records are skipped, each HTML response becomes a document with its URL and 14-digit date, and a
    record whose length is wrong or bytes that are no record are quarantined while the reader carries on."""
    desc = b"1 0 Arquivo\nURL IP-address Archive-date Content-type Archive-length\n"
    records = [b"filedesc://crawl.arc 0.0.0.0 20010915103000 text/plain %d\n" % len(desc) + desc + b"\n",
               arc_record("http://www.exemplo.pt/", f"<html><body><p>{TEXT}</p></body></html>"),
               arc_record("http://www.exemplo.pt/logo.gif", "GIF89a", content_type="image/gif"),
               arc_record("http://www.exemplo.pt/longo", "<html><body><p>Comprimento errado.</p></body></html>",
                          length_off=500),
               b"LIXO ENTRE REGISTOS\n",
               arc_record("http://www.exemplo.pt/b", "<html><body><p>Outra página do arquivo.</p></body></html>",
                          version=2)]
    files = {"c.arc": b"".join(records), "c.arc.gz": b"".join(gzip.compress(r) for r in records)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        out = rows(read_file(str(tmp_path / name), src("warc")))
        good = [r for r in out if r["drop_reason"] is None]
        assert [json.loads(r["metadata"]) for r in good] == [
            {"url": "http://www.exemplo.pt/", "date": "20010915103000"},
            {"url": "http://www.exemplo.pt/b", "date": "20010915103000"}], name
        assert TEXT in good[0]["text"] and "Outra página" in good[1]["text"]
        assert good[0]["id"] == f"s/{name}#record at byte {len(records[0])}"
        assert [r["drop_reason"] for r in out if r["drop_reason"]] == ["quarantine:broken ARC record"] * 2, name


def test_unreadable_file_is_quarantined_not_fatal(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    (out,) = rows(read_file(str(tmp_path / "bad.jsonl.gz"), src("jsonl")))
    assert out["drop_reason"].startswith("quarantine:unreadable file") and out["location"] == "after 0 records"


def test_text_paragraphs_and_locations(tmp_path):
    (tmp_path / "t.txt").write_text(f"{TEXT}\n\n\n{TEXT} Dois.\n", encoding="utf-8")
    out = rows(read_file(str(tmp_path / "t.txt"), src("text")))
    assert [r["id"] for r in out] == ["s/t.txt#paragraph 0", "s/t.txt#paragraph 1"]


def test_a_windows_text_file_is_split_into_its_paragraphs(tmp_path):
    """CRLF line ends: a blank line is "\r\n" (spaces, tabs and CRs only), and the line end before it is not the
    paragraph's."""
    (tmp_path / "w.txt").write_bytes(f"{TEXT}\r\nSegunda linha.\r\n\r\n{TEXT} Dois.\r\n \r\n\r\nTrês.\r\n".encode())
    out = rows(read_file(str(tmp_path / "w.txt"), src("text")))
    assert [r["text"].rstrip("\r\n") for r in out] == [f"{TEXT}\r\nSegunda linha.", f"{TEXT} Dois.", "Três."]
    assert out[0]["text"] == f"{TEXT}\r\nSegunda linha." and out[1]["text"] == f"{TEXT} Dois."


@pytest.mark.reliability
def test_a_lone_surrogate_or_a_huge_number_costs_its_own_line_only(tmp_path):
    """JSON's "\\ud83d" (half an emoji's UTF-16 pair) decodes to a string Arrow cannot write as UTF-8, and an integer
    of over 4,300 digits makes json.loads raise a plain ValueError: each quarantines its line, never the file or
    the lines after it; a surrogate in metadata is kept, escaped."""
    lines = [json.dumps({"text": f"{TEXT} {i}."}) for i in range(3)]
    lines[1:1] = ['{"text": "meio emoji \\ud83d aqui"}', '{"text": "n", "n": ' + "7" * 5000 + "}",
                  '{"text": "%s", "autor": "\\udc80"}' % TEXT]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    out = rows(read_file(str(tmp_path / "s.jsonl"), src("jsonl")))
    assert [(r["location"], r["drop_reason"]) for r in out] == [
        ("line 1", None), ("line 2", "quarantine:invalid UTF-8"), ("line 3", "quarantine:invalid JSON"),
        ("line 4", None), ("line 5", None), ("line 6", None)]
    assert "lone surrogate" in out[1]["metadata"] and out[1]["text"] == "meio emoji \ufffd aqui"
    assert "4300" in out[2]["metadata"]
    assert json.loads(out[3]["metadata"]) == {"autor": "\udc80"} and out[3]["text"] == TEXT


def _zstd_bomb(good_before: list[bytes], bomb_line: bytes, copies: int, good_after: list[bytes]) -> bytes:
    """A real .zst: good lines, then one line of `bomb_line` × `copies` (a few KB that inflate to hundreds of MB),
    then good lines again, all in one frame."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as w:
        w.write(b"".join(good_before))
        for _ in range(copies):
            w.write(bomb_line)
        w.write(b"\n" + b"".join(good_after))
    return out.getvalue()


GOOD = [json.dumps({"text": f"{TEXT} Parágrafo {i}."}).encode() + b"\n" for i in range(200)]


@pytest.mark.reliability
def test_a_zstd_bomb_is_cut_where_it_passes_the_limits_and_what_came_before_is_kept(tmp_path):
    """A 4 KB-per-100-MB line: by default the expansion limit stops the file as soon as it passes 100× (once past
    64 MiB), never holding more than a chunk; with no expansion limit, the line is skipped as too large while it is
    decompressed, and the good lines after it are kept too."""
    data = _zstd_bomb(GOOD, b"a" * (1 << 20), 160, GOOD[:5])
    assert len(data) < 64 << 10
    (tmp_path / "bomb.jsonl.zst").write_bytes(data)
    out = rows(read_file(str(tmp_path / "bomb.jsonl.zst"), src("jsonl")))
    assert sum(r["drop_reason"] is None for r in out) == 200
    (last,) = [r for r in out if r["drop_reason"]]
    assert last["drop_reason"] == "quarantine:decompression limit" and "over max_expansion=100" in last["metadata"]
    out = rows(read_file(str(tmp_path / "bomb.jsonl.zst"), src("jsonl", max_expansion=None)))
    assert sum(r["drop_reason"] is None for r in out) == 205
    assert [r["drop_reason"] for r in out if r["drop_reason"]] == ["quarantine:record too large"]


def test_the_boundary_after_a_document_over_the_limit_is_found_when_a_read_block_cuts_it(tmp_path, monkeypatch):
    """A document over max_record_bytes keeps only its head, but the blank line or separator line after it is kept
    whole even when a read block ends inside it: the next document is not swallowed by the oversized one."""
    from amalia_ray.data.read import readers

    monkeypatch.setattr(readers, "_CHUNK", 256)
    for split, boundary in (("paragraph", "\n \n"), ("separator", "\n%\n")):
        for cut in range(1, len(boundary)):  # where in the boundary the block ends
            text = "a" * (2560 - cut) + boundary + "o documento seguinte\n"
            (tmp_path / "t.txt").write_text(text)
            out = rows(read_file(str(tmp_path / "t.txt"), src("text", split=split, max_record_bytes=1024)))
            assert [(r["drop_reason"], r["text"][:5]) for r in out] == [
                ("quarantine:record too large", "aaaaa"), (None, "o doc")], (split, cut)


@pytest.mark.reliability
def test_gzip_and_warc_bombs_stop_at_the_limits(tmp_path):
    import tests.web_archive as web

    paragraphs = "\n\n".join(f"{TEXT} Número {i}." for i in range(50)).encode()
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(paragraphs + b"\n\n" + b"0" * (80 << 20), compresslevel=1))
    out = rows(read_file(str(tmp_path / "t.txt.gz"), src("text")))
    assert sum(r["drop_reason"] is None for r in out) == 50
    assert out[-1]["drop_reason"] == "quarantine:decompression limit"
    page = web.warc_record("http://exemplo.pt/", "2024-01-01T00:00:00Z", f"<html><body><p>{TEXT}</p></body></html>")
    bomb = web.warc_record("http://exemplo.pt/b", "2024-01-01T00:00:00Z", "<p>" + "0" * (80 << 20) + "</p>")
    (tmp_path / "a.warc.gz").write_bytes(gzip.compress(page) + gzip.compress(bomb, compresslevel=1))
    out = rows(read_file(str(tmp_path / "a.warc.gz"), src("warc")))
    reasons = [r["drop_reason"] for r in out]  # the record is over max_record_bytes too: skipped, then cut
    assert reasons[0] is None and reasons[-1] == "quarantine:decompression limit" and len(reasons) <= 3
    # a file over the per-file cap, however well it compresses
    out = rows(read_file(str(tmp_path / "t.txt.gz"), src("text", max_inflated_bytes=1 << 20, max_expansion=None)))
    assert out[-1]["drop_reason"] == "quarantine:decompression limit" and "max_inflated_bytes" in out[-1]["metadata"]


@pytest.mark.reliability
def test_a_parquet_value_repeated_by_its_dictionary_is_measured_before_it_is_decoded(tmp_path):
    """A 20 MB value stored once in a column's dictionary and referenced by 50,000 rows (1 TB decoded) in a file
    of a few hundred KB: those rows are quarantined as too large without being decoded; the others are kept."""
    big = "x" * (20 << 20)
    indices = pa.array([0 if i % 2 else 1 for i in range(50_000)], pa.int32())
    column = pa.DictionaryArray.from_arrays(indices, pa.array([big, TEXT]))
    pq.write_table(pa.table({"text": column}), tmp_path / "d.parquet", compression="zstd")
    assert (tmp_path / "d.parquet").stat().st_size < 2 << 20
    out = read_file(str(tmp_path / "d.parquet"), src("parquet"))
    reasons = out.column("drop_reason").to_pylist()
    assert reasons.count(None) == 25_000 and reasons.count("quarantine:record too large") == 25_000
    assert max(len(t) for t in out.column("text").to_pylist()) <= 2000


@pytest.mark.reliability
def test_a_warc_of_blank_runs_or_an_overshooting_record_is_read_in_linear_time():
    """2 M blank lines after a record (a few KB gzipped); a record whose Content-Length overshoots a 4 MB body of
    short lines, or 50,000 records (taken back and read again line by line, record by record, to find the next
    record): each used to cost its length squared (minutes to hours for these). Run in a thread so that a
    regression fails here instead of hanging."""
    import threading

    from amalia_ray.data.read.archives import warc_records

    def record(body=b"<html><body><p>" + TEXT.encode() + b"</p></body></html>", length=None):
        size = len(body) if length is None else length
        return b"WARC/1.0\r\nWARC-Type: response\r\nContent-Length: %d\r\n\r\n" % size + body + b"\r\n\r\n"

    short_lines = b"x\n" * 2_000_000
    inside = b"".join(record() for _ in range(50_000))  # 50,000 records read again after the one around them
    cases = {"blank run": record() + b"\r\n" * 2_000_000 + record(),
             "overshoot": record(short_lines, len(short_lines) + 10) + record(),
             "records inside": record(inside, len(inside) + 10) + b"\r\n\r\n" + record()}
    for name, data in cases.items():
        out = []
        worker = threading.Thread(target=lambda: out.append(list(warc_records(
            io.BufferedReader(io.BytesIO(data)), 1 << 24))), daemon=True)
        worker.start()
        worker.join(60)
        assert out, f"{name}: still reading after 60 s"
        problems = [p and p.reason for _, _, _, p in out[0]]
        expected = {"blank run": [None, None], "overshoot": ["broken WARC record", None],
                    "records inside": ["broken WARC record"] + [None] * 50_001}[name]
        assert problems == expected, (name, problems[:5])


@pytest.mark.reliability
@pytest.mark.parametrize("archive", ["warc", "arc"])
def test_headers_that_each_claim_megabytes_are_read_in_linear_time(archive):
    """40,000 short headers in a row, each claiming 16 MB (an ARC's or a WARC's, their lengths landing mid-line):
    each broken record's body was read again for the next header, 38 bytes on, so the file was read once per
    header (about 40,000 × 0.8 MB here; a 19 MB one took hours). Now what is read again is bounded by a multiple of
    what was passed: the reading ends in seconds, every header quarantined; a length of 5,000 digits is one too."""
    import threading

    from amalia_ray.data.read.archives import arc_records, warc_records

    unit = (b"WARC/1.0\r\nContent-Length: 16000000\r\n\r\n" if archive == "warc"
            else b"http://x/ 1.2.3.4 20200101000000 text/html 16000000\n")
    digits = (b"WARC/1.0\r\nContent-Length: " + b"7" * 5000 + b"\r\n\r\n" if archive == "warc"
              else b"http://x/ 1.2.3.4 20200101000000 text/html " + b"7" * 5000 + b"\n")
    records = warc_records if archive == "warc" else arc_records
    out = []
    worker = threading.Thread(target=lambda: out.append([p and p.reason for *_, p in records(
        io.BufferedReader(io.BytesIO(digits + unit * 40_000)), 1 << 26)]), daemon=True)
    worker.start()
    worker.join(60)
    assert out, "still reading after 60 s"
    assert out[0] and all(reason is not None and reason.startswith("broken") for reason in out[0]), out[0][:3]


def test_a_nested_value_over_the_limit_is_measured_as_itself_not_at_the_columns_mean(tmp_path):
    """One row of 1,000 holds 50 KB in a list<string> (a struct and a map likewise): measured as its own elements,
    not at the column's mean, it is quarantined as too large before it is decoded; the other rows are read."""
    rows = 1000
    tags = [["x" * 25_000, "y" * 25_000] if i == 7 else ["a"] for i in range(rows)]
    info = [{"autor": "z" * 50_000 if i == 8 else "b", "ano": i} for i in range(rows)]
    extra = [[("k", "w" * 50_000)] if i == 9 else [("k", "c")] for i in range(rows)]
    pq.write_table(pa.table({"text": [f"{TEXT} {i}" for i in range(rows)], "tags": tags, "info": info,
                             "extra": pa.array(extra, pa.map_(pa.string(), pa.string()))}),
                   tmp_path / "n.parquet")
    out = read_file(str(tmp_path / "n.parquet"), src("parquet", max_record_bytes=8192)).to_pylist()
    assert len(out) == rows
    big = {r["location"] for r in out if r["drop_reason"] == "quarantine:record too large"}
    assert big == {"row 7", "row 8", "row 9"}
    assert all(r["drop_reason"] is None for r in out if r["location"] not in big)
