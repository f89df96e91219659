"""Tasks for on-policy sampling (GRPO, on-policy DPO, synthetic data seeds): jsonl rows with a `prompt` (a string,
or {role, content} messages) and whatever the rewards read (`answer`, ...)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from amalia_ray.core.formats.jsonl import is_messages, read_rows, write_rows


def validate_task(row) -> str | None:
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not ((isinstance(prompt, str) and prompt) or is_messages(prompt)):
        return "field 'prompt' must be a non-empty string or {role, content} messages"
    return None


def read_tasks(path: Path) -> list[dict]:
    """The tasks of a jsonl file or folder; none is an error."""
    rows = read_rows(path, "task data", validate_task)
    if not rows:
        raise ValueError(f"no task in {path}")
    return rows


def write_tasks(rows: Iterable[dict], output: Path) -> int:
    return write_rows(rows, output, validate_task)
