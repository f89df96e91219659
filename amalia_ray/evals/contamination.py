"""Which benchmark items a model may have seen in training: every item's word n-grams (the data stage's
decontamination rule, `core/ngrams.py`) looked up in a run's curated corpus (`runs/NAME/data/kept`) or in any corpus
file or folder (jsonl or Parquet: every string field of a record is its text, so chat and preference sets are read
too). The eval reports each item's `seen` flag and the scores on the unseen items beside the full scores."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.ngrams import ItemIndex
from amalia_ray.evals.scores import summarize
from amalia_ray.evals.tasks import Item, item_text

NGRAM, MIN_OVERLAP, MIN_ITEM_WORDS = 13, 1, 8
LINE_CHARS = 16 << 20


def corpus_root(target: Path) -> Path:
    """What of a target is its training text: a run folder's curated corpus (data/kept), else the file or folder."""
    return target / "data" / "kept" if (target / "manifest.json").is_file() else target


def corpus_files(target: Path) -> list[Path]:
    """A run folder's curated corpus, or the jsonl/Parquet files of a file or folder."""
    if (target / "manifest.json").is_file() and not corpus_root(target).is_dir():
        raise AmaliaError(f"--contamination-of {target}: the run has no curated corpus (data/kept) yet")
    target = corpus_root(target)
    if not target.exists():
        raise AmaliaError(f"--contamination-of: not found: {target} (a run folder, or a jsonl/Parquet corpus)")
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
    files = [f for f in files if f.suffix == ".parquet" or f.name.endswith((".jsonl", ".jsonl.gz", ".json"))]
    if not files:
        raise AmaliaError(f"--contamination-of {target}: no jsonl or Parquet files (a run folder must have run its "
                          "data stage)")
    return files


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _texts(path: Path) -> Iterator[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        f = pq.ParquetFile(path)
        text_only = ["text"] if "text" in f.schema_arrow.names else None
        for batch in f.iter_batches(batch_size=1024, columns=text_only):
            for row in batch.to_pylist():
                yield "\n".join(_strings(row))
        return
    import gzip

    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        # a line is read in pieces of at most LINE_CHARS (a file of one huge line is not held whole); a piece that is
        # not JSON, or that JSON cannot be read for (a 5,000-digit number, nesting past its depth), is text as it is
        for line in iter(lambda: f.readline(LINE_CHARS), ""):
            if line.strip():
                try:
                    yield "\n".join(_strings(json.loads(line)))
                except (ValueError, RecursionError):
                    yield line


def seen_items(tasks: dict[str, list[Item]], targets: list[Path]) -> dict[str, set[str]]:
    """For each task, the ids of its items that share at least one 13-gram (or, for an item shorter than 13 words,
    its whole text) with some document of the targets. One index holds every task's items, so the corpus is read
    once whatever the number of tasks, and its files are scanned side by side (`_file_hits`)."""
    index = ItemIndex.build({task: [(it.id, item_text(it)) for it in items] for task, items in tasks.items()},
                            NGRAM, MIN_ITEM_WORDS)
    files = [f for target in targets for f in corpus_files(target)]
    found: set[int] = set()
    if index.items:
        scans = _scans(index, files)
        for hits in scans:
            found.update(hits)
            if len(found) == len(index.items):
                scans.close()  # every item seen: the rest of the corpus cannot change that
                break
    seen: dict[str, set[str]] = {task: set() for task in tasks}
    for i in found:
        task, item_id = index.items[i]
        seen[task].add(item_id)
    return seen


def _file_hits(index: ItemIndex, path: str) -> list[int]:
    """The items (indices into `index.items`) that some document of one corpus file overlaps."""
    hits: set[int] = set()
    for text in _texts(Path(path)):
        hits.update(index.overlaps(text, MIN_OVERLAP))
        if len(hits) == len(index.items):
            break
    return sorted(hits)


def _scans(index: ItemIndex, files: list[Path]) -> Iterator[list[int]]:
    """Each file's hits. Connected to Ray (the eval stage of a run): one Ray task per file over the cluster's CPUs,
    at most two per CPU in flight, each returning only the items it found, so nothing of the corpus reaches this
    process. Otherwise the files one after another here."""
    import ray

    if not ray.is_initialized() or len(files) < 2:
        for path in files:
            yield _file_hits(index, str(path))
        return
    scan = ray.remote(num_cpus=1)(_file_hits)
    shared = ray.put(index)
    window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    queue, pending = list(reversed(files)), []
    try:
        while queue or pending:
            while queue and len(pending) < window:
                pending.append(scan.remote(shared, str(queue.pop())))
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    finally:
        for ref in pending:  # stopped early: every item seen, or an error
            ray.cancel(ref)


def with_contamination(result: dict, seen: set[str], metrics: tuple[str, ...], targets: list[Path]) -> dict:
    """The result with every item's `seen` flag and the scores on the unseen items (`scores_clean`, `n_clean`)."""
    rows = result["items"]
    for row in rows:
        row["seen"] = str(row.get("id")) in seen
    clean = [r for r in rows if not r["seen"] and "rejected" not in r]
    return {**result, "contamination_of": [str(t) for t in targets],
            "n_seen": sum(r["seen"] for r in rows if "rejected" not in r), "n_clean": len(clean),
            "scores_clean": summarize(clean, metrics) if clean else None, "items": rows}
