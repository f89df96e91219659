"""The record a vocabulary extension leaves beside the tokenizer files: how many tokens the base had, which ids are
new. The tokenizer stage writes it; training reads it to give those embedding and LM-head rows their initial
values."""

from __future__ import annotations

import json
from pathlib import Path

EXTENSION_FILE = "vocabulary_extension.json"


def write_extension(tokenizer_dir: Path, record: dict) -> None:
    (Path(tokenizer_dir) / EXTENSION_FILE).write_text(json.dumps(record, ensure_ascii=False, indent=1))


def read_extension(tokenizer_dir: Path) -> dict | None:
    """None when the vocabulary is the base's own."""
    f = Path(tokenizer_dir) / EXTENSION_FILE
    return json.loads(f.read_text()) if f.is_file() else None
