"""Readers: turn corpus files into documents as a Ray Dataset, one Ray task per file.

Every document gets a stable `id` (the record's own id when it has one, else `<source>/<file>#<location>`),
`source`, `path`, `location` (line, row, paragraph or WARC offset), `text` and `metadata` (JSON). A record that
cannot be read becomes a row with `drop_reason = "quarantine:<why>"` and its raw content (truncated) in `text`, so
the stage writes it aside with its location while every good record of the same file is kept.

Formats: text (plain or .gz/.zst; split into files, paragraphs or separator blocks), jsonl (.gz/.zst), Parquet,
HTML (main text by resiliparse) and WARC/ARC web archives (fastwarc; HTML responses → main text).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import ray

from amalia_ray.core.config import SourceConfig
from amalia_ray.core.errors import AmaliaError

DOC_SCHEMA = pa.schema([
    ("id", pa.string()), ("source", pa.string()), ("path", pa.string()), ("location", pa.string()),
    ("text", pa.string()), ("metadata", pa.string()), ("drop_reason", pa.string()),
])
_RAW_LIMIT = 2000


def expand_paths(source: SourceConfig, resolve, field: str) -> list[str]:
    """Every file a source names, in sorted order; a path or glob that matches nothing is an error naming it."""
    files: list[str] = []
    for i, pattern in enumerate(source.paths):
        resolved = str(resolve(pattern))
        matches = sorted(p for p in glob.glob(resolved, recursive=True) if Path(p).is_file())
        if not matches:
            raise AmaliaError(
                f"corpus path not found: {field}.paths[{i}] = '{pattern}' matches no file"
                + (" (install the demo corpus with `make corpus`)" if pattern.startswith("/usr/share") else "")
            )
        files.extend(matches)
    return files


def open_binary(path: str) -> io.BufferedIOBase:
    """A file, transparently decompressed when it ends in .gz or .zst."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def split_documents(text: str, split: str, separator: str) -> list[str]:
    if split == "file":
        return [text]
    if split == "separator":
        return re.split(rf"(?m)^{re.escape(separator)}\s*$", text)
    return re.split(r"\n(?:[ \t]*\n)+", text)


Record = tuple[str | None, str, str, dict, str | None]  # own id, location, text, metadata, quarantine reason


def read_text(path: str, src: SourceConfig) -> Iterator[Record]:
    with open_binary(path) as f:
        raw = f.read()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.count("\ufffd".encode())
    for n, doc in enumerate(split_documents(text, src.split, src.separator)):
        if doc.strip():
            yield None, f"{src.split} {n}", doc, ({"invalid_utf8_bytes": bad} if bad else {}), None


def read_jsonl(path: str, src: SourceConfig) -> Iterator[Record]:
    with open_binary(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"line {n}"
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield None, where, line[:_RAW_LIMIT].decode("utf-8", "replace"), {}, f"invalid JSON ({e})"
                continue
            yield from _from_mapping(row, src, where)


def read_parquet(path: str, src: SourceConfig) -> Iterator[Record]:
    import pyarrow.parquet as pq

    offset = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for n, row in enumerate(batch.to_pylist(), start=offset):
            yield from _from_mapping(row, src, f"row {n}")
        offset += batch.num_rows


def _from_mapping(row, src: SourceConfig, where: str) -> Iterator[Record]:
    if not isinstance(row, dict):
        yield None, where, json.dumps(row, default=str)[:_RAW_LIMIT], {}, "record is not an object"
        return
    text = row.get(src.text_field)
    if not isinstance(text, str) or not text.strip():
        yield None, where, json.dumps(row, default=str, ensure_ascii=False)[:_RAW_LIMIT], {}, (
            f"field '{src.text_field}' missing or not a non-empty string")
        return
    own_id = row.get(src.id_field)
    meta = {k: v for k, v in row.items() if k not in (src.text_field, src.id_field)}
    yield (str(own_id) if own_id is not None else None), where, text, meta, None


def html_main_text(html: str) -> str:
    from resiliparse.extract.html2text import extract_plain_text

    return extract_plain_text(html, main_content=True, alt_texts=False, links=False, list_bullets=True)


def read_html(path: str, src: SourceConfig) -> Iterator[Record]:
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    with open_binary(path) as f:
        raw = f.read()
    text = html_main_text(bytes_to_str(raw, detect_encoding(raw)))
    if text.strip():
        yield None, "file", text, {}, None
    else:
        yield None, "file", raw[:_RAW_LIMIT].decode("utf-8", "replace"), {}, "no main text in HTML"


def read_warc(path: str, src: SourceConfig) -> Iterator[Record]:
    """HTML responses of a WARC (or ARC) file; other record types are skipped, broken ones quarantined."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    with open(path, "rb") as stream:
        for record in ArchiveIterator(stream, record_types=WarcRecordType.response, parse_http=True):
            where = f"record at byte {record.stream_pos}"
            url = record.headers.get("WARC-Target-URI")
            meta = {"url": url, "date": record.headers.get("WARC-Date")}
            try:
                content_type = (record.http_headers.get("Content-Type") or "") if record.http_headers else ""
                if "html" not in content_type.lower():
                    continue
                body = record.reader.read()
                text = html_main_text(bytes_to_str(body, detect_encoding(body)))
            except Exception as e:  # noqa: BLE001 - a broken record must not stop the file
                yield record.record_id, where, "", meta, f"unreadable WARC record ({type(e).__name__}: {e})"
                continue
            if text.strip():
                yield record.record_id, where, text, meta, None
            else:
                yield record.record_id, where, body[:_RAW_LIMIT].decode("utf-8", "replace"), meta, "no main text"


READERS = {"text": read_text, "jsonl": read_jsonl, "parquet": read_parquet, "html": read_html, "warc": read_warc}


def read_file(path: str, src: SourceConfig) -> pa.Table:
    rows = {name: [] for name in DOC_SCHEMA.names}

    def add(own_id, location, text, meta, reason):
        rows["id"].append(own_id or f"{src.name}/{Path(path).name}#{location}")
        rows["source"].append(src.name)
        rows["path"].append(path)
        rows["location"].append(location)
        rows["text"].append(text)
        rows["metadata"].append(json.dumps(meta, default=str, ensure_ascii=False) if meta else None)
        rows["drop_reason"].append(f"quarantine:{reason}" if reason else None)

    try:
        for record in READERS[src.format](path, src):
            add(*record)
    except Exception as e:  # noqa: BLE001 - an unreadable file is quarantined, the rest of the corpus goes on
        add(None, f"after {len(rows['id'])} records", "", {}, f"unreadable file ({type(e).__name__}: {e})")
    return pa.table(rows, schema=DOC_SCHEMA)


def read_sources(sources: list[SourceConfig], resolve) -> ray.data.Dataset:
    items = [
        {"path": f, "source": i}
        for i, s in enumerate(sources)
        for f in expand_paths(s, resolve, f"data.sources[{i}]")
    ]

    def read_batch(batch: pa.Table) -> pa.Table:
        tables = [read_file(p, sources[i]) for p, i in zip(batch["path"].to_pylist(), batch["source"].to_pylist())]
        return pa.concat_tables(tables) if tables else DOC_SCHEMA.empty_table()

    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        read_batch, batch_size=1, batch_format="pyarrow"
    )
