"""Preference pairs for DPO and reward models, in TRL's format: jsonl rows `{prompt, chosen, rejected}`, either plain
strings (standard) or lists of {role, content} messages (conversational: prompt = the turns before the answer, chosen /
rejected = the competing assistant turn), the three of one kind. A reward model also reads pairs without a prompt
(each side the whole text or conversation: TRL's implicit prompt) and an optional numeric `margin`."""

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


def validate_reward_pair(row) -> str | None:
    """A pair a reward model trains on: as DPO's, but the prompt may be left out and a `margin` may be given."""
    if not isinstance(row, dict):
        return "a row must be an object {prompt, chosen, rejected}"
    fields = FIELDS if "prompt" in row else FIELDS[1:]
    for field in fields:
        value = row.get(field)
        if not (isinstance(value, str) and value) and not is_messages(value):
            return f"field '{field}' must be a non-empty string or a list of {{role, content}} messages"
    if len({is_messages(row[field]) for field in fields}) > 1:
        return f"{', '.join(fields)} must all be strings or all be messages"
    margin = row.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or margin != margin or abs(margin) == float("inf")):
        return "field 'margin' must be a finite number"
    return None


def read_reward_pairs(path: Path) -> list[dict]:
    return read_rows(path, "preference data", validate_reward_pair)


def read_preferences(path: Path) -> list[dict]:
    return read_rows(path, "preference data", validate_pair)


def write_preferences(rows: Iterable[dict], output: Path) -> int:
    return write_rows(rows, output, validate_pair)
