"""Heuristic quality filters (a minimum length, Gopher quality, Gopher repetition, FineWeb line filters) as
Arrow-batch steps.

They follow the published definitions (Rae et al. 2021; FineWeb; datatrove's implementations) with thresholds from
the recipe; the defaults are FineWeb-2's Portuguese ones where FineWeb-2 tuned them. A dropped document gets
`drop_reason = "<filter>:<rule>"`, so the stats table can say which rule removed what.
"""

from __future__ import annotations

import re
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from amalia_ray.core.config import FineWebConfig, GopherQualityConfig, GopherRepetitionConfig, QualityConfig
from amalia_ray.data.steps.base import DocumentStep, add_drop_reasons, already_dropped, mark_dropped

_WORD = re.compile(r"\w+", re.UNICODE)
_PARAGRAPHS = re.compile(r"\n{2,}")
_TERMINAL_PUNCT = tuple(".!?\"'”»)…:;")
_BULLETS = ("•", "-", "*", "·", "–", "‣", "◦", "▪")

STOP_WORDS = {
    "pt": {"de", "a", "o", "que", "e", "do", "da", "em", "um", "para", "com", "não", "uma", "os", "no", "se"},
    "en": {"the", "be", "to", "of", "and", "that", "have", "with"},
}


def words_of(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _dup_fraction(items: list[str]) -> tuple[float, float]:
    """Share of items that repeat an earlier one, by count and by characters."""
    if not items:
        return 0.0, 0.0
    seen: set[str] = set()
    dup_count = dup_chars = 0
    for item in items:
        if item in seen:
            dup_count += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    total_chars = sum(len(i) for i in items) or 1
    return dup_count / len(items), dup_chars / total_chars


def top_ngram_fraction(words: list[str], n: int) -> float:
    """Characters covered by the most frequent n-gram, over all word characters."""
    if len(words) < n:
        return 0.0
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    gram, count = grams.most_common(1)[0]
    return sum(len(w) for w in gram) * count / (sum(len(w) for w in words) or 1)


def duplicated_ngram_fraction(words: list[str], n: int) -> float:
    """Characters inside n-grams that occur more than once (each word counted once), over all word characters."""
    if len(words) < n:
        return 0.0
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    covered = [False] * len(words)
    for i in range(len(words) - n + 1):
        if grams[tuple(words[i:i + n])] > 1:
            covered[i:i + n] = [True] * n
    return sum(len(w) for w, c in zip(words, covered) if c) / (sum(len(w) for w in words) or 1)


def gopher_quality_reason(text: str, cfg: GopherQualityConfig, language: str) -> str | None:
    words = words_of(text)
    n = len(words)
    if n < cfg.min_doc_words:
        return "min_doc_words"
    if n > cfg.max_doc_words:
        return "max_doc_words"
    mean_len = sum(len(w) for w in words) / n
    if not cfg.min_avg_word_length <= mean_len <= cfg.max_avg_word_length:
        return "avg_word_length"
    if (text.count("#") + text.count("...") + text.count("…")) / n > cfg.max_symbol_word_ratio:
        return "symbol_word_ratio"
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if lines and sum(ln.startswith(_BULLETS) for ln in lines) / len(lines) > cfg.max_bullet_lines_ratio:
        return "bullet_lines_ratio"
    if lines and sum(ln.endswith(("...", "…")) for ln in lines) / len(lines) > cfg.max_ellipsis_lines_ratio:
        return "ellipsis_lines_ratio"
    raw_tokens = text.split()
    alpha = sum(any(ch.isalpha() for ch in t) for t in raw_tokens) / (len(raw_tokens) or 1)
    if alpha < cfg.min_alpha_words_ratio:
        return "alpha_words_ratio"
    stop = STOP_WORDS.get(language)
    if stop and len(stop.intersection(words)) < cfg.min_stop_words:
        return "stop_words"
    return None


def gopher_repetition_reason(text: str, cfg: GopherRepetitionConfig) -> str | None:
    paragraphs = [p.strip() for p in _PARAGRAPHS.split(text) if p.strip()]
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    para_frac, para_char_frac = _dup_fraction(paragraphs)
    line_frac, line_char_frac = _dup_fraction(lines)
    if para_frac > cfg.dup_para_frac:
        return "dup_para_frac"
    if para_char_frac > cfg.dup_para_char_frac:
        return "dup_para_char_frac"
    if line_frac > cfg.dup_line_frac:
        return "dup_line_frac"
    if line_char_frac > cfg.dup_line_char_frac:
        return "dup_line_char_frac"
    words = words_of(text)
    for n, limit in zip((2, 3, 4), cfg.top_ngram_fractions):
        if top_ngram_fraction(words, n) > limit:
            return f"top_{n}_gram"
    for n, limit in zip(range(5, 11), cfg.dup_ngram_fractions):
        if duplicated_ngram_fraction(words, n) > limit:
            return f"dup_{n}_gram"
    return None


def fineweb_reason(text: str, cfg: FineWebConfig) -> str | None:
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    if not lines:
        return "empty"
    if sum(ln.endswith(_TERMINAL_PUNCT) for ln in lines) / len(lines) < cfg.line_punct_thr:
        return "line_punct_ratio"
    if sum(len(ln) <= cfg.short_line_length for ln in lines) / len(lines) > cfg.short_line_thr:
        return "short_line_ratio"
    _, dup_chars = _dup_fraction(lines)
    if dup_chars > cfg.char_duplicates_ratio:
        return "char_dup_ratio"
    words = words_of(text)
    if words and text.count("\n") / len(words) > cfg.new_line_ratio:
        return "new_line_ratio"
    return None


def heuristic_score(text: str, language: str) -> float:
    """A score in [0, 1] from the measures the filters threshold, for ranking documents that all passed them (the
    best copy of a duplicate cluster): the mean of the share of lines ending in punctuation, of alphabetic words,
    of characters outside repeated lines and outside repeated 5-grams, and of stop words (scaled so that 30 % or
    more counts as 1: running text, not lists)."""
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    tokens = text.split()
    words = words_of(text)
    if not lines or not words:
        return 0.0
    stop = STOP_WORDS.get(language, set())
    parts = [
        sum(ln.endswith(_TERMINAL_PUNCT) for ln in lines) / len(lines),
        sum(any(ch.isalpha() for ch in t) for t in tokens) / len(tokens),
        1 - _dup_fraction(lines)[1],
        1 - duplicated_ngram_fraction(words, 5),
        min(1.0, sum(w in stop for w in words) / len(words) / 0.3) if stop else 1.0,
    ]
    return sum(parts) / len(parts)


class MinLength(DocumentStep):
    """Marks documents shorter than `min_chars` characters."""

    reason = "min_chars"

    def __init__(self, min_chars: int):
        self.min_chars = min_chars

    def __call__(self, batch: pa.Table) -> pa.Table:
        short = pc.less(pc.utf8_length(batch["text"]), self.min_chars)
        return mark_dropped(batch, short, self.reason)


class HeuristicScore(DocumentStep):
    """Adds `quality_score` (heuristic_score) to every document not dropped yet (null for the dropped)."""

    def __init__(self, language: str):
        self.language = language

    def __call__(self, batch: pa.Table) -> pa.Table:
        done = already_dropped(batch)
        scores = [None if d else heuristic_score(t, self.language) for t, d in zip(batch["text"].to_pylist(), done)]
        return batch.append_column("quality_score", pa.array(scores, pa.float64()))


class QualityFilter(DocumentStep):
    """Applies one rule function to every not-yet-dropped document of a batch."""

    def __init__(self, name: str, rule, *args):
        self.name, self.rule, self.args = name, rule, args

    def __call__(self, batch: pa.Table) -> pa.Table:
        done = already_dropped(batch)
        reasons = [None if d else self.rule(t, *self.args) for t, d in zip(batch["text"].to_pylist(), done)]
        return add_drop_reasons(batch, [f"{self.name}:{r}" if r else None for r in reasons])


def quality_steps(cfg: QualityConfig | None) -> list[QualityFilter]:
    """The enabled filters in datatrove's order: repetition, quality, FineWeb lines."""
    if cfg is None:
        return []
    steps = []
    if cfg.gopher_repetition.enabled:
        steps.append(QualityFilter("gopher_repetition", gopher_repetition_reason, cfg.gopher_repetition))
    if cfg.gopher_quality.enabled:
        steps.append(QualityFilter("gopher_quality", gopher_quality_reason, cfg.gopher_quality, cfg.language))
    if cfg.fineweb.enabled:
        steps.append(QualityFilter("fineweb", fineweb_reason, cfg.fineweb))
    return steps
