"""Cutting one large file into byte ranges that separate read tasks can read, each record exactly once and located as
a whole-file read locates it.

- Uncompressed jsonl: cut every `range_bytes`; a range holds the lines that start in it (`readers._lines`). Its
  records are located by line number, so the newlines of each range are counted first.
- .warc.gz written a gzip member per record (as crawlers write them, so that any record can be read from its
  offset): each cut moves to the first gzip member at or after it whose content begins a WARC record, and a range
  is the whole members between two such starts. Its records are located by their offset in the decompressed
  stream, so the decompressed bytes of each range are counted first. A file compressed as one member (or whose
  members do not start records) has no such start past its beginning and stays one range.
- Parquet: cut every `range_bytes`; a range holds the row groups whose first page starts in it, read from the
  file's footer (`readers.read_parquet`), which also numbers their rows: nothing is counted first. A file written as
  one row group stays one task's work however it is cut.

The counting passes run as one Ray task per range, in parallel, reading the file once more (at disk or network
speed, and inflating the WARC members once more); the scan for member starts reads only until it finds one.
"""

from __future__ import annotations

import gzip
import zlib

import ray

from amalia_ray.core.config import SourceConfig
from amalia_ray.data.streams import _CHUNK, open_range

_GZIP_MAGIC = b"\x1f\x8b\x08"
_PROBE = 64 << 10  # the compressed bytes a member-start candidate is checked with


def splits_into_ranges(path: str, size: int, source: SourceConfig) -> bool:
    """Whether a file is read in ranges: an uncompressed jsonl, a Parquet file or a .warc.gz over the source's
    range_bytes."""
    if size <= source.range_bytes:
        return False
    if source.format == "parquet":
        return True
    if source.format == "jsonl":
        return not path.endswith((".gz", ".zst"))
    return source.format == "warc" and path.endswith(".warc.gz")


def is_member_ranged(path: str) -> bool:
    return path.endswith(".warc.gz")


def _starts_a_record(data: bytes, at: int) -> bool:
    """Whether a gzip member starts at `data[at]` and its content begins with a WARC version line."""
    if at + 3 >= len(data) or data[at + 3] & 0xE0:  # reserved flag bits set: not a gzip header
        return False
    try:
        return zlib.decompressobj(31).decompress(data[at:at + _PROBE], 5) == b"WARC/"
    except zlib.error:
        return False


@ray.remote(num_cpus=1)
def first_member(path: str, options: dict, start: int, end: int) -> int | None:
    """The offset of the first gzip member in [start, end) that begins a WARC record, or None."""
    buffer, at, eof = b"", start, False
    with open_range(path, options, start) as f:
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


@ray.remote(num_cpus=1)
def newlines(path: str, options: dict, start: int, end: int) -> int:
    """The newlines in bytes [start, end) of a file."""
    count, left = 0, end - start
    with open_range(path, options, start, end - start) as f:
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count


@ray.remote(num_cpus=1)
def inflated_bytes(path: str, options: dict, start: int, end: int) -> int:
    """The decompressed size of the gzip members in bytes [start, end) of a file (up to a broken member: what a
    reader of the range gets before it quarantines the rest)."""
    size = 0
    try:
        with open_range(path, options, start, end - start) as raw, gzip.GzipFile(fileobj=raw) as f:
            while chunk := f.read1(_CHUNK):
                size += len(chunk)
    except (EOFError, OSError, zlib.error):
        pass
    return size


def plan_ranges(files: list[tuple[str, int, SourceConfig]]) -> list[list[tuple[int, int, int]]]:
    """The ranges each file is read in, as (start, end, what precedes start): [(0, size, 0)] for a file read whole.
    All files' scans, then all their counts, run as parallel tasks."""
    cuts, scans = [], []
    for path, size, source in files:
        if not splits_into_ranges(path, size, source):
            cuts.append([0, size])
            continue
        cuts.append(list(range(0, size, source.range_bytes)) + [size])
        if is_member_ranged(path):  # each cut moves to the next member that starts a record
            scans.append((len(cuts) - 1, [first_member.remote(path, source.storage_options, a, b)
                                          for a, b in zip(cuts[-1][1:], cuts[-1][2:])]))
    for index, refs in scans:
        size = cuts[index][-1]
        cuts[index] = [0, *sorted({m for m in ray.get(refs) if m is not None}), size]
    counts = []
    for (path, _, source), starts in zip(files, cuts):
        count = inflated_bytes if is_member_ranged(path) else newlines
        counts.append([] if source.format == "parquet" else  # its rows are numbered from the footer
                      [count.remote(path, source.storage_options, a, b) for a, b in zip(starts[:-2], starts[1:-1])])
    plans = []
    for starts, refs in zip(cuts, counts):
        before = [0]
        for n in ray.get(refs) if refs else [0] * (len(starts) - 2):
            before.append(before[-1] + n)
        plans.append(list(zip(starts[:-1], starts[1:], before)))
    return plans
