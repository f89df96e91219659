"""Readers for every format: good records become documents, bad ones are quarantined with their location."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from amalia_ray.core.config import SourceConfig
from amalia_ray.data.readers import read_file

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
