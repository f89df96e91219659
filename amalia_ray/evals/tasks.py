"""Task files: JSON lines, one item per line. Every problem is reported with file and line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from amalia_ray.core.errors import AmaliaError


@dataclass(frozen=True)
class MCItem:
    id: str
    question: str
    choices: list[str]
    answer: int


def load_mc(path: Path, limit: int | None = None) -> list[MCItem]:
    """Multiple choice: {"id"?, "question", "choices": [...], "answer": index}."""
    if not path.is_file():
        raise AmaliaError(f"task file not found: {path}")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise AmaliaError(f"{where}: not valid JSON: {e.msg}") from None
        if not isinstance(row, dict):
            raise AmaliaError(f"{where}: expected a JSON object")
        question, choices, answer = row.get("question"), row.get("choices"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise AmaliaError(f"{where}: field 'question' must be a non-empty string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise AmaliaError(f"{where}: field 'choices' must be a list of at least 2 non-empty strings")
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
            raise AmaliaError(f"{where}: field 'answer' must be an index into choices (0..{len(choices) - 1})")
        items.append(MCItem(str(row.get("id", n)), question, choices, answer))
    if not items:
        raise AmaliaError(f"{path}: no items")
    return items[:limit] if limit else items
