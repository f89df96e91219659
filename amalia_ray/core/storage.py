"""Filesystem helpers: content hashes of files and folders, atomic replacement of stage outputs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

_CHUNK = 1 << 20


def hash_file(path: Path, h=None) -> str:
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_path(path: str | Path) -> str:
    """sha256 over a file, or over a folder's relative file names and contents (sorted, so order-independent)."""
    path = Path(path)
    if path.is_file():
        return "sha256:" + hash_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + b"\0")
        hash_file(f, h)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def fresh_dir(path: Path) -> Path:
    """An empty temporary sibling of `path`; the caller fills it and calls `commit_dir`, so a crash never leaves
    a half-written output where a finished one is expected."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def write_json(path: Path, obj) -> None:
    # a name of this process's own: two processes writing one file never share (and clobber) a temporary
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


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
