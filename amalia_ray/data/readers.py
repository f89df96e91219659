"""Readers: turn corpus files into documents as a Ray Dataset, one Ray task per file.

Every document gets a stable `id` (the record's own id when it has one, else `<source>/<file>#<location>`),
`source`, `path`, `location` (line, row, paragraph or WARC offset), `text` and `metadata` (JSON). A record that
cannot be read becomes a row with `drop_reason = "quarantine:<why>"`, the error in its metadata and its raw content
(truncated) in `text`, so the stage writes it aside with its location while every good record of the same file is
kept: invalid UTF-8, NUL bytes, records over `max_record_bytes`, broken JSON or wrong field types, the cut-off end of
a truncated .gz/.zst file, broken WARC records (the reader finds the next record header and carries on), empty files.

Formats: text (plain or .gz/.zst; split into files, paragraphs or separator blocks), jsonl (.gz/.zst), Parquet,
HTML (main text by resiliparse) and WARC/ARC web archives (records framed here, parsed by fastwarc).

Paths are local files or globs, or URIs of object storage and other filesystems (s3://, gs://, abfs://, hdfs://,
any fsspec scheme: `core/filesystem.py`), listed once on the driver and streamed by the read tasks.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import io
import json
import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import ray

from amalia_ray.core.config import SourceConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.filesystem import open_filesystem

DOC_SCHEMA = pa.schema([
    ("id", pa.string()), ("source", pa.string()), ("path", pa.string()), ("location", pa.string()),
    ("text", pa.string()), ("metadata", pa.string()), ("drop_reason", pa.string()),
])
_RAW_LIMIT = 2000
_CHUNK = 1 << 20
_TABLE_BYTES = 8 << 20  # the text a read task gathers before handing a table on (its memory is several times it)


class Quarantine(Exception):
    """A record that cannot become a document: `reason` is the category the stats count, `detail` the specifics."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def expand_paths(source: SourceConfig, resolve, field: str, remote: bool = True) -> list[str]:
    """Every file a source names, in sorted order, each once (patterns may overlap); a path or glob that matches
    nothing is an error naming it. `remote=False`: the local paths only."""
    files: list[str] = []
    for i, pattern in enumerate(source.paths):
        if is_uri(pattern):
            if not remote:
                continue
            matches = [uri for uri, _ in list_remote(pattern, source.storage_options, f"{field}.paths[{i}]")]
            if not matches:
                raise AmaliaError(f"corpus path not found: {field}.paths[{i}] = '{pattern}' matches no object")
            files.extend(matches)
            continue
        resolved = str(resolve(pattern))
        matches = sorted(p for p in glob.glob(resolved, recursive=True) if Path(p).is_file())
        if not matches:
            raise AmaliaError(
                f"corpus path not found: {field}.paths[{i}] = '{pattern}' matches no file"
                + (" (install the demo corpus with `make corpus`)" if pattern.startswith("/usr/share") else "")
            )
        files.extend(matches)
    return list(dict.fromkeys(files))


def is_uri(path: str) -> bool:
    return "://" in path


_GLOB = re.compile(r"[*?\[]")


def _glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regular expression over whole paths: `*` and `?` stay inside one folder, `**/` spans any."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            inner = pattern[i + 1:end]
            out.append("[" + ("^" + inner[1:] if inner.startswith("!") else inner) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def list_remote(pattern: str, options: dict, field: str) -> list[tuple[str, object]]:
    """(URI, pyarrow FileInfo: size, mtime) of every object a URI or URI glob names, sorted: one listing of the
    folder before the first wildcard (recursive only when the pattern crosses folders)."""
    from pyarrow import fs as pafs

    try:
        filesystem, path = open_filesystem(pattern, options)
        # what comes before the path inside the filesystem (s3://, hdfs://namenode:8020, abfs://container@account…)
        at = pattern.rfind(path.rstrip("/"))
        prefix = pattern[:at] if at > 0 else pattern.split("://", 1)[0] + "://"
        wildcard = _GLOB.search(path)
        if wildcard is None:
            info = filesystem.get_file_info(path)
            if info.type == pafs.FileType.File:
                return [(prefix + path, info)]
            if info.type != pafs.FileType.Directory:
                return []
            base, matcher = path, None  # a folder: every object below it
        else:
            base = posixpath.dirname(path[:wildcard.start()] + "x")
            if not base.strip("/") or "/" not in path.lstrip("/"):
                raise AmaliaError(f"{field} = '{pattern}': a wildcard in the bucket or container name would list "
                                  "the whole account; name the bucket")
            matcher = _glob_regex(path)
        recursive = matcher is None or "/" in path[wildcard.start():] or "**" in path
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    except (OSError, ValueError) as e:  # re.error is a ValueError too: a malformed [...] class
        raise AmaliaError(f"{field} = '{pattern}': cannot list it: {type(e).__name__}: {e}") from None
    found = [(prefix + i.path, i) for i in infos
             if i.type == pafs.FileType.File and (matcher is None or matcher.match(i.path))]
    return sorted(found, key=lambda item: item[0])


def remote_fingerprint(patterns: list[str], options: dict, field: str) -> list[str]:
    """What identifies a source's remote objects without reading them: URI, size and modification time of each
    (from a listing like `expand_paths`'s); a stage over them reruns when one changes. A filesystem that gives no
    modification time leaves the size alone to tell a change."""
    return [f"{uri} {info.size} {info.mtime_ns}" for i, p in enumerate(patterns) if is_uri(p)
            for uri, info in list_remote(p, options, f"{field}.paths[{i}]")]


def relative_names(files: list[str]) -> dict[str, str]:
    """Each of a source's files by its path below the folder they all share (`part-0.jsonl`, `2024/a.warc.gz`):
    with the source's name it tells apart files of the same name in different sources or folders."""
    if not files:
        return {}
    local = [f for f in files if not is_uri(f)]
    names = {}
    if local:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in local])
        names.update({f: os.path.relpath(os.path.abspath(f), root) for f in local})
    remote = [f for f in files if is_uri(f)]
    if remote:
        root = posixpath.commonpath([posixpath.dirname(f.split("://", 1)[1]) for f in remote])
        names.update({f: posixpath.relpath(f.split("://", 1)[1], root) for f in remote})
    return names


class _ZstdStream(io.RawIOBase):
    """A .zst file decompressed across frames; unlike zstandard's stream_reader it notices a file cut short."""

    def __init__(self, raw):
        import zstandard

        self._zstd, self._raw, self._pending = zstandard, raw, b""
        self._dobj, self._started = zstandard.ZstdDecompressor().decompressobj(), False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            chunk = self._raw.read(_CHUNK)
            if not chunk:
                if self._started and not self._dobj.eof:
                    raise EOFError("zstd stream ended before the end of its frame")
                return 0
            while chunk:
                if self._dobj.eof:  # the next frame
                    self._dobj = self._zstd.ZstdDecompressor().decompressobj()
                self._started = True
                self._pending += self._dobj.decompress(chunk)
                chunk = self._dobj.unused_data if self._dobj.eof else b""
        n = min(len(buffer), len(self._pending))
        buffer[:n], self._pending = self._pending[:n], self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class StorageReadError(Exception):
    """Reading an object from storage failed (the network, permissions, an object gone since it was listed): not
    the input's fault, so the read task fails with it instead of quarantining the rest of the file (deliberately
    not an OSError, which the readers take for a broken file)."""


class _RemoteStream(io.RawIOBase):
    """An object's bytes from its filesystem, storage errors raised as StorageReadError."""

    def __init__(self, uri: str, options: dict | None):
        self._uri = uri
        try:
            filesystem, inner = open_filesystem(uri, options)
            self._native = filesystem.open_input_stream(inner, compression=None)
        except OSError as e:
            raise StorageReadError(f"{uri}: {e}") from e

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            return self._native.readinto(buffer)
        except OSError as e:
            raise StorageReadError(f"{self._uri}: {e}") from e

    def close(self) -> None:
        self._native.close()
        super().close()


class _ClosingGzip(gzip.GzipFile):
    """A GzipFile over a stream it opened: closing it closes the stream too (GzipFile leaves a given one open)."""

    def close(self) -> None:
        stream = self.fileobj
        try:
            super().close()
        finally:
            if stream is not None:
                stream.close()


def open_raw(path: str, options: dict | None = None):
    """A local file or a URI's object as a binary stream (the object is streamed, never fetched whole)."""
    if not is_uri(path):
        return open(path, "rb")
    return io.BufferedReader(_RemoteStream(path, options), buffer_size=_CHUNK)


def open_binary(path: str, options: dict | None = None) -> io.BufferedIOBase:
    """A file, transparently decompressed when it ends in .gz or .zst."""
    if path.endswith(".gz"):
        return _ClosingGzip(fileobj=open_raw(path, options), mode="rb")
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdStream(open_raw(path, options)), buffer_size=_CHUNK)
    return open_raw(path, options)


def read_at_most(path: str, limit: int, options: dict | None = None) -> tuple[bytes, int, Exception | None]:
    """Up to `limit` (decompressed) bytes of a file, its whole (decompressed) size, and the error that cut it short
    if any (truncated .gz/.zst): what was read before the error is still returned. Past `limit` the rest is only
    counted, so a huge file never sits in memory."""
    chunks: list[bytes] = []
    kept = size = 0
    try:
        with open_binary(path, options) as f:
            while chunk := f.read1(_CHUNK):  # read1: what was decompressed before an error is not lost with it
                size += len(chunk)
                if kept < limit:
                    chunks.append(chunk[:limit - kept])
                    kept += len(chunks[-1])
    except (EOFError, OSError, ValueError) as e:
        return b"".join(chunks), size, e
    return b"".join(chunks), size, None


def _decoded_blocks(path: str, encoding: str, options: dict | None = None
                    ) -> Iterator[tuple[str, Exception | None]]:
    """A file's text in blocks of about _CHUNK bytes, decoded incrementally (a character split across blocks stays
    whole; bytes that do not decode become lone surrogates); the error that cut the file short comes last."""
    decoder = codecs.getincrementaldecoder(encoding)(errors="surrogateescape")
    try:
        with open_binary(path, options) as f:
            while chunk := f.read1(_CHUNK):
                yield decoder.decode(chunk), None
    except (EOFError, OSError, ValueError) as e:
        yield decoder.decode(b"", final=True), e
        return
    yield decoder.decode(b"", final=True), None


def truncated(error: Exception) -> Quarantine:
    return Quarantine("truncated file", f"{type(error).__name__}: {error}")


def _preview(raw: bytes) -> str:
    return raw[:_RAW_LIMIT].decode("utf-8", "replace").replace("\x00", "\\x00")


_UNDECODED = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of bytes that do not decode
Record = tuple[str | None, str, str, dict, Quarantine | None]  # own id, location, text, metadata, why quarantined


def _text_documents(path: str, src: SourceConfig) -> Iterator[tuple[str, bool, Exception | None]]:
    """(document, cut over max_record_bytes, error) in file order, streamed: a document is split off as soon as the
    blank line or separator after it has been read, and one that grows past the cap keeps only its head."""
    if src.split == "file":
        raw, size, error = read_at_most(path, src.max_record_bytes + 1, src.storage_options)
        yield raw.decode(src.encoding, errors="surrogateescape"), size > src.max_record_bytes, error
        return
    boundary = (re.compile(rf"(?m)^{re.escape(src.separator)}[ \t\r]*\n") if src.split == "separator"
                else re.compile(r"\n(?:[ \t]*\n)+"))
    pending, oversized = "", False
    for block, error in _decoded_blocks(path, src.encoding, src.storage_options):
        pending += block
        start = 0
        for match in boundary.finditer(pending):
            if match.end() == len(pending) and error is None and block:
                break  # the boundary may go on in the next block
            yield pending[start:match.start()], oversized, None
            start, oversized = match.end(), False
        pending = pending[start:]
        if len(pending) > src.max_record_bytes:  # keep the head for the preview, count the rest as cut
            pending, oversized = pending[:_RAW_LIMIT], True
        if error is not None:
            yield pending, oversized, error
            return
    last = pending if src.split != "separator" else re.sub(rf"(?m)^{re.escape(src.separator)}\s*\Z", "", pending)
    yield last, oversized, None


def read_text(path: str, src: SourceConfig) -> Iterator[Record]:
    n = 0
    for doc, oversized, error in _text_documents(path, src):
        if not doc.strip() and not (error is not None and n == 0):
            continue
        where = f"{src.split} {n}" if doc.strip() else "file"
        n += 1
        if error is not None:  # the file was cut short: its last document may be too
            yield None, where, _preview(doc.encode(src.encoding, "surrogateescape")), {}, truncated(error)
        elif oversized or len(doc) > src.max_record_bytes:
            yield None, where, _preview(doc[:_RAW_LIMIT].encode(src.encoding, "surrogateescape")), {}, Quarantine(
                "record too large", f"over max_record_bytes={src.max_record_bytes}")
        elif bad := len(_UNDECODED.findall(doc)):
            yield None, where, _preview(doc.encode(src.encoding, "surrogateescape")), {}, Quarantine(
                f"invalid {src.encoding}", f"{bad} undecodable bytes")
        else:
            yield None, where, doc, {}, None


def _lines(f, limit: int) -> Iterator[tuple[int, bytes, int]]:
    """(line number, line, its full length) of a binary stream; a line over `limit` bytes comes back cut to its
    first `limit` bytes while the rest is skipped, so one huge line never sits in memory whole."""
    n = 0
    while line := f.readline(limit + 1):
        n += 1
        size = len(line)
        if size > limit and not line.endswith(b"\n"):
            while (rest := f.readline(_CHUNK)) and (size := size + len(rest)) and not rest.endswith(b"\n"):
                pass
        yield n, line[:limit], size


def read_jsonl(path: str, src: SourceConfig) -> Iterator[Record]:
    with open_binary(path, src.storage_options) as f:
        for n, line, size in _lines(f, src.max_record_bytes):
            if not line.strip():
                continue
            where = f"line {n}"
            if size > src.max_record_bytes:
                yield None, where, _preview(line), {}, Quarantine(
                    "record too large", f"{size} bytes, over max_record_bytes={src.max_record_bytes}")
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
                yield None, where, _preview(line), {}, Quarantine(
                    "invalid UTF-8" if isinstance(e, UnicodeDecodeError) else "invalid JSON",
                    "nested too deeply" if isinstance(e, RecursionError) else str(e))
                continue
            yield from _from_mapping(row, src, where)


def read_parquet(path: str, src: SourceConfig) -> Iterator[Record]:
    import pyarrow.parquet as pq

    offset = 0
    try:
        if is_uri(path):  # Parquet reads its footer first: a random-access file, not a stream
            filesystem, inner = open_filesystem(path, src.storage_options)
            opened = filesystem.open_input_file(inner)
        else:
            opened = contextlib.nullcontext(path)
        with opened as source:
            for batch in pq.ParquetFile(source).iter_batches(batch_size=4096):
                for n, row in enumerate(batch.to_pylist(), start=offset):
                    yield from _from_mapping(row, src, f"row {n}")
                offset += batch.num_rows
    except OSError as e:  # a broken file raises ArrowInvalid (a ValueError); an OSError from storage is the storage's
        if not is_uri(path):
            raise
        raise StorageReadError(f"{path}: {e}") from e


def _from_mapping(row, src: SourceConfig, where: str) -> Iterator[Record]:
    def raw() -> str:  # only for a record that is quarantined: good records are not serialized again
        return json.dumps(row, default=str, ensure_ascii=False)[:_RAW_LIMIT]

    if not isinstance(row, dict):
        yield None, where, raw(), {}, Quarantine("record is not an object", type(row).__name__)
        return
    text = row.get(src.text_field)
    if not isinstance(text, str) or not text.strip():
        yield None, where, raw(), {}, Quarantine(
            f"field '{src.text_field}' missing or not a non-empty string", type(text).__name__)
        return
    own_id = row.get(src.id_field)
    if own_id is not None and (isinstance(own_id, bool) or not isinstance(own_id, str | int)):
        yield None, where, raw(), {}, Quarantine(
            f"field '{src.id_field}' not a string or integer", type(own_id).__name__)
        return
    if len(text.encode("utf-8", "surrogatepass")) > src.max_record_bytes:
        yield None, where, text[:_RAW_LIMIT], {}, Quarantine(
            "record too large", f"text over max_record_bytes={src.max_record_bytes}")
        return
    meta = {k: v for k, v in row.items() if k not in (src.text_field, src.id_field)}
    yield (str(own_id) if own_id is not None else None), where, text, meta, None


def html_main_text(html: str) -> str:
    from resiliparse.extract.html2text import extract_plain_text

    return extract_plain_text(html, main_content=True, alt_texts=False, links=False, list_bullets=True)


def read_html(path: str, src: SourceConfig) -> Iterator[Record]:
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    raw, size, error = read_at_most(path, src.max_record_bytes + 1, src.storage_options)
    if error is not None:
        yield None, "file", _preview(raw), {}, truncated(error)
    elif size > src.max_record_bytes:
        yield None, "file", _preview(raw), {}, Quarantine(
            "record too large", f"{size} bytes, over max_record_bytes={src.max_record_bytes}")
    elif raw.strip():
        text = html_main_text(bytes_to_str(raw, detect_encoding(raw)))
        if text.strip():
            yield None, "file", text, {}, None
        else:
            yield None, "file", _preview(raw), {}, Quarantine("no main text in HTML")


class _Rewindable:
    """A binary stream that can take bytes back, counting the offset of what it hands out."""

    def __init__(self, f):
        self.f, self.buf, self.pos = f, b"", 0

    def readline(self, limit: int) -> bytes:
        if self.buf:
            end = self.buf.find(b"\n", 0, limit)
            if end >= 0 or len(self.buf) >= limit:
                cut = end + 1 if end >= 0 else limit
                line, self.buf = self.buf[:cut], self.buf[cut:]
            else:
                line, self.buf = self.buf + self.f.readline(limit - len(self.buf)), b""
        else:
            line = self.f.readline(limit)
        self.pos += len(line)
        return line

    def read(self, n: int) -> bytes:
        data, self.buf = self.buf[:n], self.buf[n:]
        if len(data) < n:
            data += self.f.read(n - len(data))
        self.pos += len(data)
        return data

    def unread(self, data: bytes) -> None:
        self.buf, self.pos = data + self.buf, self.pos - len(data)


_HEADER_LINE = 64 << 10
_VERSION_LINE = re.compile(rb"WARC/\d\.\d+\r?\n$")


def _record_start(line: bytes) -> int:
    """Where a `WARC/1.x` version line begins inside `line` (a record cut short runs straight into the next one),
    or -1."""
    match = _VERSION_LINE.search(line)
    return match.start() if match else -1


def warc_records(f, limit: int) -> Iterator[tuple[int, list[bytes], bytes, Quarantine | None]]:
    """(offset, header lines, whole record, problem) for every record of a decompressed WARC stream. A record cut
    short, one whose Content-Length does not land on the next record or runs past the end of the file, one over
    `limit` bytes, and bytes between records that are no record come back as problems; the reader then looks for
    the next `WARC/1.x` line, so one broken record never costs the records after it."""
    s = _Rewindable(f)
    junk_at, resyncing = None, False
    while line := s.readline(_HEADER_LINE):
        at = s.pos - len(line)
        if (start := _record_start(line)) > 0:
            s.unread(line[start:])
            line = line[:start]
        if start != 0:
            if line.strip() and junk_at is None and not resyncing:
                junk_at = at
            continue
        if junk_at is not None:
            yield junk_at, [], b"", Quarantine("broken WARC record", f"bytes {junk_at}-{at} are not a WARC record")
        junk_at, resyncing = None, False
        header, problem = [line], None
        while (line := s.readline(_HEADER_LINE)) and line.strip():
            if (start := _record_start(line)) >= 0:
                s.unread(line[start:])
                problem = "record cut short: the next record starts inside its header"
                break
            header.append(line)
            if len(header) > 1000:
                problem = "record header too long"
                break
        length = dict(_header_field(h) for h in header[1:]).get(b"content-length", b"")
        if problem:
            pass
        elif not line:
            problem = "the file ends inside the record header"
        elif not length.isdigit():
            problem = f"Content-Length {length[:40]!r} is not a number"
        elif int(length) > limit:
            problem = f"Content-Length {int(length)} over max_record_bytes={limit}"
        else:
            body, gap = s.read(int(length)), b""
            while (following := s.readline(_HEADER_LINE)) and not following.strip():
                gap += following
            # the body must end where the file ends or blank lines separate it from what follows
            if len(body) == int(length) and (gap or not following) and _record_start(body) < 0:
                s.unread(following)
                yield at, header, b"".join(header) + b"\r\n" + body + b"\r\n\r\n", None
                continue
            s.unread(body + gap + following)  # the next record may start inside what was read: look there
            problem = ("Content-Length runs past the end of the file" if len(body) < int(length)
                       else "Content-Length does not end where the record does")
        yield at, header, b"".join(header)[:_RAW_LIMIT], Quarantine("broken WARC record", problem)
        resyncing = True


def _header_field(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.strip().lower(), value.strip()


def read_warc(path: str, src: SourceConfig) -> Iterator[Record]:
    """Main text of the HTML responses of a WARC file; other record types are skipped, broken ones quarantined.
    ARC files (no WARC framing) go to fastwarc as they are."""
    if re.search(r"\.arc(\.gz)?$", path):
        yield from _read_arc(path, src.storage_options)
        return
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with open_binary(path, src.storage_options) as f:
        try:
            for at, header, record, problem in warc_records(f, src.max_record_bytes):
                where = f"record at byte {at}"
                fields = dict(_header_field(h) for h in header[1:])
                own_id = fields.get(b"warc-record-id", b"").decode("utf-8", "replace") or None
                meta = {"url": fields.get(b"warc-target-uri", b"").decode("utf-8", "replace") or None,
                        "date": fields.get(b"warc-date", b"").decode("utf-8", "replace") or None}
                if problem is not None:
                    yield own_id, where, _preview(record), meta, problem
                    continue
                if fields.get(b"warc-type", b"").lower() != b"response":
                    continue
                parsed = next(iter(ArchiveIterator(io.BytesIO(record), record_types=WarcRecordType.response,
                                                   parse_http=True)), None)
                yield from _warc_response(parsed, own_id, where, meta, record)
        except (EOFError, OSError, ValueError) as e:  # a .gz cut short: the records before it are kept
            yield None, "end of file", "", {}, truncated(e)


def _warc_response(parsed, own_id, where, meta, record: bytes) -> Iterator[Record]:
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    try:
        if parsed is None or parsed.http_headers is None:
            raise Quarantine("broken WARC record", "no HTTP response inside")
        if "html" not in (parsed.http_headers.get("Content-Type") or "").lower():
            return
        body = parsed.reader.read()
        text = html_main_text(bytes_to_str(body, detect_encoding(body)))
    except Quarantine as q:
        yield own_id, where, _preview(record), meta, q
        return
    except Exception as e:  # noqa: BLE001 - whatever the parser trips on, the record is quarantined, not the file
        yield own_id, where, _preview(record), meta, Quarantine("broken WARC record", f"{type(e).__name__}: {e}")
        return
    if text.strip():
        yield own_id, where, text, meta, None
    else:
        yield own_id, where, _preview(body), meta, Quarantine("no main text in HTML")


def _read_arc(path: str, options: dict) -> Iterator[Record]:
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with open_raw(path, options) as stream:
        for record in ArchiveIterator(stream, record_types=WarcRecordType.response, parse_http=True):
            meta = {"url": record.headers.get("WARC-Target-URI"), "date": record.headers.get("WARC-Date")}
            yield from _warc_response(record, record.record_id, f"record at byte {record.stream_pos}", meta, b"")


READERS = {"text": read_text, "jsonl": read_jsonl, "parquet": read_parquet, "html": read_html, "warc": read_warc}


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    """What a file's bytes can make the readers raise: a broken compression stream, a malformed format. Anything
    else (MemoryError, a bug) is not the input's fault and must not be turned into quarantine."""
    import zstandard

    return (OSError, ValueError, UnicodeError, zstandard.ZstdError, pa.ArrowException)


def read_file(path: str, src: SourceConfig, name: str | None = None) -> pa.Table:
    """All the documents of one file in one table (see read_file_tables)."""
    return pa.concat_tables(list(read_file_tables(path, src, name)))


def read_file_tables(path: str, src: SourceConfig, name: str | None = None) -> Iterator[pa.Table]:
    """The documents of one file, streamed: a table is handed on whenever about _TABLE_BYTES of text have been read,
    so a read task holds a bounded part of a file of any size. A document's id is `<source>/<name>#<location>`
    (`name`: the file's path below its source's shared folder, default its file name), unique across sources and
    files whatever ids the records carry; a record's own id (`id_field`, a WARC-Record-ID) is kept in the metadata
    as `record_id`. A record that cannot be parsed, or a file whose format is broken from some point on, is
    quarantined; any other error fails the stage, naming the file."""
    rows = {column: [] for column in DOC_SCHEMA.names}
    name = name or Path(path).name
    count, held = 0, 0

    def add(own_id, location, text, meta, problem: Quarantine | None):
        nonlocal count, held
        count, held = count + 1, held + len(text)
        if problem is None and "\x00" in text:
            problem, text = Quarantine("NUL bytes in text", "binary content?"), _preview(text.encode())
        if problem is not None:
            meta = {**meta, "error": problem.detail} if problem.detail else meta
        if own_id is not None:
            meta = {"record_id": own_id, **meta}
        rows["id"].append(f"{src.name}/{name}#{location}")
        rows["source"].append(src.name)
        rows["path"].append(path)
        rows["location"].append(location)
        rows["text"].append(text)
        rows["metadata"].append(json.dumps(meta, default=str, ensure_ascii=False) if meta else None)
        rows["drop_reason"].append(f"quarantine:{problem.reason}" if problem else None)

    def table() -> pa.Table:
        nonlocal held
        out, held = pa.table(rows, schema=DOC_SCHEMA), 0
        for column in rows.values():
            column.clear()
        return out

    try:
        for record in READERS[src.format](path, src):
            add(*record)
            if held >= _TABLE_BYTES:
                yield table()
    except EOFError as e:  # a .gz/.zst cut short: what came before it is kept
        add(None, f"after {count} records", "", {}, truncated(e))
    except _unreadable_errors() as e:  # the rest of the file cannot be read: what came before is kept
        add(None, f"after {count} records", "", {}, Quarantine("unreadable file", f"{type(e).__name__}: {e}"))
    except Exception as e:
        raise AmaliaError(f"data source '{src.name}': reading {path} failed after {count} records, not because of "
                          f"its content: {type(e).__name__}: {e}") from e
    if not count:
        add(None, "file", "", {}, Quarantine("no documents in file", "empty, or nothing readable as a document"))
    if rows["id"]:
        yield table()


def read_sources(sources: list[SourceConfig], resolve) -> ray.data.Dataset:
    items = [
        {"path": f, "source": i, "name": name}
        for i, s in enumerate(sources)
        for f, name in relative_names(expand_paths(s, resolve, f"data.sources[{i}]")).items()
    ]

    def read_batch(batch: pa.Table) -> Iterator[pa.Table]:
        for p, i, name in zip(batch["path"].to_pylist(), batch["source"].to_pylist(), batch["name"].to_pylist()):
            yield from read_file_tables(p, sources[i], name)

    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        read_batch, batch_size=1, batch_format="pyarrow"
    )
