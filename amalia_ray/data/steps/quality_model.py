"""A trained quality classifier, DCLM's recipe on a CPU budget: positives from a curated high-quality source,
negatives from raw web text, word uni- and bigrams hashed into 2^20 features (as fastText's `-wordNgrams 2` with
hashed buckets) and a logistic regression over them (scikit-learn). The model is a folder holding
`quality_model.json` (settings, what it was trained on, its held-out precision and recall) and `weights.npz` (the
non-zero weights): plain arrays and JSON, nothing executable, so a model from elsewhere is safe to load.

`QualityModelScore` scores a batch of documents (`quality_score` = probability of the positive class); the data
stage runs it on a pool of Ray actors so each loads the model once."""

from __future__ import annotations

import heapq
import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from amalia_ray.core.config import SourceConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.data.read.readers import read_file_tables
from amalia_ray.data.steps.base import DocumentStep, add_drop_reasons, already_dropped, unit_hash
from amalia_ray.data.steps.cleaning import Normalize

MODEL_FILE = "quality_model.json"
WEIGHTS_FILE = "weights.npz"
KIND = "hashed-word-ngram-logistic-regression"
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".warc": "warc", ".arc": "warc",
           ".html": "html", ".htm": "html"}


def _vectorizer(n_features: int, ngram_max: int):
    from sklearn.feature_extraction.text import HashingVectorizer

    return HashingVectorizer(n_features=n_features, ngram_range=(1, ngram_max), alternate_sign=False, norm="l2",
                             lowercase=True, token_pattern=r"(?u)\b\w+\b", dtype=np.float32)


class QualityModel:
    def __init__(self, folder: Path):
        folder = Path(folder)
        meta_path = folder / MODEL_FILE
        if not meta_path.is_file():
            raise AmaliaError(f"quality model not found: {meta_path} (train one with `amalia data train-quality`)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("kind") != KIND:
            raise AmaliaError(f"{meta_path}: not a quality model of this kind ({KIND}); kind is "
                              f"{self.meta.get('kind')!r}")
        with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as w:
            self.weights = np.zeros(self.meta["n_features"], np.float32)
            self.weights[w["index"]] = w["value"]
        self.bias = float(self.meta["intercept"])
        self.max_chars = int(self.meta["max_chars"])
        self.vectorizer = _vectorizer(self.meta["n_features"], self.meta["ngram_max"])

    def score(self, texts: list[str]) -> np.ndarray:
        """Probability that each text is like the positives."""
        if not texts:
            return np.empty(0, np.float64)
        x = self.vectorizer.transform([t[: self.max_chars] for t in texts])
        z = np.asarray(x @ self.weights, np.float64) + self.bias
        return 1 / (1 + np.exp(-z))


class QualityModelScore(DocumentStep):
    """Adds `quality_score` to every document not dropped yet; with a threshold, marks those below it
    `quality_model:below_threshold`. Run in an actor pool: each actor loads the model once, at its first batch."""

    in_actors = True

    def __init__(self, folder: str, threshold: float | None):
        self.folder, self.threshold = folder, threshold
        self.init_args = (folder, threshold)  # what an actor of the pool is constructed with

    @cached_property
    def model(self) -> QualityModel:
        return QualityModel(Path(self.folder))

    def __call__(self, batch: pa.Table) -> pa.Table:
        done = already_dropped(batch)
        live = [i for i, d in enumerate(done) if not d]
        texts = batch["text"].to_pylist()
        scores: list[float | None] = [None] * len(batch)
        for i, s in zip(live, self.model.score([texts[i] for i in live])):
            scores[i] = float(s)
        batch = batch.append_column("quality_score", pa.array(scores, pa.float64()))
        if self.threshold is None:
            return batch
        return add_drop_reasons(batch, ["quality_model:below_threshold" if s is not None and s < self.threshold
                                        else None for s in scores])


def read_texts(paths: list[str], label: str, text_field: str, max_docs: int) -> list[str]:
    """The documents of some files (format by extension; plain text split into paragraphs), NFC-normalised like
    the data stage's; at most `max_docs`, chosen by a hash of their ids (the same every run), kept as they are read:
    negatives may be a raw crawl, which is not held whole."""
    if max_docs < 1:
        raise AmaliaError(f"--max-docs {max_docs}: at least 1 document per side")
    normalize = Normalize()
    kept: list[tuple[float, str, str]] = []  # (-hash, id, text): a heap of the max_docs smallest hashes so far
    for path in paths:
        if not Path(path).is_file():
            raise AmaliaError(f"--{label}: file not found: {path}")
        name = Path(path).name
        suffix = next((FORMATS[s] for s in (Path(name.removesuffix(".gz").removesuffix(".zst")).suffix,)
                       if s in FORMATS), "text")
        src = SourceConfig(name=label, paths=[path], format=suffix, text_field=text_field, split="paragraph")
        for table in read_file_tables(path, src):
            ok = table.filter(pc.is_null(table["drop_reason"]))
            for doc_id, text in zip(ok["id"].to_pylist(), ok["text"].to_pylist()):
                key = unit_hash(doc_id)
                if len(kept) >= max_docs and key >= -kept[0][0]:
                    continue
                if not (text := normalize.clean(text)).strip():
                    continue
                (heapq.heappush if len(kept) < max_docs else heapq.heapreplace)(kept, (-key, doc_id, text))
    docs = [(doc_id, text) for _, doc_id, text in kept]
    if not docs:
        raise AmaliaError(f"--{label}: no documents in {', '.join(paths)}")
    return [t for _, t in sorted(docs)]


def train_quality_model(out: Path, positive: list[str], negative: list[str], *, text_field: str = "text",
                        holdout: float = 0.1, max_docs: int = 200_000, min_chars: int = 200,
                        n_features: int = 1 << 20, ngram_max: int = 2, max_chars: int = 20_000, c: float = 4.0,
                        seed: int = 0) -> dict:
    """Train on the positives against the negatives (balanced class weights), measure on a held-back share of
    each, write the model folder. Returns what quality_model.json records."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import precision_recall_fscore_support, roc_auc_score

    pos = [t for t in read_texts(positive, "positive", text_field, max_docs) if len(t) >= min_chars]
    neg = [t for t in read_texts(negative, "negative", text_field, max_docs) if len(t) >= min_chars]
    if len(pos) < 10 or len(neg) < 10:
        raise AmaliaError(f"too few documents of at least {min_chars} characters to train on: {len(pos)} positive, "
                          f"{len(neg)} negative (10 of each at least)")
    texts, labels = pos + neg, np.array([1] * len(pos) + [0] * len(neg))
    held = np.array([unit_hash(f"{seed}:{i}:{t[:200]}") < holdout for i, t in enumerate(texts)])
    vec = _vectorizer(n_features, ngram_max)
    x = vec.transform([t[:max_chars] for t in texts])
    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=2000, random_state=seed)
    clf.fit(x[~held], labels[~held])
    metrics = {"train_positive": int((labels[~held] == 1).sum()), "train_negative": int((labels[~held] == 0).sum()),
               "heldout_positive": int((labels[held] == 1).sum()), "heldout_negative": int((labels[held] == 0).sum())}
    if held.any() and len(set(labels[held])) == 2:
        prob = clf.predict_proba(x[held])[:, 1]
        p, r, f, _ = precision_recall_fscore_support(labels[held], prob >= 0.5, average="binary", zero_division=0)
        metrics.update(precision=round(float(p), 4), recall=round(float(r), 4), f1=round(float(f), 4),
                       roc_auc=round(float(roc_auc_score(labels[held], prob)), 4))
    coef = clf.coef_[0].astype(np.float32)
    nz = np.flatnonzero(coef)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / WEIGHTS_FILE, index=nz.astype(np.int64), value=coef[nz])
    meta = {"kind": KIND, "n_features": n_features, "ngram_max": ngram_max, "max_chars": max_chars,
            "intercept": float(clf.intercept_[0]), "C": c, "min_chars": min_chars,
            "positive": [str(p) for p in positive], "negative": [str(n) for n in negative], "metrics": metrics}
    (out / MODEL_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta
