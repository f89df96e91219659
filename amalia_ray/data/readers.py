"""Readers: turn corpus files into documents (`id`, `source`, `path`, `text`) as a Ray Dataset.

Reading is one Ray task per file, so a cluster reads many files in parallel; each file is split into documents
according to its source's `split` rule.
"""

from __future__ import annotations

import glob
import gzip
import re
from pathlib import Path

import pyarrow as pa
import ray

from amalia_ray.core.config import SourceConfig
from amalia_ray.core.errors import AmaliaError

DOC_SCHEMA = pa.schema([("id", pa.string()), ("source", pa.string()), ("path", pa.string()), ("text", pa.string())])


def expand_paths(source: SourceConfig, resolve, field: str) -> list[str]:
    """Every file a source names, in sorted order; a path or glob that matches nothing is an error naming it."""
    files: list[str] = []
    for i, pattern in enumerate(source.paths):
        resolved = str(resolve(pattern))
        matches = sorted(p for p in glob.glob(resolved, recursive=True) if Path(p).is_file())
        if not matches:
            raise AmaliaError(
                f"corpus path not found: {field}.paths[{i}] = '{pattern}' matches no file"
                + (" (install the demo corpus with `make corpus`)" if pattern.startswith("/usr/share") else "")
            )
        files.extend(matches)
    return files


def _open_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def split_documents(text: str, split: str, separator: str) -> list[str]:
    if split == "file":
        return [text]
    if split == "separator":
        return re.split(rf"(?m)^{re.escape(separator)}\s*$", text)
    return re.split(r"\n(?:[ \t]*\n)+", text)


def read_files(batch: pa.Table) -> pa.Table:
    """Arrow batch of (path, source, split, separator) rows -> one row per document."""
    rows = {name: [] for name in DOC_SCHEMA.names}
    for path, source, split, sep in zip(*(batch[c].to_pylist() for c in ("path", "source", "split", "separator"))):
        for n, doc in enumerate(split_documents(_open_text(path), split, sep)):
            if doc.strip():
                rows["id"].append(f"{source}/{Path(path).name}#{n}")
                rows["source"].append(source)
                rows["path"].append(path)
                rows["text"].append(doc)
    return pa.table(rows, schema=DOC_SCHEMA)


def read_sources(sources: list[SourceConfig], resolve) -> ray.data.Dataset:
    items = [
        {"path": f, "source": s.name, "split": s.split, "separator": s.separator}
        for i, s in enumerate(sources)
        for f in expand_paths(s, resolve, f"data.sources[{i}]")
    ]
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        read_files, batch_size=1, batch_format="pyarrow"
    )
