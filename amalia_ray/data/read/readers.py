"""Readers: turn one input (a file, or a byte range of a large one: `streams.InputFile`) into documents, streamed as
Arrow tables.

Every document gets a stable `id` (the record's own id when it has one, else `<source>/<file>#<location>`),
`source`, `path`, `location` (line, row, paragraph or WARC offset), `text` and `metadata` (JSON). A record that
cannot be read becomes a row with `drop_reason = "quarantine:<why>"`, the error in its metadata and its raw content
(truncated) in `text`, so the stage writes it aside with its location while every good record of the same file is
kept: invalid UTF-8, NUL bytes, records over `max_record_bytes`, broken JSON or wrong field types, the cut-off end of
a truncated .gz/.zst file, broken WARC records (the reader finds the next record header and carries on), empty files.

Formats: text (plain or .gz/.zst; split into files, paragraphs or separator blocks), jsonl (.gz/.zst), Parquet,
HTML (main text by resiliparse) and WARC/ARC web archives (`archives.py`).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from amalia_ray.core.config import SourceConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.filesystem import open_filesystem
from amalia_ray.data.read.archives import read_warc
from amalia_ray.data.read.records import _RAW_LIMIT, Quarantine, Record, decode_html, html_main_text, preview, truncated
from amalia_ray.data.read.streams import _CHUNK, InflationLimit, InputFile, StorageReadError, check_inflation, is_uri

DOC_SCHEMA = pa.schema([
    ("id", pa.string()), ("source", pa.string()), ("path", pa.string()), ("location", pa.string()),
    ("text", pa.string()), ("metadata", pa.string()), ("drop_reason", pa.string()),
])
_PIECE_BYTES = 8 << 20  # Parquet rows decoded into Python objects at a time
_BATCH_BYTES = 64 << 20  # and read from the file at a time (about)
_TABLE_BYTES = 8 << 20  # the text a read task gathers before handing a table on (its memory is several times it)


def read_at_most(file: InputFile, limit: int) -> tuple[bytes, int, Exception | None]:
    """Up to `limit` (decompressed) bytes of a file, its whole (decompressed) size, and the error that cut it short
    if any (truncated .gz/.zst): what was read before the error is still returned. Past `limit` the rest is only
    counted, so a huge file never sits in memory."""
    chunks: list[bytes] = []
    kept = size = 0
    try:
        with file.open_binary() as f:
            while chunk := f.read1(_CHUNK):  # read1: what was decompressed before an error is not lost with it
                size += len(chunk)
                if kept < limit:
                    chunks.append(chunk[:limit - kept])
                    kept += len(chunks[-1])
    except (EOFError, OSError, ValueError) as e:
        return b"".join(chunks), size, e
    return b"".join(chunks), size, None


def _decoded_blocks(file: InputFile, encoding: str) -> Iterator[tuple[str, Exception | None]]:
    """A file's text in blocks of about _CHUNK bytes, decoded incrementally (a character split across blocks stays
    whole; bytes that do not decode become lone surrogates); the error that cut the file short comes last."""
    if file.start and codecs.lookup(encoding).name == "utf-8-sig":
        encoding = "utf-8"  # a range's first bytes are no byte-order mark: a U+FEFF there is text, as in a whole read
    decoder = codecs.getincrementaldecoder(encoding)(errors="surrogateescape")
    try:
        with file.open_binary() as f:
            while chunk := f.read1(_CHUNK):
                yield decoder.decode(chunk), None
    except (EOFError, OSError, ValueError) as e:
        yield decoder.decode(b"", final=True), e
        return
    yield decoder.decode(b"", final=True), None


_UNDECODED = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of bytes that do not decode


class _Document:
    """The document under way when it spans blocks: its text up to `keep` characters (past max_record_bytes only the
    head matters, for the preview), its full size, and whether what was left out of it has any non-whitespace."""

    def __init__(self, keep: int):
        self.keep, self.parts, self.size, self.text_left_out = keep, [], 0, False

    def add(self, text: str) -> None:
        room = self.keep - self.size
        if room > 0:
            self.parts.append(text[:room])
        if len(text) > max(room, 0):
            self.text_left_out = self.text_left_out or not text[max(room, 0):].isspace()
        self.size += len(text)


def _may_be_boundary(line: str, src: SourceConfig) -> bool:
    """Whether a line under way (no newline yet) could still turn out a boundary line."""
    if src.split == "paragraph":
        return not line.strip(" \t\r")
    head = line[:len(src.separator)]
    return src.separator.startswith(head) and not line[len(src.separator):].strip(" \t\r")


def _text_documents(file: InputFile, src: SourceConfig) -> Iterator[tuple[str, bool, bool, Exception | None]]:
    """(document, cut over max_record_bytes, has text other than whitespace, error) in file order, streamed. The
    documents are those of splitting the whole text at once, whatever blocks it is read in (so a byte range gives
    the documents a whole read gives there): paragraphs end at a run of blank lines (spaces, tabs and CRs only) after a
    line, and the line end before the run is not theirs (`\r?\n(?:[ \t\r]*\n)+`); separator blocks end at lines of the
    separator (trailing spaces, tabs or CR allowed), which belong to no block. Each block's whole lines are split
    by one regex search; only the line under way is carried to the next block, and one that grows past a block
    without being able to end a document is added to it and skipped to its newline, so memory stays bounded."""
    cap = src.max_record_bytes
    if src.split == "file":
        raw, size, error = read_at_most(file, cap + 1)
        text = raw.decode(src.encoding, errors="surrogateescape")
        yield text, size > cap, not text.isspace() and bool(text), error
        return
    paragraph, separator = src.split == "paragraph", src.separator
    keep = max(cap + len(separator) + 66, _RAW_LIMIT)  # a block's trailing separator line fits beside its text
    boundary = re.compile(r"(?m)^(?:[ \t\r]*\n)+" if paragraph else rf"(?m)^(?:{re.escape(separator)}[ \t\r]*\n)+")
    doc, line, seen_a_line, line_is_text = _Document(keep), "", False, False

    def done(document: _Document, last: bool = False) -> tuple[str, bool, bool]:
        text = "".join(document.parts)
        if document.size > keep:
            return text[:_RAW_LIMIT], True, document.text_left_out or not text.isspace()
        return whole(text, last)

    def whole(text: str, last: bool = False) -> tuple[str, bool, bool]:
        if paragraph and not last and text:
            text = text[:-2] if text.endswith("\r\n") else text[:-1]  # the line end before the blank line
        elif last and not paragraph:
            text = re.sub(rf"(?m)^{re.escape(separator)}\s*\Z", "", text)
        return (text if len(text) <= cap else text[:_RAW_LIMIT]), len(text) > cap, bool(text) and not text.isspace()

    for block, error in _decoded_blocks(file, src.encoding):
        if line_is_text:  # the rest of a long line is text up to its newline
            end = block.find("\n") + 1
            doc.add(block[:end] if end else block)
            if not end and error is None:
                continue
            block, line_is_text, seen_a_line = block[end:] if end else "", False, seen_a_line or bool(end)
        text = line + block
        cut = text.rfind("\n") + 1
        start = 0
        for match in boundary.finditer(text, 0, cut):
            at = match.start()
            if paragraph and at == 0 and not seen_a_line:  # the first line of the file ends no document
                at = text.find("\n") + 1
                if at == match.end():
                    continue
            if doc.size:  # begun in an earlier block
                doc.add(text[start:at])
                yield *done(doc), None
                doc = _Document(keep)
            else:
                yield *whole(text[start:at]), None
            start = match.end()
        doc.add(text[start:cut])
        seen_a_line = seen_a_line or cut > 0
        line = text[cut:]
        if error is not None:
            doc.add(line)
            yield *done(doc, last=True), error
            return
        if len(line) > min(_CHUNK, keep) and not _may_be_boundary(line, src):
            doc.add(line)
            line, line_is_text = "", True
        elif len(line) > keep:  # spaces that may yet end in a newline: how many no longer matters
            line = line[:keep]
    if not paragraph and len(line) >= len(separator) and _may_be_boundary(line, src):
        line = ""  # a separator line at the very end, without its newline, belongs to no block
    doc.add(line)
    yield *done(doc, last=True), None


def read_text(file: InputFile, src: SourceConfig) -> Iterator[Record]:
    """Documents numbered from the file's start (a range's numbering goes on from the documents before it)."""
    n = file.before
    for doc, oversized, has_text, error in _text_documents(file, src):
        if not has_text and error is None:
            continue
        where = f"{src.split} {n}" if has_text or n > file.before else "file"
        n += 1
        if error is not None:  # the file was cut short: its last document may be too
            yield None, where, preview(doc.encode(src.encoding, "surrogateescape")), {}, truncated(error)
        elif oversized:
            yield None, where, preview(doc[:_RAW_LIMIT].encode(src.encoding, "surrogateescape")), {}, Quarantine(
                "record too large", f"over max_record_bytes={src.max_record_bytes}")
        elif bad := len(_UNDECODED.findall(doc)):
            yield None, where, preview(doc.encode(src.encoding, "surrogateescape")), {}, Quarantine(
                f"invalid {src.encoding}", f"{bad} undecodable bytes")
        else:
            yield None, where, doc, {}, None


def _rest_of_line(f, size: int, stop: float = float("inf")) -> int:
    """Reads past the rest of a line (or until `size` reaches `stop`), never holding more than a chunk of it;
    returns the line's size so far."""
    while size < stop and (rest := f.readline(_CHUNK)):
        size += len(rest)
        if rest.endswith(b"\n"):
            break
    return size


def _lines(f, limit: int, file: InputFile) -> Iterator[tuple[int, bytes, int]]:
    """(line number, line, its full length) of a binary stream; a line over `limit` bytes comes back cut to its
    first `limit` bytes while the rest is skipped, so one huge line never sits in memory whole. From a byte range:
    the lines that start inside it, numbered as in the whole file."""
    n, at = file.before, file.start
    end = file.end if file.is_range else float("inf")
    if file.starts_inside_a_line():  # that line is the previous range's
        at, n = file.start + _rest_of_line(f, 0, end - file.start), n + 1
    while at < end and (line := f.readline(limit + 1)):
        n += 1
        size = len(line)
        if size > limit and not line.endswith(b"\n"):
            size = _rest_of_line(f, size)
        at += size
        yield n, line[:limit], size


def read_jsonl(file: InputFile, src: SourceConfig) -> Iterator[Record]:
    with file.open_binary() as f:
        for n, line, size in _lines(f, src.max_record_bytes, file):
            if not line.strip():
                continue
            where = f"line {n}"
            if size > src.max_record_bytes:
                yield None, where, preview(line), {}, Quarantine(
                    "record too large", f"{size} bytes, over max_record_bytes={src.max_record_bytes}")
                continue
            try:
                row = json.loads(line)
            # ValueError: JSONDecodeError, UnicodeDecodeError and the rest json.loads raises for one line's content
            # (an integer of over 4,300 digits): that line is quarantined, never the rest of the file
            except (ValueError, RecursionError) as e:
                yield None, where, preview(line), {}, Quarantine(
                    "invalid UTF-8" if isinstance(e, UnicodeDecodeError) else "invalid JSON",
                    "nested too deeply" if isinstance(e, RecursionError) else str(e))
                continue
            yield from _from_mapping(row, src, where)


def read_parquet(file: InputFile, src: SourceConfig) -> Iterator[Record]:
    """Rows as records, read so that a crafted file cannot inflate past the source's limits: each row group's
    uncompressed size (from the footer) is checked before it is read; dictionary-encoded columns stay encoded (a
    1 GB value repeated in every row would otherwise be copied into each), every row's size is measured from the
    Arrow buffers before it becomes Python objects, a row over max_record_bytes is quarantined unread, and rows
    are turned into records a few MB at a time. From a byte range: the row groups whose first page starts in it,
    their rows numbered as in the whole file."""
    import pyarrow.parquet as pq

    path = file.path
    try:
        if is_uri(path):  # Parquet reads its footer first: a random-access file, not a stream
            filesystem, inner = open_filesystem(path, src.storage_options)
            opened = filesystem.open_input_file(inner)
        else:
            opened = contextlib.nullcontext(path)
        with opened as source:
            try:
                meta = pq.ParquetFile(source).metadata
            except pa.ArrowInvalid:  # a malformed footer (a storage error is raised, whichever range meets it)
                if file.is_range and file.start > 0:  # it is quarantined once, by the first range
                    return
                raise
            # flat string columns with a dictionary page stay dictionary-encoded (reading them so costs hashing every
            # value once: the price of not decoding a bomb); nested columns and names with dots, which
            # read_dictionary cannot name, are read as they are
            encoded = sorted({c.path for j in range(meta.num_columns) for c in [meta.schema.column(j)]
                              if "." not in c.path and c.physical_type == "BYTE_ARRAY" and c.max_repetition_level == 0
                              and any(meta.row_group(g).column(j).has_dictionary_page
                                      for g in range(meta.num_row_groups))})
            parquet = pq.ParquetFile(source, read_dictionary=encoded, metadata=meta)
            offset = 0
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                if file.is_range and not file.start <= _first_page(group) < file.end:  # another range's group
                    offset += group.num_rows
                    continue
                packed, unpacked = (sum(getattr(group.column(j), f"total_{kind}_size") for j in range(group.num_columns))
                                    for kind in ("compressed", "uncompressed"))
                check_inflation(unpacked, packed, src.max_inflated_bytes, src.max_expansion, f"{path} row group {g}")
                # rows per batch by the row group's bytes: a batch of long rows is decoded before it is measured
                rows = max(1, min(4096, _BATCH_BYTES * group.num_rows // max(1, unpacked)))
                for batch in parquet.iter_batches(batch_size=rows, row_groups=[g]):
                    yield from _batch_records(batch, offset, src)
                    offset += batch.num_rows
    except OSError as e:  # a broken file raises ArrowInvalid (a ValueError); an OSError from storage is the storage's
        if not is_uri(path):
            raise
        raise StorageReadError(f"{path}: {e}") from e


def _first_page(group) -> int:
    """The file offset where a row group's first page (a dictionary page, else a data page) begins. parquet-mr
    before 1.11 wrote a dictionary offset of 0 into chunks that have none: such an offset is not believed (as
    Arrow's own reader does not)."""
    def first(c) -> int:
        dictionary = c.dictionary_page_offset if c.has_dictionary_page else None
        return dictionary if dictionary and 0 < dictionary <= c.data_page_offset else c.data_page_offset

    return min(first(group.column(j)) for j in range(group.num_columns))


def _batch_records(batch: pa.RecordBatch, offset: int, src: SourceConfig) -> Iterator[Record]:
    """The batch's rows as records, sized from the Arrow buffers first: a row over max_record_bytes is quarantined
    without being decoded; the others become Python objects about _PIECE_BYTES at a time."""
    import numpy as np

    sizes = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        sizes += _value_sizes(column)
    n = 0
    while n < batch.num_rows:
        if sizes[n] > src.max_record_bytes:
            yield None, f"row {offset + n}", _head(batch, n, src), {}, Quarantine(
                "record too large", f"{sizes[n]:,} bytes, over max_record_bytes={src.max_record_bytes}")
            n += 1
            continue
        stop, held = n, 0
        while stop < batch.num_rows and sizes[stop] <= src.max_record_bytes and \
                (stop == n or held + sizes[stop] <= _PIECE_BYTES):
            held, stop = held + sizes[stop], stop + 1
        for i, row in enumerate(batch.slice(n, stop - n).to_pylist()):
            yield from _from_mapping(row, src, f"row {offset + n + i}")
        n = stop


def _value_sizes(column: pa.Array):
    """Each row's bytes in a column as it will be decoded: a dictionary-encoded value at its decoded size, a list or
    map the sum of its elements', a struct the sum of its fields', a fixed-width value its width (one huge nested
    value measured at the column's mean would pass unmeasured into Python objects)."""
    import numpy as np
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_map(kind):  # as the list of {key, value} structs it is
        column = column.cast(pa.list_(pa.struct([pa.field("key", kind.key_type, nullable=False),
                                                  pa.field("value", kind.item_type)])))
        kind = column.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        elements = pc.list_flatten(column)
        if len(elements) == 0:
            return np.zeros(len(column), dtype=np.int64)
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=_value_sizes(elements), minlength=len(column)).astype(np.int64)
    if pa.types.is_struct(kind):
        total = np.zeros(len(column), dtype=np.int64)
        for i in range(kind.num_fields):
            total += _value_sizes(pc.struct_field(column, [i]))
        return total
    if pa.types.is_null(kind):
        return np.zeros(len(column), dtype=np.int64)
    if pa.types.is_primitive(kind) or pa.types.is_decimal(kind) or pa.types.is_fixed_size_binary(kind):
        return np.full(len(column), -(-kind.bit_width // 8), dtype=np.int64)

    if pa.types.is_dictionary(column.type):
        if len(column.dictionary) == 0:  # every value null
            return np.zeros(len(column), dtype=np.int64)
        lengths = _value_sizes(column.dictionary)
        picked = lengths[column.indices.fill_null(0).to_numpy(zero_copy_only=False)]
        return np.where(column.is_null().to_numpy(zero_copy_only=False), 0, picked)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or \
            pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        return pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.full(len(column), -(-column.nbytes // max(1, len(column))), dtype=np.int64)


def _head(batch: pa.RecordBatch, n: int, src: SourceConfig) -> str:
    """The start of an oversized row's text, without decoding the rest of it."""
    if src.text_field not in batch.schema.names:
        return ""
    value = batch.column(src.text_field).slice(n, 1)
    if pa.types.is_dictionary(value.type):  # its entry in the dictionary, not a copy of it
        index = value.indices[0].as_py()
        value = value.dictionary.slice(index if index is not None else 0, 1 if index is not None else 0)
    if not (pa.types.is_string(value.type) or pa.types.is_large_string(value.type)):
        return ""
    import pyarrow.compute as pc

    return (pc.utf8_slice_codeunits(value, 0, _RAW_LIMIT).to_pylist() or [""])[0] or ""


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


def read_html(file: InputFile, src: SourceConfig) -> Iterator[Record]:
    raw, size, error = read_at_most(file, src.max_record_bytes + 1)
    if error is not None:
        yield None, "file", preview(raw), {}, truncated(error)
    elif size > src.max_record_bytes:
        yield None, "file", preview(raw), {}, Quarantine(
            "record too large", f"{size} bytes, over max_record_bytes={src.max_record_bytes}")
    elif raw.strip():
        text = html_main_text(decode_html(raw, ""))
        if text.strip():
            yield None, "file", text, {}, None
        else:
            yield None, "file", preview(raw), {}, Quarantine("no main text in HTML")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(value: str | None) -> bool:
    if value is None:
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _quarantine_lone_surrogates(rows: dict[str, list]) -> None:
    """Values Arrow cannot encode: a lone surrogate (half of a UTF-16 pair, as JSON's "\\ud83d" decodes to; a
    file name that is not UTF-8). A document whose text holds one is quarantined as invalid UTF-8 with the text
    made readable; metadata is kept, its JSON escaping the surrogate; any other column gets U+FFFD in its place."""
    for i, text in enumerate(rows["text"]):
        if not _utf8(text):
            rows["text"][i] = _SURROGATE.sub("\ufffd", text)[:_RAW_LIMIT]
            if rows["drop_reason"][i] is None:
                rows["drop_reason"][i] = "quarantine:invalid UTF-8"
                meta = json.loads(rows["metadata"][i]) if rows["metadata"][i] else {}
                rows["metadata"][i] = json.dumps({**meta, "error": "a lone surrogate (half of a UTF-16 pair) in the "
                                                  "text"}, ensure_ascii=False)
        if not _utf8(rows["metadata"][i]):
            rows["metadata"][i] = json.dumps(json.loads(rows["metadata"][i]), ensure_ascii=True)
        for column in ("id", "source", "path", "location"):
            if not _utf8(rows[column][i]):
                rows[column][i] = _SURROGATE.sub("\ufffd", rows[column][i])


READERS = {"text": read_text, "jsonl": read_jsonl, "parquet": read_parquet, "html": read_html, "warc": read_warc}


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    """What a file's bytes can make the readers raise: a broken compression stream, a malformed format. Anything
    else (MemoryError, a bug) is not the input's fault and must not be turned into quarantine."""
    import zstandard

    return (OSError, ValueError, UnicodeError, zstandard.ZstdError, pa.ArrowException)


def read_file(file: InputFile | str, src: SourceConfig, name: str | None = None) -> pa.Table:
    """All the documents of one file in one table (see read_file_tables)."""
    return pa.concat_tables(list(read_file_tables(file, src, name)))


def read_file_tables(file: InputFile | str, src: SourceConfig, name: str | None = None) -> Iterator[pa.Table]:
    """The documents of one file or byte range, streamed: a table is handed on whenever about _TABLE_BYTES of text
    have been read, so a read task holds a bounded part of a file of any size. A document's id is
    `<source>/<name>#<location>` (`name`: the file's path below its source's shared folder, default its file name),
    unique across sources and files whatever ids the records carry; a record's own id (`id_field`, a
    WARC-Record-ID) is kept in the metadata as `record_id`. A record that cannot be parsed, or a file whose format
    is broken from some point on, is quarantined; any other error fails the stage, naming the file."""
    owned = isinstance(file, str)
    if owned:
        file = InputFile(file, src.storage_options, max_inflated_bytes=src.max_inflated_bytes,
                         max_expansion=src.max_expansion)
    try:
        yield from _file_tables(file, src, name)
    finally:
        if owned:  # else its owner still hashes what was read (InputFile.digest), then closes it
            file.close()


def _file_tables(file: InputFile, src: SourceConfig, name: str | None) -> Iterator[pa.Table]:
    path = file.path
    rows = {column: [] for column in DOC_SCHEMA.names}
    name = name or Path(path).name
    count, held = 0, 0
    what = f"{path} (bytes {file.start}-{file.end})" if file.is_range else path
    after = f" from byte {file.start}" if file.is_range else ""  # tells apart the ranges' error rows

    def add(own_id, location, text, meta, problem: Quarantine | None):
        nonlocal count, held
        count, held = count + 1, held + len(text)
        if problem is None and "\x00" in text:
            problem, text = Quarantine("NUL bytes in text", "binary content?"), preview(text.encode())
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
        try:
            out = pa.table(rows, schema=DOC_SCHEMA)
        except UnicodeEncodeError:  # rare, so looked for only when Arrow cannot encode a value
            _quarantine_lone_surrogates(rows)
            out = pa.table(rows, schema=DOC_SCHEMA)
        held = 0
        for column in rows.values():
            column.clear()
        return out

    try:
        for record in READERS[src.format](file, src):
            add(*record)
            if held >= _TABLE_BYTES:
                yield table()
    except (EOFError, InflationLimit) as e:  # a .gz/.zst cut short, or a bomb: what came before it is kept
        add(None, f"after {count} records{after}", "", {}, truncated(e))
    except _unreadable_errors() as e:  # the rest of the file cannot be read: what came before is kept
        add(None, f"after {count} records{after}", "", {},
            Quarantine("unreadable file", f"{type(e).__name__}: {e}"))
    except Exception as e:
        raise AmaliaError(f"data source '{src.name}': reading {what} failed after {count} records, not because of "
                          f"its content: {type(e).__name__}: {e}") from e
    if not count and not file.is_range:  # a range may hold no record's start (inside one long line)
        add(None, "file", "", {}, Quarantine("no documents in file", "empty, or nothing readable as a document"))
    if rows["id"] or not count:  # an empty range still gives a table of the documents' schema
        yield table()
