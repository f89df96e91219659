"""metrics.jsonl: a training stage's history, one JSON record per step, appended by rank 0. A line cut short (the
process killed while it appended or rewrote the file) is left out wherever the file is read: a history that lost
its last step is resumed and reported, never made an error that every later attempt would repeat."""

from __future__ import annotations

import json
import os
from pathlib import Path


def step_record(line: str) -> dict | None:
    """A metrics line as its record; None for a blank line, a line cut short or anything else that is not one (an
    object with an integer step)."""
    try:
        record = json.loads(line) if line.strip() else None
    except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, nesting past the parser's depth
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def read_step_records(path: Path) -> list[dict]:
    """Every whole record of a metrics file, in order ([] when there is none)."""
    if not path.exists():
        return []
    return [r for line in path.read_text(errors="replace").splitlines() if (r := step_record(line)) is not None]


def keep_steps_through(path: Path, step: int) -> None:
    """Drop the records of steps after `step` (a resumed stage trains them again), through a new file renamed over
    the old one, so that a process killed meanwhile leaves the old history whole."""
    if not path.exists():
        return
    kept = [r for r in read_step_records(path) if r.get("step", 0) <= step]
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(partial, path)
