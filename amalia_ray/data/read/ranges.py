"""Cutting one large file into byte ranges that separate read tasks can read, each record exactly once and located as
a whole-file read locates it.

- Uncompressed jsonl: cut every `range_bytes`; a range holds the lines that start in it (`readers._lines`). Its
  records are located by line number, so the newlines of each range are counted first.
- Uncompressed text split into paragraphs or separator blocks (in UTF-8 or a one-byte ASCII-compatible encoding,
  where a blank line or a separator line is the same bytes wherever it stands): each cut moves to the end of the
  first document boundary after it, found on the bytes with the reader's own rule, and a range is the whole
  documents between two such boundaries. Documents are located by their number, so each range's are counted first.
- .warc.gz written a gzip member per record (as crawlers write them, so that any record can be read from its
  offset): each cut moves to the first gzip member at or after it whose content begins a WARC record, and a range
  is the whole members between two such starts. Its records are located by their offset in the decompressed
  stream, so the decompressed bytes of each range are counted first. A file compressed as one member (or whose
  members do not start records) has no such start past its beginning and stays one range.
- Uncompressed .warc: each cut moves to the first record start after it, a `WARC/1.x` line after a blank line whose
  record reads cleanly and ends where another record (or the file) begins; its records are located by their byte
  offset, which needs no counting.
- Parquet: cut every `range_bytes`; a range holds the row groups whose first page starts in it, read from the
  file's footer (`readers.read_parquet`), which also numbers their rows: nothing is counted first. A file written as
  one row group stays one task's work however it is cut.

Compressed jsonl and text (one gzip or zstd stream cannot be entered in the middle), ARC files, HTML and text read
one document per file stay one task per file.

The scans and counting passes run as one Ray task per range, in parallel, reading the file once more (at disk or
network speed, inflating the WARC members or decoding the text once more); a scan for a record start reads only
until it finds one.
"""

from __future__ import annotations

import codecs
import gzip
import re
import zlib

import ray

from amalia_ray.core.config import SourceConfig
from amalia_ray.data.read.streams import _CHUNK, InputFile, open_range

_GZIP_MAGIC = b"\x1f\x8b\x08"
_PROBE = 64 << 10  # the compressed bytes a member-start candidate is checked with
_LOOKAHEAD = 64  # bytes past a boundary's end that tell whether it is complete (a WARC version line fits)
_WARC_START = re.compile(rb"\n\r?\n(?=WARC/\d\.\d+\r?\n)")  # a blank line, then a version line: ends at the record
# a record header (at the start or after a blank line) up to the blank line that ends it, and its Content-Length
_WARC_HEADER = re.compile(rb"(?:\A|\n\r?\n)(WARC/\d\.\d+\r?\n(?:[^\r\n]+\r?\n){0,1000}?\r?\n)")
_CONTENT_LENGTH = re.compile(rb"(?im)^content-length:[ \t]*(\d{1,19})[ \t]*\r?$")
_CANDIDATES = 16  # record starts tried per cut of an uncompressed WARC


def _cut_by(path: str, source: SourceConfig) -> str | None:
    """What a file of this source is cut at when it is large: lines, documents, members, records or row groups; None
    when it is read whole however large."""
    compressed = path.endswith((".gz", ".zst"))
    if source.format == "parquet":
        return "row groups"
    if source.format == "jsonl":
        return None if compressed else "lines"
    if source.format == "warc":
        return "members" if path.endswith(".warc.gz") else "records" if path.endswith(".warc") else None
    if (source.format == "text" and source.split != "file" and not compressed and _bytes_are_ascii(source.encoding)
            and (source.split == "paragraph" or _separator_bytes(source))):
        return "documents"
    return None


def _bytes_are_ascii(encoding: str) -> bool:
    """Whether a newline, a blank or a separator line is the same bytes wherever it stands in text of this encoding:
    UTF-8 (no byte of a multi-byte character is ASCII), or a one-byte encoding that extends ASCII."""
    if codecs.lookup(encoding).name in ("utf-8", "utf-8-sig"):
        return True
    try:
        ascii_ok = bytes(range(128)).decode(encoding) == bytes(range(128)).decode("ascii")
        stateless = b"\x1b$B%%\n".decode(encoding, "surrogateescape").endswith("%%\n")  # not ISO-2022's shifts
        return ascii_ok and stateless and len(bytes(range(256)).decode(encoding, "surrogateescape")) == 256
    except (UnicodeDecodeError, LookupError):  # not a one-byte encoding (UTF-16, ...)
        return False


def splits_into_ranges(path: str, size: int, source: SourceConfig) -> bool:
    """Whether a file is read in ranges: one over the source's range_bytes that can be entered in the middle."""
    return size > source.range_bytes and _cut_by(path, source) is not None


def reads_to_range_end(path: str, source: SourceConfig) -> bool:
    """Whether a range of this file holds whole records and nothing past its end is read (members, WARC records,
    text documents), rather than the lines or row groups that start in it."""
    return _cut_by(path, source) in ("members", "records", "documents")


def _starts_a_record(data: bytes, at: int) -> bool:
    """Whether a gzip member starts at `data[at]` and its content begins with a WARC version line."""
    if at + 3 >= len(data) or data[at + 3] & 0xE0:  # reserved flag bits set: not a gzip header
        return False
    try:
        return zlib.decompressobj(31).decompress(data[at:at + _PROBE], 5) == b"WARC/"
    except zlib.error:
        return False


@ray.remote(num_cpus=1)
def first_member(path: str, source: SourceConfig, start: int, end: int) -> int | None:
    """The offset of the first gzip member in [start, end) that begins a WARC record, or None."""
    buffer, at, eof = b"", start, False
    with open_range(path, source.storage_options, start) as f:
        while True:
            while not eof and len(buffer) < 2 * _PROBE:
                chunk = f.read(_CHUNK)
                eof, buffer = not chunk, buffer + chunk
            checked = len(buffer) if eof else len(buffer) - _PROBE  # candidates whose probe bytes are all here
            i = buffer.find(_GZIP_MAGIC, 0, checked + len(_GZIP_MAGIC) - 1)
            while 0 <= i < checked:
                if at + i >= end:
                    return None
                if _starts_a_record(buffer, i):
                    return at + i
                i = buffer.find(_GZIP_MAGIC, i + 1, checked + len(_GZIP_MAGIC) - 1)
            if eof or at + checked >= end:
                return None
            buffer, at = buffer[checked:], at + checked


def _first_boundary(path: str, options: dict, start: int, end: int, boundary: re.Pattern) -> int | None:
    """The end of the first match of `boundary` that begins at or after `start` and ends before `end`, or None.
    The byte before `start` is read too, so a boundary that needs a line start (`^`) finds one only after a real
    newline; a match is taken only once the bytes after it are read (a greedy run of blank lines ends where a
    whole-file read ends it)."""
    at = max(start - 1, 0)
    buffer, pos, eof = b"", start - at, False
    with open_range(path, options, at) as f:
        while True:
            chunk = f.read(_CHUNK)
            eof, buffer = not chunk, buffer + chunk
            complete = len(buffer) if eof else len(buffer) - _LOOKAHEAD
            if (match := boundary.search(buffer, pos)) and match.end() <= complete:
                return at + match.end() if at + match.end() < end else None
            if eof or at + complete >= end:
                return None
            # keep one byte before where the search goes on (a line start stays one); a run of blank lines longer
            # than two chunks is entered at a later newline of it, which ends where the whole run ends
            keep = max(max(min(pos, complete), len(buffer) - 2 * _CHUNK) - 1, 0)
            buffer, at, pos = buffer[keep:], at + keep, max(pos - keep, 1)


def _separator_bytes(source: SourceConfig) -> bytes | None:
    """The separator as the file's bytes, or None when the encoding cannot write it."""
    encoding = "utf-8" if codecs.lookup(source.encoding).name == "utf-8-sig" else source.encoding
    try:
        return source.separator.encode(encoding)
    except UnicodeEncodeError:
        return None


def _boundary_pattern(source: SourceConfig) -> re.Pattern:
    """The bytes that end a document in a text file, by the reader's own rule (`readers._text_documents`): a line
    of the separator, or a run of blank lines (spaces, tabs and CRs) after a line. A run of blank lines counts only
    when the line after it starts with none of those, so the run cannot go on past what was read (the reader's
    greedy rule)."""
    if source.split == "separator":
        return re.compile(rb"(?m)^" + re.escape(_separator_bytes(source)) + rb"[ \t\r]*\n")
    return re.compile(rb"\n(?:[ \t\r]*\n)+(?=[^ \t\r\n])")


@ray.remote(num_cpus=1)
def first_document(path: str, source: SourceConfig, start: int, end: int) -> int | None:
    """Where the first document that begins in (start, end) of a text file begins, or None."""
    return _first_boundary(path, source.storage_options, start, end, _boundary_pattern(source))


@ray.remote(num_cpus=1)
def first_record(path: str, source: SourceConfig, start: int, end: int) -> int | None:
    """Where the first WARC record that begins in [start, end) of an uncompressed WARC file begins, or None. A
    candidate is a version line after a blank line; it is taken when (1) no record header in the `max_record_bytes`
    before it has a Content-Length that runs past it (it would lie inside that record: a WARC quoted in a page), and
    (2) the records from it read cleanly, each ending where the next begins, for `range_bytes` (or to the end of the
    file). Either check may pass over a true start (the cut then moves on, or the range joins the next); at most
    _CANDIDATES are tried per cut, so crafted bytes cost a bounded read."""
    from amalia_ray.data.read.archives import warc_records

    def inside_a_record(offset: int) -> bool:
        low = max(0, offset - source.max_record_bytes)
        with open_range(path, source.storage_options, low, offset - low) as f:
            before = f.read()
        for header in _WARC_HEADER.finditer(before):
            length = _CONTENT_LENGTH.search(before, header.start(1), header.end())
            if length and low + header.end() + int(length[1]) > offset:
                return True
        return False

    def broken_at(offset: int) -> int | None:
        with open_range(path, source.storage_options, offset) as f:
            for at, _, _, problem in warc_records(f, source.max_record_bytes):
                if problem is not None:
                    return offset + at
                if at >= source.range_bytes:
                    return None
        return None

    candidate = start
    for _ in range(_CANDIDATES):
        if (candidate := _first_boundary(path, source.storage_options, candidate, end, _WARC_START)) is None:
            return None
        if inside_a_record(candidate):
            candidate += 1
        elif (broken := broken_at(candidate)) is not None:
            candidate = broken + 1
        else:
            return candidate
    return None


@ray.remote(num_cpus=1)
def newlines(path: str, source: SourceConfig, start: int, end: int) -> int:
    """The newlines in bytes [start, end) of a file."""
    count, left = 0, end - start
    with open_range(path, source.storage_options, start, end - start) as f:
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


@ray.remote(num_cpus=1)
def inflated_bytes(path: str, source: SourceConfig, start: int, end: int) -> int:
    """The decompressed size of the gzip members in bytes [start, end) of a file (up to a broken member: what a
    reader of the range gets before it quarantines the rest)."""
    size = 0
    try:
        with open_range(path, source.storage_options, start, end - start) as raw, gzip.GzipFile(fileobj=raw) as f:
            while chunk := f.read1(_CHUNK):
                size += len(chunk)
    except (EOFError, OSError, zlib.error):
        pass
    return size


@ray.remote(num_cpus=1)
def documents(path: str, source: SourceConfig, start: int, end: int) -> int:
    """The documents a reader of bytes [start, end) of a text file numbers."""
    from amalia_ray.data.read.readers import read_text

    file = InputFile(path, source.storage_options, start, end, bounded=True)
    try:
        return sum(1 for _ in read_text(file, source))
    finally:
        file.close()


_SCANS = {"members": first_member, "records": first_record, "documents": first_document}
_COUNTS = {"lines": newlines, "members": inflated_bytes, "documents": documents}  # records, row groups: none


def plan_ranges(files: list[tuple[str, int, SourceConfig]]) -> list[list[tuple[int, int, int]]]:
    """The ranges each file is read in, as (start, end, what precedes start): [(0, size, 0)] for a file read whole.
    All files' scans, then all their counts, run as parallel tasks."""
    cuts, scans, kinds = [], [], []
    for path, size, source in files:
        kinds.append(_cut_by(path, source) if splits_into_ranges(path, size, source) else None)
        if kinds[-1] is None:
            cuts.append([0, size])
            continue
        cuts.append(list(range(0, size, source.range_bytes)) + [size])
        if scan := _SCANS.get(kinds[-1]):  # each cut moves to the next record start
            scans.append((len(cuts) - 1, [scan.remote(path, source, a, b)
                                          for a, b in zip(cuts[-1][1:], cuts[-1][2:])]))
    for index, refs in scans:
        size = cuts[index][-1]
        cuts[index] = [0, *sorted({m for m in ray.get(refs) if m is not None}), size]
    counts = []
    for (path, _, source), starts, kind in zip(files, cuts, kinds):
        count = _COUNTS.get(kind)
        counts.append([count.remote(path, source, a, b) for a, b in zip(starts[:-2], starts[1:-1])] if count else None)
    plans = []
    for starts, refs, kind in zip(cuts, counts, kinds):
        if refs is None:  # located by byte offset (a WARC record: what precedes is the start) or by the footer
            before = list(starts[:-1]) if kind == "records" else [0] * (len(starts) - 1)
        else:
            before = [0]
            for n in ray.get(refs):
                before.append(before[-1] + n)
        plans.append(list(zip(starts[:-1], starts[1:], before)))
    return plans
