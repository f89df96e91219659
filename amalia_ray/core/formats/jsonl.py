"""jsonl as the post-training formats use it: rows read with their file and line, rows written one per line
(UTF-8, unescaped), and the rule for a list of chat messages that every format shares."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from amalia_ray.core.storage import jsonl_rows


def is_messages(value) -> bool:
    """A non-empty list of {role, content} chat messages."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)


def checked_rows(path: Path, what: str, validate: Callable[[object], str | None]) -> Iterator[tuple[Path, int, dict]]:
    """(file, line, row) for every row of a jsonl file or of the *.jsonl files under a folder, each checked by
    `validate`; the first bad one is a ValueError naming its file and line."""
    for f, n, row in jsonl_rows(path, what):
        if error := validate(row):
            raise ValueError(f"{f}:{n}: {error}")
        yield f, n, row


def line_id(path: Path, file: Path, line: int) -> str:
    """A row's place as an id for rows without their own: its line, after its file's path below `path` when `path`
    is a folder of files (so two files' line 1 differ)."""
    path = Path(path)
    return f"{file.relative_to(path).as_posix()}:{line}" if path.is_dir() else str(line)


def read_rows(path: Path, what: str, validate: Callable[[object], str | None]) -> list[dict]:
    """The rows of `checked_rows`."""
    return [row for _, _, row in checked_rows(path, what, validate)]


def write_rows(rows: Iterable[dict], output: Path, validate: Callable[[object], str | None]) -> int:
    """The rows as jsonl at `output` (its folder made), each checked by `validate` first, written whole or not at
    all; returns how many."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")  # a refused row leaves the file that was there
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for n, row in enumerate(rows, 1):
                if error := validate(row):
                    raise ValueError(f"row {n} for {output}: {error}")
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    return n
