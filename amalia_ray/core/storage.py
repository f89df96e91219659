"""Filesystem helpers: content hashes of files and folders (with a per-machine digest cache), atomic replacement of
stage outputs."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CHUNK = 1 << 20


def hash_file(path: Path, h=None) -> str:
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_paths(paths: dict[str, Path]) -> dict[str, str]:
    """hash_path of each, through one opening of the digest cache."""
    with DigestCache.open() as cache:
        return {k: hash_path(p, cache) for k, p in paths.items()}


def hash_path(path: str | Path, cache: DigestCache | None = None) -> str:
    """sha256 of a file's content, or over a folder's relative file names and their files' sha256 (sorted, so
    order-independent). Each file's digest comes from the digest cache when its size, mtime, ctime and inode are
    those it was hashed at, so an unchanged corpus is not read again."""
    if cache is None:
        with DigestCache.open() as cache:
            return hash_path(path, cache)
    path = Path(path)
    if path.is_file():
        return "sha256:" + cache.digest(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0" + cache.digest(f).encode() + b"\0")
    return "sha256:" + h.hexdigest()


class DigestCache:
    """sha256 digests of files by absolute path, kept with the size, mtime, ctime and inode they were computed at
    (SQLite under $AMALIA_CACHE_DIR, default ~/.cache/amalia: one per machine, shared by its runs and processes).
    A file whose stat differs is read again; one whose stat is unchanged is trusted, as make and rsync trust it."""

    def __init__(self, db):
        self.db = db

    @classmethod
    @contextmanager
    def open(cls) -> Iterator[DigestCache]:
        root = Path(os.environ.get("AMALIA_CACHE_DIR") or Path.home() / ".cache" / "amalia")
        try:
            root.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(root / "file-digests.sqlite", timeout=60)
            db.execute("CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, stat TEXT, digest TEXT)")
        except (OSError, sqlite3.Error):  # a read-only home: hash every time rather than fail
            db = None
        try:
            yield cls(db)
            if db is not None:
                db.commit()
        finally:
            if db is not None:
                db.close()

    def digest(self, path: Path) -> str:
        st = path.stat()
        stat = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"
        key = str(path.resolve())
        if self.db is not None:
            row = self.db.execute("SELECT stat, digest FROM digests WHERE path = ?", (key,)).fetchone()
            if row and row[0] == stat:
                return row[1]
        digest = hash_file(path)
        if self.db is not None:
            self.db.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?)", (key, stat, digest))
        return digest


def fresh_dir(path: Path) -> Path:
    """An empty temporary sibling of `path`, this attempt's own (named by its process); the caller fills it and
    calls `commit_dir`, so a crash never leaves a half-written output where a finished one is expected. What
    earlier attempts left is removed: the stage's lock (pipeline/locks.py) means no other process writes them now."""
    for stale in path.parent.glob(f"{glob.escape(path.name)}.*tmp") if path.parent.is_dir() else []:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def write_json(path: Path, obj) -> None:
    """Replace `path` with `obj` as JSON, whole or not at all: written to a temporary of this process's own (two
    processes writing one file never share and clobber one), flushed to disk, then renamed into place, and the
    rename flushed too (a power cut leaves the old file or the new one, never an empty or half-written one)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # some filesystems (FUSE mounts) do not sync a folder: the file itself is on disk already
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError:
        pass


def jsonl_rows(path: Path, what: str):
    """(file, line number, parsed row) for every non-empty line of a jsonl file or of the *.jsonl files under a
    folder; a missing input or a line that is not JSON is a ValueError naming `what`, the file and the line."""
    path = Path(path)
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{what} not found: {path}")
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    yield f, n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{n}: not JSON ({e})") from None
