"""A learned pt-PT / pt-BR variety classifier: character n-grams (spelling: -ção / -cção, -ómico / -ômico, "facto"
/ "fato"), word uni- and bigrams (function words and their order: "pode-se" / "se pode", "estar a" + infinitive /
the gerund, você / tu) hashed into a fixed number of features, plus the cue scorer's two counts, and a logistic
regression over them (scikit-learn), trained on separately translated text (`data/variety/variety_training.py`).

The model is a folder holding `variety_model.json` (settings, what it was trained on, its held-out figures) and
`weights.npz` (the non-zero weights): plain arrays and JSON, nothing executable, so a model from elsewhere is safe
to load. Its score is P(pt-PT); a label needs the score `margin` away from 0.5, as the cue scorer's does: by default
the margin the model records (`margin` in variety_model.json: the smallest at which it labelled ≥ 97% right on
text held out from its training), the cue scorer's 0.15 without a model.

`builtin` names the model shipped in `pt_variety_model/` beside this file: what `make variety-model` trains on
~1,200 Debian packages (its variety_model.json records the pairs and their groups; docs/data.md its accuracy).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.variety import CUE_MARGIN, score_variety, variety_label

MODEL_FILE = "variety_model.json"
WEIGHTS_FILE = "weights.npz"
KIND = "hashed-char-word-ngram-logistic-regression/pt-variety"
N_CUE_FEATURES = 2
MAX_FEATURES = 1 << 24  # hashed features per block a model may declare (2^24 float32 weights: 64 MB)
BUILTIN = "builtin"
BUILTIN_FOLDER = Path(__file__).parent / "pt_variety_model"


def variety_model_folder(model: str | Path, resolve=Path) -> Path:
    """The folder a `model` setting names: `builtin` is the shipped model; any other value is a path, which
    `resolve` places (a recipe's paths are relative to the recipe's folder)."""
    return BUILTIN_FOLDER if str(model) == BUILTIN else resolve(str(model))


def model_for_workers(model: str, resolve) -> str:
    """The setting a worker or the eval client is given: a path resolved where the recipe is, `builtin` as it is
    (each process loads its own installed copy: on another node the package may live elsewhere)."""
    return BUILTIN if model == BUILTIN else str(resolve(model))


def featurize(texts: list[str], n_features: int, char_ngrams: tuple[int, int], word_ngrams: tuple[int, int],
              max_chars: int):
    """Sparse rows: hashed character n-grams (within words, space-padded), hashed word n-grams (each block
    l2-normalized) and log(1 + count) of the cue scorer's pt-PT and pt-BR cues."""
    from scipy.sparse import csr_matrix, hstack
    from sklearn.feature_extraction.text import HashingVectorizer

    texts = [t[:max_chars] for t in texts]
    chars = HashingVectorizer(analyzer="char_wb", ngram_range=tuple(char_ngrams), n_features=n_features,
                              alternate_sign=False, norm="l2", lowercase=True, dtype=np.float32)
    words = HashingVectorizer(analyzer="word", ngram_range=tuple(word_ngrams), n_features=n_features,
                              alternate_sign=False, norm="l2", lowercase=True, token_pattern=r"(?u)\b\w+(?:-\w+)*\b",
                              dtype=np.float32)
    cues = np.array([[math.log1p(s.pt_cues), math.log1p(s.br_cues)] for s in map(score_variety, texts)],
                    np.float32).reshape(len(texts), N_CUE_FEATURES)
    return hstack([chars.transform(texts), words.transform(texts), csr_matrix(cues)], format="csr")


class VarietyModel:
    def __init__(self, folder: str | Path):
        folder = variety_model_folder(folder)
        meta_path = folder / MODEL_FILE
        if not meta_path.is_file():
            raise AmaliaError(f"variety model not found: {meta_path} (train one with `amalia data train-variety`)")
        try:
            self.meta = json.loads(meta_path.read_text())
            kind = self.meta.get("kind")
        except (ValueError, AttributeError) as e:
            raise AmaliaError(f"{meta_path}: not a variety model's settings ({e})") from None
        if kind != KIND:
            raise AmaliaError(f"{meta_path}: not a variety model of this kind ({KIND}); kind is {kind!r}")
        m = self.meta
        try:  # settings a crafted file could make huge: the weights' size, the n-gram ranges, the text read
            n, chars, words, max_chars = int(m["n_features"]), m["char_ngrams"], m["word_ngrams"], int(m["max_chars"])
            bias = float(m["intercept"])
            ok = (1 <= n <= MAX_FEATURES and 1 <= max_chars <= 1_000_000
                  and all(len(r) == 2 and 1 <= int(r[0]) <= int(r[1]) <= 8 for r in (chars, words)))
        except (KeyError, TypeError, ValueError) as e:
            raise AmaliaError(f"{meta_path}: a setting is missing or malformed ({type(e).__name__}: {e})") from None
        if not ok:
            raise AmaliaError(f"{meta_path}: settings out of range (n_features 1..{MAX_FEATURES}, n-grams 1..8, "
                              "max_chars up to 1,000,000)")
        size = 2 * n + N_CUE_FEATURES
        try:
            with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as w:
                index, value = np.asarray(w["index"]), np.asarray(w["value"], np.float32)
        except (OSError, ValueError, KeyError) as e:
            raise AmaliaError(f"{folder / WEIGHTS_FILE}: not the model's weights ({e})") from None
        if (index.dtype.kind not in "iu" or index.ndim != 1 or index.shape != value.shape
                or (len(index) and (index.min() < 0 or index.max() >= size))):
            raise AmaliaError(f"{folder / WEIGHTS_FILE}: weight indices outside the model's {size} features, or "
                              "not one integer index per weight")
        self.weights = np.zeros(size, np.float32)
        self.weights[index] = value
        self.bias = bias
        margin = m.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)
                                   or not 0 <= margin < 0.5):
            raise AmaliaError(f"{meta_path}: margin {margin!r} is not within [0, 0.5)")
        self.margin: float | None = margin
        self.folder = folder

    def score(self, texts: list[str]) -> np.ndarray:
        """P(pt-PT) of each text."""
        if not texts:
            return np.empty(0, np.float64)
        m = self.meta
        x = featurize(texts, m["n_features"], m["char_ngrams"], m["word_ngrams"], m["max_chars"])
        z = np.asarray(x @ self.weights, np.float64) + self.bias
        return 1 / (1 + np.exp(-z))


def load_variety_model(folder: str) -> VarietyModel:
    """One load per process and model (a reward or an eval metric scores many texts, one call each); a model
    trained again into the same folder is loaded again."""
    folder = variety_model_folder(folder)
    weights = folder / WEIGHTS_FILE
    return _cached_model(str(folder), weights.stat().st_mtime_ns if weights.exists() else 0)


@lru_cache(maxsize=4)
def _cached_model(folder: str, stamp: int) -> VarietyModel:
    return VarietyModel(Path(folder))


def pt_pt_scores(texts: list[str], model: str | Path | None = None) -> list[float]:
    """P(pt-PT) of each text by the model at `model`, else the cue scorer's pt-PT share (0.5 = no evidence)."""
    if model is None:
        return [score_variety(t).pt_pt for t in texts]
    return [float(s) for s in load_variety_model(str(model)).score(texts)]



def label_margin(model: str | Path | None, margin: float | None = None) -> float:
    """The margin labels are given at: `margin` when set, else the model's own, else the cue scorer's."""
    if margin is not None:
        return margin
    if model is None:
        return CUE_MARGIN
    loaded = load_variety_model(str(model))
    if loaded.margin is None:
        raise AmaliaError(f"the variety model at {loaded.folder} records no label margin (none of the margins it was "
                          "measured at was >= 97% right on what it held out): set variety.margin (--margin)")
    return loaded.margin


def label_texts(texts: list[str], model: str | Path | None,
                margin: float | None = None) -> tuple[list[str], list[float]]:
    """(pt-PT / pt-BR / unknown, P(pt-PT)) of each text, by the model or the cue scorer, at `label_margin`."""
    scores = pt_pt_scores(texts, model)
    at = label_margin(model, margin)
    return [variety_label(s, at) for s in scores], scores
