"""What else was tried for the pt-PT / pt-BR classifier, and what it bought: each variant trained without three
translation teams (LibreOffice, KDE and GNOME by default: 48% of the pairs) and measured on their texts, beside the
shipped recipe (`train_variety_model`). Prints JSON.

    .venv/bin/python bench/variety_ablations.py --pairs runs/variety-corpus/pairs.jsonl [--udhr DIR]
        [--hold-out libreoffice,kde,gnome] [--variants shipped,presence,...]

Variants (each a logistic regression over hashed n-grams, as `core/variety_model.py`):
- `shipped`: the shipped recipe (character 1-4-grams and word 1-2-grams, each block l2-normalized, the cue counts,
  C = 3, pt-PT twins in the 1990 spelling);
- `presence`: the same n-grams as 0/1 presence, not normalized, so a text's evidence adds up with its length (C 0.1);
- `pair_difference`: trained on x(pt-PT side) - x(pt-BR side) of each pair (presence features, no intercept), so
  what both sides share cancels and only what the teams wrote differently is learned; calibrated on the training
  texts (Platt);
- `cross_team_calibration`: `shipped`, its scores calibrated (Platt) on out-of-team scores: the training teams
  split in two halves (the many small teams of "other" by package), each half scored by a model of the other (the
  calibration is fitted on those half-size models' scores and applied to the model of all the training teams);
- `confident_learning`: `shipped`, retrained without the training pairs either of whose sides the out-of-team
  models above score at least 0.4 away from 0.5 on the wrong side (a side copied from the other variety's
  translation, a catalog in the wrong folder);
- `self_training`: `shipped`, then twice retrained with the held-out texts it labels at margin 0.4 as extra
  examples (one side of each held-out pair, so no parallel text; no held-out label is used); scored on the other
  sides only;
- `no_letter_unigrams`: no character unigrams, and one-letter and function words left out of the word unigrams and
  of the character n-grams (word bigrams keep them): the frequency of "a", "à", "se" differs with the register
  (interface strings against prose), not only the variety;
- `naive_bayes`: multinomial naive Bayes (alpha 0.1) on the n-grams' presence, as the HeLI-style identifiers of
  the VarDial shared tasks add up each n-gram's evidence; calibrated on the training texts (Platt);
- `cross_team_ngrams`: `shipped`, with only the n-grams found in at least 10 teams' texts (a package of "other"
  counting as a team), so no team's own wording can be learned;
- `masked_300`, `masked_3000`: `shipped` on distorted text (a variant of Stamatatos's text distortion, to learn
  style without topic): every word outside the 300 (3,000) that the most teams use has all but its last three
  letters masked ("utilizador" -> "*******dor"; words of up to three letters stay whole), so what is left is those
  words and their order, punctuation, word lengths and endings (gerunds, -ção); the cue counts are of the unmasked
  text (some of the cues are content words: ecrã / tela);
- `longer_ngrams`: `shipped` with character 2-6-grams (no unigrams) and word 1-3-grams, hashed to 2^22 columns
  (fewer collisions): more of each text's wording, against fewer texts sharing each n-gram.

Measured on the held-out teams' texts of at least --min-words words: `symmetric`, the smallest margin at which both
varieties are labelled >= --accuracy right and the share of each variety's texts labelled then; `best_threshold`,
per variety, the largest share of its texts one threshold labels as it while >= --accuracy of all the texts so
labelled are of it (how well the scores rank, calibration aside); and
at the symmetric margin, the UDHR pair, Debian's pt-PT manuals and fortunes-br (bench/variety_accuracy.py's sets).
For `shipped`, `confidently_wrong`: the held-out texts scored at least 0.4 away from 0.5 on the wrong side, by group
and source, and a few of them (reading them shows how many are the label's fault: a pt-BR text that is a pt-PT
translation lightly edited, a pt-PT catalog written in Brazil).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
from scipy.sparse import vstack

from amalia_ray.core.variety import score_variety
from amalia_ray.data.variety.variety_corpus import PT_BR, PT_PT, read_pairs
from amalia_ray.data.variety.variety_training import (DEFAULT_C, _FUNCTION_WORDS, coverage_accuracy, reform_respellings,
                                                        respelled, smallest_margin)
from variety_accuracy import at_margin, evaluation_sets  # this folder is on the path: `python bench/...`

VARIANTS = ("shipped", "presence", "pair_difference", "cross_team_calibration", "confident_learning",
            "self_training", "no_letter_unigrams", "naive_bayes", "cross_team_ngrams", "masked_300", "masked_3000",
            "longer_ngrams")
CROSS_TEAM_MIN_TEAMS = 10
MASKED_SUFFIX = 3  # letters a masked word keeps at its end
N_FEATURES = 1 << 20
LONGER = {"char_ngrams": (2, 6), "word_ngrams": 3, "n_features": 1 << 22}  # `longer_ngrams`
_TOKEN = re.compile(r"(?u)\b\w+(?:-\w+)*\b")
# a one-letter or function word standing alone (not "se" in "pode-se")
_SHORT_OR_FUNCTION_WORD = re.compile(r"(?<![\w-])(?:\w|" + "|".join(sorted(_FUNCTION_WORDS, key=len, reverse=True))
                                     + r")(?![\w-])", re.IGNORECASE)


def features(texts: list[str], *, presence: bool = False, letter_unigrams: bool = True,
             kept_words: frozenset[str] | None = None, char_ngrams: tuple[int, int] = (1, 4), word_ngrams: int = 2,
             n_features: int = N_FEATURES):
    """Hashed character n-grams (within words), word n-grams and the cue counts, as the shipped model's
    `featurize`; `presence`: 0/1 n-grams, not normalized; `letter_unigrams=False`: no character unigrams, and
    one-letter and function words neither as word unigrams nor in the character n-grams (`char_wb` pads each word
    with spaces, so " a " and " se " would carry them); word bigrams keep them; `kept_words`: the n-grams are of
    the text with every other word masked (`masked`); `char_ngrams`, `word_ngrams` (1 to n), `n_features`: as
    `longer_ngrams` sets them."""
    from scipy.sparse import csr_matrix, hstack
    from sklearn.feature_extraction.text import HashingVectorizer

    def words(text: str) -> list[str]:
        tokens = _TOKEN.findall(text.lower())
        unigrams = tokens if letter_unigrams else [t for t in tokens if len(t) > 1 and t not in _FUNCTION_WORDS]
        return unigrams + [" ".join(tokens[i:i + n]) for n in range(2, word_ngrams + 1)
                           for i in range(len(tokens) - n + 1)]

    texts = [t[:5000] for t in texts]
    ngram_texts = texts if kept_words is None else [masked(t, kept_words) for t in texts]
    norm = None if presence else "l2"
    low = char_ngrams[0] if letter_unigrams else max(2, char_ngrams[0])
    chars = HashingVectorizer(analyzer="char_wb", ngram_range=(low, char_ngrams[1]), binary=presence,
                              n_features=n_features, alternate_sign=False, norm=norm, dtype=np.float32)
    word = HashingVectorizer(analyzer=words, n_features=n_features, alternate_sign=False, norm=norm,
                             binary=presence, dtype=np.float32)
    cues = np.array([[math.log1p(s.pt_cues), math.log1p(s.br_cues)] for s in map(score_variety, texts)], np.float32)
    spelled = ngram_texts if letter_unigrams else [_SHORT_OR_FUNCTION_WORD.sub(" ", t) for t in ngram_texts]
    return hstack([chars.transform(spelled), word.transform(ngram_texts), csr_matrix(cues.reshape(len(texts), 2))],
                  format="csr")


_WORD = re.compile(r"(?u)\w+")


def masked(text: str, kept_words: frozenset[str]) -> str:
    """`text` with each word not in `kept_words` (lowercase) masked but for its last letters: "*******dor"."""
    def mask(m: re.Match) -> str:
        word = m.group(0)
        if word.lower() in kept_words:
            return word
        return "*" * max(0, len(word) - MASKED_SUFFIX) + word[-MASKED_SUFFIX:]
    return _WORD.sub(mask, text)


def words_of_most_teams(texts: list[str], team_of_text: list[str], k: int) -> frozenset[str]:
    """The `k` words (lowercase) used by the most teams; ties alphabetically (a set's order changes from one process
    to the next)."""
    users: dict[str, set[str]] = {}
    for team, text in zip(team_of_text, texts):
        for w in _WORD.findall(text.lower()):
            users.setdefault(w, set()).add(team)
    return frozenset(sorted(users, key=lambda w: (-len(users[w]), w))[:k])


def logistic(x, y, c: float, weights=None, intercept: bool = True):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=3000, solver="liblinear", fit_intercept=intercept,
                              random_state=0).fit(x, y, weights)  # as train_variety_model (seed 0)


def platt(z: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    cal = logistic(z[:, None], y, 1e4)
    return float(cal.coef_[0, 0]), float(cal.intercept_[0])


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-z))


def best_threshold(z: np.ndarray, truth: np.ndarray, accuracy: float) -> dict:
    """Per variety: the largest share of its texts that one threshold on the decision values `z` labels as it
    while at least `accuracy` of all the texts so labelled are of it. Ranked on `z`, not on probabilities (which
    round to exactly 1.0 far from 0), and cut only between unequal values, as a threshold can."""
    out = {}
    for variety, side in ((PT_PT, 1), (PT_BR, 0)):
        ranked = -z if side else z
        order = np.argsort(ranked, kind="stable")  # most confident for this side first
        right = np.cumsum(truth[order] == side)
        precision = right / np.arange(1, len(order) + 1)
        run_ends = np.r_[np.diff(ranked[order]) != 0, True]  # the last text of each run of equal values
        ok = np.flatnonzero((precision >= accuracy) & run_ends)
        out[variety] = round(float(right[ok[-1]] / max(1, (truth == side).sum())), 4) if len(ok) else 0.0
    return out


CONFIDENT = math.log(0.9 / 0.1)  # a score 0.4 away from 0.5, as a logit


def teams(train: list[dict]) -> list[str]:
    """Each training pair's team: its group, or for "other" (many small teams) its package."""
    return [p["group"] if p["group"] != "other" else f"package:{p.get('package')}" for p in train]


class NaiveBayes:
    """Multinomial naive Bayes whose decision value is the log-odds of pt-PT, as a linear model's."""

    def __init__(self, x, y: np.ndarray, alpha: float = 0.1):
        from sklearn.naive_bayes import MultinomialNB

        self.model = MultinomialNB(alpha=alpha).fit(x, y)

    def decision_function(self, x) -> np.ndarray:
        joint = self.model.predict_joint_log_proba(x)
        return joint[:, 1] - joint[:, 0]


class ColumnsKept:
    """A linear model trained on some columns of the features only: the others are zeroed before scoring."""

    def __init__(self, x, y: np.ndarray, keep: np.ndarray):
        from scipy.sparse import diags

        self.mask = diags(keep.astype(np.float32))
        self.model = logistic(x @ self.mask, y, DEFAULT_C)

    def decision_function(self, x) -> np.ndarray:
        return self.model.decision_function(x @ self.mask)


def columns_of_many_teams(x, team_of_row: np.ndarray, least: int) -> np.ndarray:
    """The feature columns present in the texts of at least `least` teams; the cue counts (the last two) always."""
    from scipy.sparse import csr_matrix

    rows = csr_matrix((np.ones(len(team_of_row), np.float32), (team_of_row, np.arange(len(team_of_row)))),
                      shape=(int(team_of_row.max()) + 1, len(team_of_row)))
    present = x.copy()
    present.data[:] = 1
    keep = np.asarray(((rows @ present) > 0).sum(axis=0)).ravel() >= least
    keep[-2:] = True
    return keep


def out_of_team_scores(train: list[dict], twin_of: list[int], x, y: np.ndarray) -> np.ndarray:
    """Each training text's decision value by a model that never saw its team: the named teams and the packages of
    "other" (many small teams) split in two halves by a hash, each half scored by a model of the other."""
    unit = teams(train)
    half = np.array([zlib.crc32(u.encode()) % 2 for u in unit])
    fold = np.r_[half, half, half[twin_of]]
    z = np.zeros(len(y))
    for f in (0, 1):
        z[fold == f] = logistic(x[fold != f], y[fold != f], DEFAULT_C).decision_function(x[fold == f])
    return z


def confidently_wrong(scores: np.ndarray, truth: np.ndarray, test: list[dict], shown: int = 12) -> dict:
    wrong = np.flatnonzero(np.where(truth == 1, scores <= 0.1, scores >= 0.9))
    m = len(test)
    by = Counter(f"{test[i % m]['group']}/{test[i % m]['source']}/{PT_PT if truth[i] else PT_BR}" for i in wrong)
    picked = np.random.default_rng(0).choice(wrong, min(shown, len(wrong)), replace=False) if len(wrong) else []
    return {"texts": int(len(wrong)), "of_labelled_at_0.4": int((np.abs(scores - 0.5) >= 0.4).sum()),
            "by_group_source_label": dict(by.most_common()),
            "examples": [{"label": PT_PT if truth[i] else PT_BR, "score": round(float(scores[i]), 3),
                          "text": test[i % m][PT_PT if truth[i] else PT_BR][:240],
                          "other_side": test[i % m][PT_BR if truth[i] else PT_PT][:240]} for i in picked]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=Path, required=True, help="pairs.jsonl of `amalia data variety-corpus`")
    parser.add_argument("--udhr", type=Path, help="folder with por_PT.html and por_BR.html")
    parser.add_argument("--hold-out", default="libreoffice,kde,gnome", help="project groups left out of training")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--accuracy", type=float, default=0.97)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    held_groups = tuple(args.hold_out.split(","))
    pairs = read_pairs(args.pairs)
    train = [p for p in pairs if p.get("group") not in held_groups]
    test = [p for p in pairs if p.get("group") in held_groups and len(p[PT_PT].split()) >= args.min_words]
    if not test:
        parser.error(f"no pairs of {args.hold_out} with {args.min_words}+ words")
    pt = [p[PT_PT] for p in train]
    n = len(pt)
    respelled_pt = respelled(pt, reform_respellings(pt))
    twin_of = [i for i, (new, old) in enumerate(zip(respelled_pt, pt)) if new != old]
    twins = [respelled_pt[i] for i in twin_of]
    train_texts = pt + [p[PT_BR] for p in train] + twins
    y = np.r_[np.ones(n), np.zeros(n), np.ones(len(twins))].astype(int)
    test_texts = [p[PT_PT] for p in test] + [p[PT_BR] for p in test]
    truth = np.r_[np.ones(len(test)), np.zeros(len(test))].astype(int)
    evaluation = evaluation_sets(args.udhr, args.min_words)
    result = {"benchmark": "variety_ablations", "held_out_groups": list(held_groups), "train_pairs": n,
              "held_out_texts": len(test_texts), "min_words": args.min_words, "target_accuracy": args.accuracy,
              "variants": {}}
    cache: dict[tuple, object] = {}
    out_of_team = None  # shared by the two variants that use it

    def x_of(part: str, texts: list[str], **kind):
        key = (part, *sorted(kind.items()))
        if key not in cache:
            cache[key] = features(texts, **kind)
        return cache[key]

    for variant in variants:
        started = time.perf_counter()
        kind = {"presence": variant in ("presence", "pair_difference", "naive_bayes"),
                "letter_unigrams": variant != "no_letter_unigrams"}
        if variant == "longer_ngrams":
            kind.update(LONGER)
        if variant.startswith("masked_"):
            team_of_pair = teams(train)
            kind["kept_words"] = words_of_most_teams(
                train_texts, team_of_pair + team_of_pair + [team_of_pair[i] for i in twin_of], int(variant[7:]))
        x, x_test = x_of("train", train_texts, **kind), x_of("test", test_texts, **kind)
        a, b = 1.0, 0.0  # Platt scaling of the decision function; identity unless a variant calibrates
        notes = {}
        if variant == "pair_difference":
            diff = vstack([x[:n] - x[n:2 * n], x[2 * n:] - x[n:2 * n][twin_of]]).tocsr()
            model = logistic(vstack([diff, -diff]).tocsr(), np.r_[np.ones(diff.shape[0]), np.zeros(diff.shape[0])],
                             0.1, intercept=False)
            a, b = platt(model.decision_function(x), y)
        elif variant == "naive_bayes":
            model = NaiveBayes(x, y)
            a, b = platt(model.decision_function(x), y)
        elif variant == "cross_team_ngrams":
            team_ids = {t: i for i, t in enumerate(dict.fromkeys(teams(train)))}
            team_of_pair = np.array([team_ids[t] for t in teams(train)])
            keep = columns_of_many_teams(x, np.r_[team_of_pair, team_of_pair, team_of_pair[twin_of]],
                                         CROSS_TEAM_MIN_TEAMS)
            notes["teams"], notes["ngrams_kept"] = len(team_ids), int(keep.sum()) - 2
            model = ColumnsKept(x, y, keep)
        elif variant != "confident_learning":
            model = logistic(x, y, 0.1 if variant == "presence" else DEFAULT_C)
        if variant in ("cross_team_calibration", "confident_learning"):
            if out_of_team is None:
                out_of_team = out_of_team_scores(train, twin_of, x, y)
            z = out_of_team
            if variant == "cross_team_calibration":
                a, b = platt(z, y)
            else:
                wrong = np.where(y == 1, z <= -CONFIDENT, z >= CONFIDENT)
                bad = wrong[:n] | wrong[n:2 * n]
                bad[np.asarray(twin_of, int)[wrong[2 * n:]]] = True
                keep = np.r_[~bad, ~bad, ~bad[twin_of]]
                notes["pairs_dropped"] = int(bad.sum())
                model = logistic(x[keep], y[keep], DEFAULT_C)
        if variant == "self_training":
            one_side = np.flatnonzero(np.random.default_rng(0).integers(0, 2, len(test)) == 0)
            pool = np.r_[one_side, len(test) + np.setdiff1d(np.arange(len(test)), one_side)]
            for round_ in range(2):
                p = model.predict_proba(x_test[pool])[:, 1]
                sure = np.abs(p - 0.5) >= 0.4
                labels = (p[sure] > 0.5).astype(int)
                notes[f"round_{round_}_pseudo_labelled"] = int(sure.sum())
                notes[f"round_{round_}_pseudo_label_accuracy"] = round(float((labels == truth[pool][sure]).mean()), 4)
                model = logistic(vstack([x, x_test[pool][sure]]).tocsr(), np.r_[y, labels], DEFAULT_C)
        z_test = a * model.decision_function(x_test) + b
        scored = np.arange(len(truth))
        if variant == "self_training":  # only the sides it was not retrained on
            scored = np.setdiff1d(scored, pool)
            notes["scored_texts"] = len(scored)
        scores = sigmoid(z_test[scored])
        curve = coverage_accuracy(list(scores), [PT_PT if t else PT_BR for t in truth[scored]])
        margin = smallest_margin(curve, args.accuracy)
        row = {"symmetric": at_margin(curve, margin) if margin is not None else None,
               "best_threshold": best_threshold(z_test[scored], truth[scored], args.accuracy),
               "accuracy_at_margin_0": {v: curve[0][v]["accuracy"] for v in (PT_PT, PT_BR)},
               "platt": [round(a, 4), round(b, 4)], **notes, "evaluation": {}}
        for name, (texts, wanted) in evaluation.items():
            s = sigmoid(a * model.decision_function(features(texts, **kind)) + b)
            row["evaluation"][name] = (at_margin(coverage_accuracy(list(s), wanted), margin) if margin is not None
                                       else None)
        if variant == "shipped":
            row["confidently_wrong"] = confidently_wrong(scores, truth, test)
        row["seconds"] = round(time.perf_counter() - started, 1)
        result["variants"][variant] = row
        print(json.dumps({variant: row}), flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
