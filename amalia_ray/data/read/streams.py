"""The bytes of one input: a local file or an object on storage, whole or one byte range of it, decompressed when it
ends in .gz or .zst, streamed (never fetched whole), and counted and hashed (sha256) as it is read, so the data stage
records what it read without a second pass or one thread hashing the corpus before the work starts."""

from __future__ import annotations

import gzip
import hashlib
import io
from dataclasses import dataclass, field

from amalia_ray.core.filesystem import open_filesystem

_CHUNK = 1 << 20
_ZSTD_FEED = 2048  # compressed bytes per decompression call: at most 64 MiB out of one


def is_uri(path: str) -> bool:
    return "://" in path


class StorageReadError(Exception):
    """Reading an object from storage failed (the network, permissions, an object gone since it was listed): not
    the input's fault, so the read task fails with it instead of quarantining the rest of the file (deliberately
    not an OSError, which the readers take for a broken file)."""


class _RemoteStream(io.RawIOBase):
    """An object's bytes from its filesystem from byte `start` on, storage errors raised as StorageReadError."""

    def __init__(self, uri: str, options: dict | None, start: int = 0):
        self._uri, self._native = uri, None
        try:
            filesystem, inner = open_filesystem(uri, options)
            if start:  # a random-access file: reads from `start` are ranged requests
                self._native = filesystem.open_input_file(inner)
                self._native.seek(start)
            else:
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
        if self._native is not None:
            self._native.close()
        super().close()


def _open_at(path: str, options: dict | None, start: int = 0) -> io.RawIOBase:
    if is_uri(path):
        return _RemoteStream(path, options, start)
    f = open(path, "rb", buffering=0)
    if start:
        f.seek(start)
    return f


class _ZstdStream(io.RawIOBase):
    """A .zst file decompressed across frames; unlike zstandard's stream_reader it notices a file cut short. The
    decompressor is fed _ZSTD_FEED bytes at a time: one call makes at most ~32,768 times its input (a run-length
    block of 128 KiB from 4 bytes), so a crafted file never inflates more than _ZSTD_FEED × 32,768 bytes at once."""

    def __init__(self, raw):
        import zstandard

        self._zstd, self._raw = zstandard, raw
        self._input, self._in_at = b"", 0
        self._pending, self._at = b"", 0
        self._dobj, self._started = zstandard.ZstdDecompressor().decompressobj(), False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at >= len(self._pending):
            if self._in_at >= len(self._input):
                self._input, self._in_at = self._raw.read(_CHUNK), 0
                if not self._input:
                    if self._started and not self._dobj.eof:
                        raise EOFError("zstd stream ended before the end of its frame")
                    return 0
            piece = self._input[self._in_at:self._in_at + _ZSTD_FEED]
            self._in_at += len(piece)
            while piece:
                if self._dobj.eof:  # the next frame
                    self._dobj = self._zstd.ZstdDecompressor().decompressobj()
                self._started = True
                self._pending, self._at = self._dobj.decompress(piece), 0
                piece = self._dobj.unused_data if self._dobj.eof else b""
                if piece and self._pending:  # a frame ended inside this piece: hand its end on first
                    self._in_at -= len(piece)
                    break
        n = min(len(buffer), len(self._pending) - self._at)
        buffer[:n] = self._pending[self._at:self._at + n]  # an offset, not a slice of the rest: no quadratic copying
        self._at += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class InflationLimit(ValueError):
    """A compressed input that decompresses past what the source allows: a decompression bomb, or a file to split."""

    quarantine_reason = "decompression limit"


class _Counted(io.RawIOBase):
    """A raw stream's bytes, counted as they are read."""

    def __init__(self, raw):
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer) or 0
        self.count += n
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


MIN_RATIO_BYTES = 64 << 20  # below this, any expansion: a small file of repeated lines is no threat


def check_inflation(out: int, compressed: int, max_bytes: int | None, max_ratio: float | None, what: str) -> None:
    """`out` bytes decompressed from `compressed`: within `max_bytes`, and past MIN_RATIO_BYTES within `max_ratio`
    times the compressed bytes (the source's max_inflated_bytes and max_expansion), else InflationLimit."""
    if max_bytes is not None and out > max_bytes:
        raise InflationLimit(f"{what} decompresses to more than max_inflated_bytes={max_bytes:,} ({out:,} bytes)")
    ratio = out / max(1, compressed)
    if max_ratio is not None and out > MIN_RATIO_BYTES and ratio > max_ratio:
        raise InflationLimit(f"{what} expands {ratio:,.0f}× ({out:,} bytes from {compressed:,}), over "
                             f"max_expansion={max_ratio:g}")


class _Inflation(io.RawIOBase):
    """A decompressed stream held to the source's limits (check_inflation) as it is read: the reader raises
    InflationLimit at once instead of inflating on."""

    def __init__(self, inner, compressed: _Counted, max_bytes: int | None, max_ratio: float | None, what: str):
        self.inner, self.compressed, self.out = inner, compressed, 0
        self.max_bytes, self.max_ratio, self.what = max_bytes, max_ratio, what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if isinstance(self.inner, io.BufferedIOBase):  # gzip: read1 keeps what came before a cut-short stream
            data = self.inner.read1(len(buffer))
            n = len(data)
            buffer[:n] = data
        else:
            n = self.inner.readinto(buffer) or 0
        self.out += n
        check_inflation(self.out, self.compressed.count, self.max_bytes, self.max_ratio, self.what)
        return n

    def close(self) -> None:
        self.inner.close()
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


class _Tap(io.RawIOBase):
    """The raw bytes of an input as a reader pulls them, counted and hashed; only the first `limit` bytes are
    hashed (a byte range's own bytes: the last record may run past its end). Closing it keeps the underlying stream
    open, so what the reader left unread can still be hashed."""

    def __init__(self, raw, limit: int | None):
        self.raw, self.limit, self.seen, self.sha = raw, limit, 0, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        if n:
            take = n if self.limit is None else max(0, min(n, self.limit - self.seen))
            if take:
                self.sha.update(memoryview(buffer)[:take])
            self.seen += n
        return n or 0

    def drain(self) -> None:
        """Reads on to the end of the range or file, so the digest covers all of it."""
        buffer = bytearray(_CHUNK)
        while (self.limit is None or self.seen < self.limit) and self.readinto(buffer):
            pass


def open_range(path: str, options: dict | None, start: int = 0, length: int | None = None) -> io.BufferedReader:
    """A file's bytes from `start` (at most `length` of them) as a plain stream: for the passes that plan ranges."""
    raw = _open_at(path, options, start)
    return io.BufferedReader(raw if length is None else _Limited(raw, length), buffer_size=_CHUNK)


class _Limited(io.RawIOBase):
    """The first `left` bytes of a raw stream: a range of gzip members ends where the next range's first begins."""

    def __init__(self, raw, left: int):
        self.raw, self.left = raw, left

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.left <= 0:
            return 0
        n = self.raw.readinto(memoryview(buffer)[:min(len(buffer), self.left)]) or 0
        self.left -= n
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


@dataclass
class InputFile:
    """One read task's input: a file or object, or bytes [start, end) of it. An uncompressed jsonl range holds the
    records whose first byte lies in it (the last one read past `end`); a .warc.gz, .warc or text range holds whole
    gzip members, records or documents (`bounded`: nothing past `end` is read). `before`: what precedes the range
    in the unit its records are located by (newlines, decompressed bytes, bytes, documents), so every record keeps
    the location a whole-file read gives it (`ranges.plan_ranges`)."""

    path: str
    options: dict = field(default_factory=dict)
    start: int = 0
    end: int | None = None
    before: int = 0
    bounded: bool = False
    max_inflated_bytes: int | None = None  # a .gz/.zst: what it may decompress to (the source's limits)
    max_expansion: float | None = None
    _tap: _Tap | None = field(default=None, repr=False)

    @property
    def is_range(self) -> bool:
        return self.end is not None

    def open_raw(self) -> io.BufferedReader:
        """The file's bytes from `start` as a stream (the first opening is the one counted and hashed)."""
        raw = _open_at(self.path, self.options, self.start)
        if self.bounded and self.end is not None:
            raw = _Limited(raw, self.end - self.start)
        if self._tap is not None:
            return io.BufferedReader(raw, buffer_size=_CHUNK)
        self._tap = _Tap(raw, None if self.end is None else self.end - self.start)
        return io.BufferedReader(self._tap, buffer_size=_CHUNK)

    def open_binary(self) -> io.BufferedIOBase:
        """The file, transparently decompressed when it ends in .gz or .zst, within the source's limits on what it
        may decompress to (max_inflated_bytes, max_expansion)."""
        if not self.path.endswith((".gz", ".zst")):
            return self.open_raw()
        compressed = _Counted(self.open_raw())
        if self.path.endswith(".gz"):
            inflated = _ClosingGzip(fileobj=io.BufferedReader(compressed, buffer_size=_CHUNK), mode="rb")
        else:
            inflated = _ZstdStream(compressed)
        if self.max_inflated_bytes is None and self.max_expansion is None:
            return io.BufferedReader(inflated, buffer_size=_CHUNK) if not isinstance(inflated, gzip.GzipFile) \
                else inflated
        return io.BufferedReader(_Inflation(inflated, compressed, self.max_inflated_bytes, self.max_expansion,
                                            self.path), buffer_size=_CHUNK)

    def starts_inside_a_line(self) -> bool:
        """Whether the byte before `start` is not a newline: the line under way belongs to the range before."""
        if not self.start:
            return False
        with _open_at(self.path, self.options, self.start - 1) as f:
            return f.read(1) != b"\n"

    def digest(self) -> tuple[int, str | None]:
        """(bytes, sha256) of the file or range, hashing what the reader left unread; a file no reader opened as a
        stream (Parquet reads its footer first) is read through once here. A file that cannot be read (gone since
        it was listed: its reader quarantined it) has no digest."""
        try:
            if self._tap is None:
                with self.open_raw():
                    pass
            self._tap.drain()
        except (OSError, StorageReadError):
            return (self._tap.seen if self._tap else 0), None
        limit = self._tap.seen if self._tap.limit is None else self._tap.limit
        return min(self._tap.seen, limit), "sha256:" + self._tap.sha.hexdigest()

    def close(self) -> None:
        if self._tap is not None:
            self._tap.raw.close()
