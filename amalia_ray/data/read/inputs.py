"""The corpus's inputs: which files the sources name, what identifies them before they are read, and how they are
cut into read tasks.

Paths are local files or globs, or URIs of object storage and other filesystems (s3://, gs://, abfs://, hdfs://,
any fsspec scheme: `core/filesystem.py`), listed on the driver (one listing per pattern: names, sizes and
modification times, never content) and streamed by the read tasks. A file is one read task, except an uncompressed
jsonl, a Parquet or a .warc.gz file over its source's `range_bytes`: it is cut into byte ranges read by separate tasks, a
record's location (and with it the document's id) the same however the file is cut (`ranges.py`). Each read task
records the bytes and sha256 of what it read (`streams.InputFile`) in the stage's input ledger.
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import ray

from amalia_ray.core.config import SourceConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.filesystem import open_filesystem
from amalia_ray.data.read.ranges import plan_ranges, reads_to_range_end
from amalia_ray.data.read.readers import read_file_tables
from amalia_ray.data.read.streams import InputFile, is_uri

Listed = tuple[str, int, int]  # path or URI, size in bytes, modification time (ns; 0 where storage gives none)


def listed_files(source: SourceConfig, resolve, field: str) -> list[Listed]:
    """Every file a source names with its size and modification time, in sorted order, each once (patterns may
    overlap); a path or glob that matches nothing is an error naming it."""
    files: dict[str, Listed] = {}
    for i, pattern in enumerate(source.paths):
        if is_uri(pattern):
            matches = [(uri, info.size, info.mtime_ns or 0)
                       for uri, info in list_remote(pattern, source.storage_options, f"{field}.paths[{i}]")]
            if not matches:
                raise AmaliaError(f"corpus path not found: {field}.paths[{i}] = '{pattern}' matches no object")
        else:
            resolved = str(resolve(pattern))
            matches = [(p, s.st_size, s.st_mtime_ns) for p in sorted(glob.glob(resolved, recursive=True))
                       if Path(p).is_file() and (s := os.stat(p))]
            if not matches:
                raise AmaliaError(
                    f"corpus path not found: {field}.paths[{i}] = '{pattern}' matches no file"
                    + (" (install the demo corpus with `make corpus`)" if pattern.startswith("/usr/share") else ""))
        files.update((m[0], m) for m in matches if m[0] not in files)
    return list(files.values())


def expand_paths(source: SourceConfig, resolve, field: str) -> list[str]:
    """Every file a source names (see listed_files)."""
    return [path for path, _, _ in listed_files(source, resolve, field)]


def list_sources(sources: list[SourceConfig], resolve) -> list[list[Listed]]:
    """Each source's files (listed_files): the one listing a run makes of its corpus."""
    return [listed_files(s, resolve, f"data.sources[{i}]") for i, s in enumerate(sources)]


def fingerprint_lines(listing: list[list[Listed]]) -> list[str]:
    """What identifies the corpus's files without reading them: path, size and modification time of each; a stage
    over them reruns when one changes. (The content digests of what was read are in the stage's input ledger.)"""
    return [f"{path} {size} {mtime}" for listed in listing for path, size, mtime in listed]


_GLOB = re.compile(r"[*?\[]")


def _glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regular expression over whole paths: `*` and `?` stay inside one folder, `**/` spans any."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            inner = pattern[i + 1:end]
            out.append("[" + ("^" + inner[1:] if inner.startswith("!") else inner) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def list_remote(pattern: str, options: dict, field: str) -> list[tuple[str, object]]:
    """(URI, pyarrow FileInfo: size, mtime) of every object a URI or URI glob names, sorted: one listing of the
    folder before the first wildcard (recursive only when the pattern crosses folders)."""
    from pyarrow import fs as pafs

    try:
        filesystem, path = open_filesystem(pattern, options)
        # what comes before the path inside the filesystem (s3://, hdfs://namenode:8020, abfs://container@account…)
        at = pattern.rfind(path.rstrip("/"))
        prefix = pattern[:at] if at > 0 else pattern.split("://", 1)[0] + "://"
        wildcard = _GLOB.search(path)
        if wildcard is None:
            info = filesystem.get_file_info(path)
            if info.type == pafs.FileType.File:
                return [(prefix + path, info)]
            if info.type != pafs.FileType.Directory:
                return []
            base, matcher = path, None  # a folder: every object below it
        else:
            base = posixpath.dirname(path[:wildcard.start()] + "x")
            if not base.strip("/") or "/" not in path.lstrip("/"):
                raise AmaliaError(f"{field} = '{pattern}': a wildcard in the bucket or container name would list "
                                  "the whole account; name the bucket")
            matcher = _glob_regex(path)
        recursive = matcher is None or "/" in path[wildcard.start():] or "**" in path
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=recursive, allow_not_found=True))
    except (OSError, ValueError) as e:  # re.error is a ValueError too: a malformed [...] class
        raise AmaliaError(f"{field} = '{pattern}': cannot list it: {type(e).__name__}: {e}") from None
    found = [(prefix + i.path, i) for i in infos
             if i.type == pafs.FileType.File and (matcher is None or matcher.match(i.path))]
    return sorted(found, key=lambda item: item[0])


def relative_names(files: list[str]) -> dict[str, str]:
    """Each of a source's files by its path below the folder they all share (`part-0.jsonl`, `2024/a.warc.gz`):
    with the source's name it tells apart files of the same name in different sources or folders."""
    if not files:
        return {}
    local = [f for f in files if not is_uri(f)]
    names = {}
    if local:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in local])
        names.update({f: os.path.relpath(os.path.abspath(f), root) for f in local})
    remote = [f for f in files if is_uri(f)]
    if remote:
        root = posixpath.commonpath([posixpath.dirname(f.split("://", 1)[1]) for f in remote])
        names.update({f: posixpath.relpath(f.split("://", 1)[1], root) for f in remote})
    return names


def read_plan(sources: list[SourceConfig], listing: list[list[Listed]]) -> list[dict]:
    """One item per read task over the listed files: source index, path, name, byte range (end -1: the whole file)
    and what precedes the range (`ranges.plan_ranges`)."""
    files = []
    for i, listed in enumerate(listing):
        names = relative_names([path for path, _, _ in listed])
        files.extend((i, path, size, names[path]) for path, size, _ in listed)
    plans = plan_ranges([(path, size, sources[i]) for i, path, size, _ in files])
    items = []
    for (i, path, _, name), plan in zip(files, plans):
        whole = len(plan) == 1
        items.extend({"source": i, "path": path, "name": name, "start": start, "end": -1 if whole else end,
                      "before": before} for start, end, before in plan)
    return items


LEDGER_SCHEMA = pa.schema([("source", pa.string()), ("path", pa.string()), ("start", pa.int64()),
                           ("end", pa.int64()), ("bytes", pa.int64()), ("sha256", pa.string()),
                           ("records", pa.int64())])


@ray.remote(num_cpus=0)
class _LedgerEntries:
    def __init__(self):
        self.entries: dict[int, dict] = {}

    def add(self, index: int, entry: dict) -> None:
        self.entries[index] = entry  # a task run again records the same entry again

    def all(self) -> list[dict]:
        return [self.entries[i] for i in sorted(self.entries)]


class ReadLedger:
    """What the read tasks read, one entry per file or range (source, path, byte range, bytes, sha256, records),
    gathered by a small actor rather than a file per task on shared storage."""

    def __init__(self):
        self.actor, self.expected = _LedgerEntries.remote(), 0

    def write(self, out: Path) -> dict:
        """The entries as one Parquet table at `out`; returns the files and bytes read. A read task that left no
        entry is an error: the counts would be short without anyone noticing."""
        import pyarrow.parquet as pq

        entries = ray.get(self.actor.all.remote())
        ray.kill(self.actor)
        if len(entries) != self.expected:
            raise AmaliaError(f"the read ledger has {len(entries)} entries for {self.expected} read tasks")
        pq.write_table(pa.Table.from_pylist(entries, schema=LEDGER_SCHEMA), out)
        return {"input_files": len({e["path"] for e in entries}), "input_bytes": sum(e["bytes"] for e in entries)}


def read_sources(sources: list[SourceConfig], listing: list[list[Listed]], ledger: ReadLedger | None = None
                 ) -> ray.data.Dataset:
    """The documents of every source's listed files, one read task per file or byte range; with `ledger`, each
    task records there what it read."""
    items = read_plan(sources, listing)
    for index, item in enumerate(items):
        item["index"] = index
    entries = None
    if ledger is not None:
        ledger.expected, entries = len(items), ledger.actor

    def read_batch(batch: pa.Table) -> Iterator[pa.Table]:
        for item in batch.to_pylist():
            src = sources[item["source"]]
            end = None if item["end"] < 0 else item["end"]
            file = InputFile(item["path"], src.storage_options, item["start"], end, item["before"],
                             bounded=reads_to_range_end(item["path"], src), max_inflated_bytes=src.max_inflated_bytes,
                             max_expansion=src.max_expansion)
            records = 0
            try:
                for table in read_file_tables(file, src, item["name"]):
                    records += table.num_rows
                    yield table
                if entries is None:
                    continue
                size, sha = file.digest()
            finally:
                file.close()
            ray.get(entries.add.remote(item["index"], {
                "source": src.name, "path": item["path"], "start": item["start"], "end": item["start"] + size,
                "bytes": size, "sha256": sha, "records": records}))

    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        read_batch, batch_size=1, batch_format="pyarrow")
