"""Preference pairs for DPO, in TRL's format: jsonl rows `{prompt, chosen, rejected}`, either plain strings
(standard) or lists of {role, content} messages (conversational: prompt = the turns before the answer, chosen /
rejected = the competing assistant turn), the three of one kind."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from amalia_ray.core.formats.jsonl import is_messages, read_rows, write_rows

FIELDS = ("prompt", "chosen", "rejected")


def validate_pair(row) -> str | None:
    for field in FIELDS:
        value = row.get(field) if isinstance(row, dict) else None
        if not (isinstance(value, str) and value) and not is_messages(value):
            return f"field '{field}' must be a non-empty string or a list of {{role, content}} messages"
    if len({is_messages(row[field]) for field in FIELDS}) > 1:
        return "prompt, chosen and rejected must all be strings or all be messages"
    return None


def read_preferences(path: Path) -> list[dict]:
    return read_rows(path, "preference data", validate_pair)


def write_preferences(rows: Iterable[dict], output: Path) -> int:
    return write_rows(rows, output, validate_pair)
