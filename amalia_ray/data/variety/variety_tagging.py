"""`amalia data variety`: a file's texts tagged pt-PT / pt-BR / unknown with their pt_pt_score. A file up to
LOCAL_BYTES is streamed through this process a batch at a time; a larger one is read, scored and written by Ray
Data, the model loaded once per actor, into a folder of jsonl parts."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.variety_model import label_texts

LOCAL_BYTES = 256 << 20
BATCH = 1024


def _records(path: Path, text_field: str):
    """(record, text) of a jsonl file (records are objects with `text_field`) or a plain text file (a paragraph
    per non-blank line, as {text_field: line})."""
    jsonl = path.name.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not jsonl:
                yield {text_field: line.rstrip("\n")}, line.strip()
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise AmaliaError(f"{path} line {n}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise AmaliaError(f"{path} line {n}: needs a string field {text_field!r}")
            yield record, record[text_field]


class TagBatch:
    """A Ray Data step: adds pt_variety and pt_pt_score to a batch's `text_field` column."""

    def __init__(self, model: str | None, margin: float, text_field: str):
        self.model, self.margin, self.text_field = model, margin, text_field

    def __call__(self, batch: pa.Table) -> pa.Table:
        labels, scores = label_texts(batch[self.text_field].to_pylist(), self.model, self.margin)
        return batch.append_column("pt_variety", pa.array(labels, pa.string())).append_column(
            "pt_pt_score", pa.array(scores, pa.float64()))


def tag_file(path: Path, output: Path, model: Path | None, margin: float, text_field: str = "text",
             local_bytes: int = LOCAL_BYTES) -> dict:
    if not path.is_file():
        raise AmaliaError(f"input not found: {path}")
    if output.exists() and output.resolve() == path.resolve():
        raise AmaliaError(f"{output}: the output would overwrite the input; name another file")
    model_dir = str(model) if model is not None else None
    if model_dir is not None:  # a missing or foreign model fails here, before any text is read
        from amalia_ray.core.variety_model import load_variety_model

        load_variety_model(model_dir)
    if path.stat().st_size > local_bytes:
        return _tag_with_ray_data(path, output, model_dir, margin, text_field)
    counts: Counter = Counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as out:
        batch: list[tuple[dict, str]] = []
        for item in itertools.chain(_records(path, text_field), [None]):  # None: the end, flush the last batch
            if item is not None:
                batch.append(item)
            if batch and (item is None or len(batch) >= BATCH):
                labels, scores = label_texts([t for _, t in batch], model_dir, margin)
                for (record, _), label, score in zip(batch, labels, scores):
                    out.write(json.dumps({**record, "pt_variety": label, "pt_pt_score": round(score, 6)},
                                         ensure_ascii=False) + "\n")
                    counts[label] += 1
                batch = []
    return {"texts": sum(counts.values()), **{k: counts[k] for k in ("pt-PT", "pt-BR", "unknown")}}


def _tag_with_ray_data(path: Path, output: Path, model: str | None, margin: float, text_field: str) -> dict:
    import ray

    if path.name.endswith((".jsonl", ".json")):
        ds = ray.data.read_json(str(path), lines=True)
    else:
        ds = ray.data.read_text(str(path), drop_empty_lines=True).rename_columns({"text": text_field})
    if text_field not in ds.schema().names:
        raise AmaliaError(f"{path}: needs a string field {text_field!r}; has {ds.schema().names}")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise AmaliaError(f"{output}: the parts of a large input go into a new or empty folder")
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    ds.map_batches(TagBatch, fn_constructor_args=(model, margin, text_field), batch_format="pyarrow",
                   batch_size=BATCH, compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cpus)
                   ).write_json(str(output))
    counts: Counter = Counter()  # summed from each written part's own counts: no shuffle for three numbers
    labels = ray.data.read_json(str(output), lines=True).select_columns(["pt_variety"])
    for table in ray.get(labels.map_batches(_label_counts, batch_format="pyarrow").to_arrow_refs()):
        counts.update(dict(zip(table["pt_variety"].to_pylist(), table["n"].to_pylist())))
    return {"texts": sum(counts.values()), **{k: counts[k] for k in ("pt-PT", "pt-BR", "unknown")},
            "parts": str(output)}


def _label_counts(batch: pa.Table) -> pa.Table:
    counts = batch["pt_variety"].value_counts()
    return pa.table({"pt_variety": counts.field("values"), "n": counts.field("counts")})
