"""Training and measuring the pt-PT / pt-BR variety classifier (`core/variety_model.py`) on aligned pairs
(`variety_corpus.py`). Both sides of a pair go to the same split, so a held-out pair's content was never seen with
either label; a whole project group can be left out of training and measured on (`exclude_groups`), so what is
measured is the variety, not one team's wording."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.variety_model import KIND, MODEL_FILE, N_CUE_FEATURES, WEIGHTS_FILE, VarietyModel, featurize
from amalia_ray.data.steps.base import unit_hash
from amalia_ray.data.variety.variety_corpus import PT_BR, PT_PT

MARGINS = tuple(round(0.025 * i, 3) for i in range(20))  # 0 to 0.475
# the logistic regression's inverse regularization: an unseen team writes with words seen rarely, whose weights 1
# keeps small. bench/variety_accuracy.py at 3 and at --c 1 (bench/results/variety_accuracy.json, _c1.json): teams
# held out, pooled, 51.0% / 47.3% labelled at >= 97% against 47.3% / 44.3%; seen teams 68.2% / 62.1% against
# 61.1% / 54.1%
DEFAULT_C = 3.0
LABEL_ACCURACY = 0.97  # what a model's own margin is chosen for, on text held out from its training


def coverage_accuracy(scores: list[float], expected: list[str], margins=MARGINS) -> list[dict]:
    """For each margin: per variety, the share of its texts labelled (coverage) and the share of those labelled
    right (accuracy); a text is labelled when its P(pt-PT) is at least the margin away from 0.5."""
    s, truth = np.asarray(scores, np.float64), np.asarray(expected)
    rows = []
    for margin in margins:
        row = {"margin": margin}
        for variety in (PT_PT, PT_BR):
            mine = s[truth == variety]
            pt, br = mine >= 0.5 + margin, mine <= 0.5 - margin
            if margin == 0:  # every text but one with no evidence either way (exactly 0.5)
                pt, br = mine > 0.5, mine < 0.5
            labelled = int(pt.sum() + br.sum())
            right = int((pt if variety == PT_PT else br).sum())
            row[variety] = {"texts": int(len(mine)), "coverage": round(labelled / max(1, len(mine)), 4),
                            "accuracy": round(right / max(1, labelled), 4) if labelled else None}
        rows.append(row)
    return rows


def smallest_margin(curve: list[dict], accuracy: float) -> float | None:
    """The smallest margin at which both varieties are labelled at least `accuracy` right (None if none is)."""
    for row in curve:
        if all(row[v]["accuracy"] is not None and row[v]["accuracy"] >= accuracy for v in (PT_PT, PT_BR)):
            return row["margin"]
    return None


def _sides(pairs: list[dict]) -> tuple[list[str], np.ndarray]:
    texts = [p[PT_PT] for p in pairs] + [p[PT_BR] for p in pairs]
    return texts, np.array([1] * len(pairs) + [0] * len(pairs))


def held_out(pairs: list[dict], holdout: float, seed: int = 0) -> np.ndarray:
    """Which pairs a `holdout` share keeps out of training: chosen by a hash of the pair's id, so the same pairs at
    every run and both sides of a pair together."""
    return np.array([unit_hash(f"{seed}:{p.get('pair', i)}") < holdout for i, p in enumerate(pairs)], bool)


# Portugal adopted the 1990 spelling agreement (in force there from 2009; schools and the state from 2011-2012): its
# silent c and p went, so "acção", "actual", "seleccione" became "ação", "atual", "selecione", which Brazil already
# wrote. About half the pt-PT catalogs (KDE's, Launchpad's, Debian's, the Translation Project's) keep the old forms,
# so a model trained on them learns the new ones as pt-BR evidence and fails on current European text (LibreOffice's
# pt help, today's press and web). Each pt-PT training text with an old form gets a respelled twin: the old forms
# stay pt-PT evidence and the new ones become shared.
_SILENT_CONSONANT = re.compile(r"(?<=[aeiouáéíóú])[cp](?=[çtc])")


def reform_respellings(pt_texts: list[str], min_count: int = 3, min_share: float = 0.1) -> dict[str, str]:
    """Old pt-PT spellings and their 1990-agreement forms, learned from the pt-PT texts themselves: a word is
    respelled when dropping a c or p after a vowel and before ç, t or c ("acção", "actual", "seleccione",
    "excepcional") gives a word those texts also use, at least `min_count` times and at least `min_share` as
    often. So "facto" and "secção" keep their c (Portugal still writes them so: "fato" and "seção" are all but
    absent), and names and acronyms ("dcc", "apt") are left alone."""
    counts = Counter(w for text in pt_texts for w in re.findall(r"\w+", text.lower()))
    respell = {}
    for word, n in counts.items():
        if n < min_count or len(word) < 4:
            continue
        for site in _SILENT_CONSONANT.finditer(word):
            new = word[:site.start()] + word[site.end():]
            if counts.get(new, 0) >= max(min_count, min_share * n):
                respell[word] = new
    return respell


def respelled(texts: list[str], respell: dict[str, str]) -> list[str]:
    """Each text with the words of `respell` replaced (a capital first letter or an all-capital word kept)."""
    if not respell:
        return list(texts)
    words = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, respell), key=len, reverse=True)) + r")\b",
                       re.IGNORECASE)

    def new(match: re.Match) -> str:
        old = match.group(0)
        word = respell.get(old.lower(), old)  # a case-insensitive match that lower() does not map back stays
        if old.isupper() and len(old) > 1:
            return word.upper()
        return word[0].upper() + word[1:] if old[0].isupper() else word
    return [words.sub(new, t) for t in texts]


def train_variety_model(out: Path, pairs: list[dict], *, exclude_groups: tuple[str, ...] = (), holdout: float = 0.1,
                        n_features: int = 1 << 20, char_ngrams: tuple[int, int] = (1, 4),
                        word_ngrams: tuple[int, int] = (1, 2), max_chars: int = 5000, c: float = DEFAULT_C,
                        respell_reform: bool = True, seed: int = 0, label_margin: float | None = None) -> dict:
    """Fit on the pairs outside `exclude_groups` less a `holdout` share of them (chosen by a hash of the pair's
    id), with a respelled twin of each pt-PT text in the pre-1990 spelling (`respell_reform`); measure on the
    held-out share and on each excluded group; record the label margin (`label_margin`, else the smallest that is
    >= 97% right on the excluded groups, else on the held-out share); write the model folder. Returns what
    variety_model.json records."""
    from sklearn.linear_model import LogisticRegression

    if missing := sorted(set(exclude_groups) - {p.get("group") for p in pairs}):
        raise AmaliaError(f"no pairs of the group(s) to leave out: {', '.join(missing)}; the pairs' groups: "
                          f"{', '.join(sorted({str(p.get('group')) for p in pairs}))}")
    used = [p for p in pairs if p.get("group") not in exclude_groups]
    held = held_out(used, holdout, seed)
    train = [p for p, h in zip(used, held) if not h]
    if len(train) < 50:
        raise AmaliaError(f"too few pairs to train on: {len(train)} (50 at least) after leaving out "
                          f"{', '.join(exclude_groups) or 'nothing'} and a {holdout:.0%} held-out share")
    texts, labels = _sides(train)
    pt_texts = texts[:len(train)]  # _sides puts the pt-PT sides first
    respell = reform_respellings(pt_texts) if respell_reform else {}
    twins = [new for new, old in zip(respelled(pt_texts, respell), pt_texts) if new != old]
    texts, labels = texts + twins, np.concatenate([labels, np.ones(len(twins), labels.dtype)])
    x = featurize(texts, n_features, char_ngrams, word_ngrams, max_chars)
    clf = LogisticRegression(C=c, max_iter=3000, solver="liblinear", random_state=seed)
    clf.fit(x, labels)
    coef = clf.coef_[0].astype(np.float32)
    nz = np.flatnonzero(coef)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / WEIGHTS_FILE, index=nz.astype(np.int64), value=coef[nz])
    meta = {"kind": KIND, "n_features": n_features, "char_ngrams": list(char_ngrams),
            "word_ngrams": list(word_ngrams), "max_chars": max_chars, "cue_features": N_CUE_FEATURES,
            "intercept": float(clf.intercept_[0]), "C": c, "seed": seed, "train_pairs": len(train),
            "reform_respellings": len(respell), "respelled_pt_twins": len(twins),
            "train_pairs_by_group": _by_group(train), "excluded_groups": list(exclude_groups)}
    (out / MODEL_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    model = VarietyModel(out)
    measured = {}
    if held.any():
        measured["held_out_pairs"] = measure(model, [p for p, h in zip(used, held) if h])
    for group in exclude_groups:
        if group_pairs := [p for p in pairs if p.get("group") == group]:
            measured[f"group:{group}"] = measure(model, group_pairs)
    if len(exclude_groups) > 1:
        measured["excluded_groups"] = measure(model, [p for p in pairs if p.get("group") in exclude_groups])
    meta["measured"] = measured
    # the margin labels are given at by default: one measured elsewhere when given, else the smallest >= 97% right
    # on what this training held out, teams it never saw (the excluded groups) rather than its own teams' pairs
    basis = ("excluded_groups" if len(exclude_groups) > 1 else f"group:{exclude_groups[0]}") if exclude_groups \
        else "held_out_pairs"
    if label_margin is not None:
        meta["margin"], meta["margin_basis"] = label_margin, "given (--label-margin)"
    else:
        found = smallest_margin(measured[basis]["curve"], LABEL_ACCURACY) if basis in measured else None
        meta["margin"], meta["margin_basis"] = found, f"smallest >= {LABEL_ACCURACY:.0%} right on {basis}"
    (out / MODEL_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def measure(model: VarietyModel, pairs: list[dict]) -> dict:
    """Both sides of each pair scored: the coverage/accuracy curve, and accuracy at margin 0 over the pairs whose
    two sides use the same content words (only the variety's spelling or grammar tells them apart)."""
    texts, labels = _sides(pairs)
    scores = model.score(texts)
    expected = [PT_PT if y else PT_BR for y in labels]
    same = [i for i, p in enumerate(pairs) if content_words(p[PT_PT]) == content_words(p[PT_BR])]
    n = len(pairs)
    right = sum((scores[i] > 0.5) + (scores[n + i] < 0.5) for i in same)
    return {"pairs": n, "curve": coverage_accuracy(list(scores), expected),
            "same_content_words": {"pairs": len(same), "accuracy": round(right / (2 * len(same)), 4) if same
                                   else None}}


# closed-class words: articles, prepositions and contractions, pronouns, auxiliaries, conjunctions
_FUNCTION_WORDS = set("""o a os as um uma uns umas de do da dos das em no na nos nas num numa por pelo pela pelos pelas
para pra com sem sob sobre ao à aos às e ou mas que se não nem já também como mais menos muito pouco é são foi
ser estar está estão estava tem têm ter há haver vai vão ir eu tu você vocês ele ela eles elas nós vós me te lhe
lhes nos vos lo la los las seu sua seus suas meu minha teu tua nosso nossa este esta isto esse essa isso aquele
aquela aquilo qual quais quando onde""".split())


def content_words(text: str) -> frozenset[str]:
    import re

    return frozenset(w for w in re.findall(r"\w+", text.lower()) if w not in _FUNCTION_WORDS and not w.isdigit())


def _by_group(pairs: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in pairs:
        counts[p.get("group", "other")] = counts.get(p.get("group", "other"), 0) + 1
    return dict(sorted(counts.items()))
