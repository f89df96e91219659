"""Conversations for supervised fine-tuning: jsonl rows `{"messages": [{role, content}, ...]}` (other fields, such
as an `id`, are kept and ignored)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from amalia_ray.core.formats.jsonl import is_messages, read_rows, write_rows


def validate_conversation(row) -> str | None:
    if not isinstance(row, dict) or not is_messages(row.get("messages")):
        return "not a JSON object with 'messages' (a non-empty list of {role, content})"
    return None


def read_conversations(path: Path) -> list[list[dict]]:
    """Each row's messages."""
    return [row["messages"] for row in read_rows(path, "conversations", validate_conversation)]


def write_conversations(rows: Iterable[dict], output: Path) -> int:
    return write_rows(rows, output, validate_conversation)
