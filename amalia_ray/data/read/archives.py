"""Web archives: WARC files framed record by record here (so a broken record is quarantined and the reader carries on
at the next one) and parsed by fastwarc; ARC files (the format before WARC, which much of a national archive's
older crawl is in) framed here too. The main text of each HTML response becomes a document with its URL and date."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator

from amalia_ray.core.config import SourceConfig
from amalia_ray.data.read.records import _RAW_LIMIT, Quarantine, Record, decode_html, html_main_text, preview, truncated
from amalia_ray.data.read.streams import InputFile


class _Rewindable:
    """A binary stream that can take bytes back, counting the offset of what it hands out. What was taken back is
    handed out again from an index into it, never by copying what is left of it: a 16 MiB record taken back and
    then read line by line while resyncing costs its length, not its length times its lines."""

    def __init__(self, f):
        self.f, self.buf, self.at, self.pos = f, b"", 0, 0  # self.buf[self.at:] is what was taken back, still due

    def readline(self, limit: int) -> bytes:
        if self.at < len(self.buf):
            end = self.buf.find(b"\n", self.at, self.at + limit)
            if end >= 0 or len(self.buf) - self.at >= limit:
                cut = end + 1 if end >= 0 else self.at + limit
                line, self.at = self.buf[self.at:cut], cut
            else:
                line = self.buf[self.at:] + self.f.readline(limit - (len(self.buf) - self.at))
                self.buf, self.at = b"", 0
        else:
            line = self.f.readline(limit)
        self.pos += len(line)
        return line

    def read(self, n: int) -> bytes:
        data = self.buf[self.at:self.at + n]
        self.at += len(data)
        if len(data) < n:
            self.buf, self.at = b"", 0
            data += self.f.read(n - len(data))
        self.pos += len(data)
        return data

    def unread(self, data: bytes) -> None:
        n = len(data)
        if n <= self.at and self.buf[self.at - n:self.at] == data:  # what was just handed out of the buffer: step
            self.at -= n                                            # back over it, no copy of the rest
        else:
            self.buf, self.at = data + self.buf[self.at:], 0
        self.pos -= n


_HEADER_LINE = 64 << 10
_VERSION_LINE = re.compile(rb"WARC/\d\.\d+\r?\n$")


def _may_reread(reread: int, at: int) -> bool:
    """Whether the body of a broken record, `reread` bytes read again so far in the file at offset `at`, is searched
    for the records after it: yes until what was read again is 4 times what was passed plus 64 MB, so reading stays
    linear; past that, the broken record's body is skipped (the records inside it are lost: a file this broken)."""
    return reread <= 4 * at + (64 << 20)


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
    junk_at, resyncing, reread = None, False, 0
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
        elif not length.isdigit() or len(length) > 19:  # int() refuses 4,300 digits and more
            problem = f"Content-Length {length[:40]!r} is not a number"
        elif int(length) > limit:
            problem = f"Content-Length {int(length)} over max_record_bytes={limit}"
        else:
            body, blank = s.read(int(length)), []
            # the blank lines after the body, joined once: added up one by one they would cost their count squared
            while (following := s.readline(_HEADER_LINE)) and not following.strip():
                blank.append(following)
            gap = b"".join(blank)
            # the body must end where the file ends or blank lines separate it from what follows
            if len(body) == int(length) and (gap or not following) and _record_start(body) < 0:
                s.unread(following)
                yield at, header, b"".join(header) + b"\r\n" + body + b"\r\n\r\n", None
                continue
            # the next record may start inside what was read: look there, within a budget of bytes read again
            # (a file of short headers each claiming megabytes would otherwise be read again megabytes per header)
            s.unread((body + gap if _may_reread(reread := reread + len(body) + len(gap), at) else b"") + following)
            problem = ("Content-Length runs past the end of the file" if len(body) < int(length)
                       else "Content-Length does not end where the record does")
        yield at, header, b"".join(header)[:_RAW_LIMIT], Quarantine("broken WARC record", problem)
        resyncing = True
    if junk_at is not None:  # bytes after the last record that are no record
        yield junk_at, [], b"", Quarantine("broken WARC record", f"bytes from {junk_at} are not a WARC record")


def _header_field(line: bytes) -> tuple[bytes, bytes]:
    name, _, value = line.partition(b":")
    return name.strip().lower(), value.strip()


def read_warc(file: InputFile, src: SourceConfig) -> Iterator[Record]:
    """Main text of the HTML responses of a WARC (or ARC: by its name) file; other record types are skipped, broken
    ones quarantined."""
    if re.search(r"\.arc(\.gz|\.zst)?$", file.path):
        yield from _read_arc(file, src)
        return
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with file.open_binary() as f:
        try:
            for at, header, record, problem in warc_records(f, src.max_record_bytes):
                where = f"record at byte {at + file.before}"
                fields = dict(_header_field(h) for h in header[1:])
                own_id = fields.get(b"warc-record-id", b"").decode("utf-8", "replace") or None
                meta = {"url": fields.get(b"warc-target-uri", b"").decode("utf-8", "replace") or None,
                        "date": fields.get(b"warc-date", b"").decode("utf-8", "replace") or None}
                if problem is not None:
                    yield own_id, where, preview(record), meta, problem
                    continue
                if fields.get(b"warc-type", b"").lower() != b"response":
                    continue
                parsed = next(iter(ArchiveIterator(io.BytesIO(record), record_types=WarcRecordType.response,
                                                   parse_http=True)), None)
                yield from _warc_response(parsed, own_id, where, meta, record)
        except (EOFError, OSError, ValueError) as e:  # a .gz cut short: the records before it are kept
            where = f"end of bytes {file.start}-{file.end}" if file.is_range else "end of file"
            yield None, where, "", {}, truncated(e)


def _warc_response(parsed, own_id, where, meta, record: bytes) -> Iterator[Record]:
    try:
        if parsed is None or parsed.http_headers is None:
            raise Quarantine("broken WARC record", "no HTTP response inside")
        content_type = parsed.http_headers.get("Content-Type") or ""
        if "html" not in content_type.lower():
            return
        body = parsed.reader.read()
        text = html_main_text(decode_html(body, content_type))
    except Quarantine as q:
        yield own_id, where, preview(record), meta, q
        return
    except Exception as e:  # noqa: BLE001 - whatever the parser trips on, the record is quarantined, not the file
        yield own_id, where, preview(record), meta, Quarantine("broken WARC record", f"{type(e).__name__}: {e}")
        return
    if text.strip():
        yield own_id, where, text, meta, None
    else:
        yield own_id, where, preview(body), meta, Quarantine("no main text in HTML")


def arc_records(f, limit: int) -> Iterator[tuple[int, list[bytes], bytes, Quarantine | None]]:
    """(offset, header fields, content, problem) for every record of a decompressed ARC stream (version 1 or 2: a
    header line `URL IP date content-type … length`, that many bytes, a newline). A header whose length runs past
    the end of the file or does not end where the record does, one over `limit` bytes, and bytes between records
    that are no record come back as problems; the reader then looks for the next header line."""
    s = _Rewindable(f)
    junk_at, reread = None, 0
    while line := s.readline(_HEADER_LINE):
        at = s.pos - len(line)
        fields = _arc_header(line)
        if fields is None:
            if line.strip() and junk_at is None:
                junk_at = at
            continue
        if junk_at is not None:
            yield junk_at, [], b"", Quarantine("broken ARC record", f"bytes {junk_at}-{at} are not an ARC record")
            junk_at = None
        length = int(fields[-1])
        if length > limit:
            yield at, fields, line, Quarantine("broken ARC record", f"length {length} over max_record_bytes={limit}")
            while length > 0 and (skipped := len(s.read(min(length, 1 << 20)))):
                length -= skipped
            continue
        body = s.read(length)
        following = s.readline(_HEADER_LINE)
        if len(body) == length and (following.strip() == b"" or _arc_header(following) is not None):
            if following.strip():
                s.unread(following)
            yield at, fields, body, None
            continue
        # the next record may start inside what was read: look there, within a budget of bytes read again
        s.unread((body if _may_reread(reread := reread + len(body), at) else b"") + following)
        problem = ("the length runs past the end of the file" if len(body) < length
                   else "the length does not end where the record does")
        yield at, fields, line, Quarantine("broken ARC record", problem)
    if junk_at is not None:
        yield junk_at, [], b"", Quarantine("broken ARC record", f"bytes from {junk_at} are not an ARC record")


def _arc_header(line: bytes) -> list[bytes] | None:
    """The fields of an ARC record's header line (5 in version 1, 10 in version 2; the length last), or None."""
    fields = line.split()
    if (len(fields) in (5, 10) and fields[-1].isdigit() and len(fields[-1]) <= 19 and fields[2].isdigit()
            and line.endswith(b"\n")):
        return fields
    return None


def _read_arc(file: InputFile, src: SourceConfig) -> Iterator[Record]:
    """Main text of the HTML responses of an ARC file: each HTTP response is handed to fastwarc as the payload of a
    WARC response record, so both formats are parsed alike."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    with file.open_binary() as f:
        try:
            for at, fields, content, problem in arc_records(f, src.max_record_bytes):
                where = f"record at byte {at + file.before}"
                meta = {"url": fields[0].decode("utf-8", "replace"), "date": fields[2].decode()} if fields else {}
                if problem is not None:
                    yield None, where, preview(content), meta, problem
                    continue
                if not meta["url"].lower().startswith(("http:", "https:")):  # filedesc://, dns:, ftp:
                    continue
                record = (b"WARC/1.0\r\nWARC-Type: response\r\nContent-Type: application/http; msgtype=response\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(content)) + content + b"\r\n\r\n"
                parsed = next(iter(ArchiveIterator(io.BytesIO(record), record_types=WarcRecordType.response,
                                                   parse_http=True)), None)
                yield from _warc_response(parsed, None, where, meta, content)
        except (EOFError, OSError, ValueError) as e:  # a .gz cut short: the records before it are kept
            yield None, "end of file", "", {}, truncated(e)
