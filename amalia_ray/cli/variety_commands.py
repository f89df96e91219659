"""`amalia data variety-corpus | train-variety | variety`: the pt-PT / pt-BR classifier's training text, its
training, and tagging a file with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from amalia_ray.cli.common import console, guarded
from amalia_ray.cli.run_commands import data_app


@data_app.command("variety-corpus")
@guarded
def data_variety_corpus(
    debs: Annotated[Path, typer.Argument(help="a folder of Debian packages (.deb, as `apt-get download` fetches them) "
                                         "translated into both varieties: libreoffice-help-pt and -pt-br, "
                                         "firefox-esr-l10n-pt-pt and -pt-br, any package with pt and pt_BR "
                                         "message catalogs or manuals (GNOME/MATE help, KDE handbooks)")],
    output: Annotated[Path, typer.Argument(help="writes OUTPUT/pairs.jsonl and OUTPUT/summary.json")],
    min_words: Annotated[int, typer.Option(help="pairs with a side of fewer words are left out")] = 3,
) -> None:
    """Aligned pt-PT / pt-BR pairs from separately translated packages: the variety classifier's training text."""
    from amalia_ray.data.variety.variety_corpus import write_variety_corpus

    summary = write_variety_corpus(debs, output, min_words)
    console.print_json(json.dumps({"pairs": summary["pairs"], "by_group": summary["pairs_by_group"],
                                   "output": str(output)}))


@data_app.command("train-variety")
@guarded
def data_train_variety(
    pairs: Annotated[Path, typer.Argument(help="pairs.jsonl of `amalia data variety-corpus` (or any jsonl with "
                                          "'pt-PT' and 'pt-BR' fields; 'group' names a pair's project)")],
    output: Annotated[Path, typer.Argument(help="the model folder to write (variety_model.json, weights.npz)")],
    exclude_group: Annotated[list[str], typer.Option(help="leave a project group out of training and measure on "
                                                     "it (repeatable)")] = [],  # noqa: B006 - typer's way
    holdout: Annotated[float, typer.Option(help="share of the other pairs held back to measure on")] = 0.1,
    c: Annotated[float | None, typer.Option("--c", help="inverse regularization strength of the logistic "
                                            "regression (default: variety_training.DEFAULT_C, 3)")] = None,
    label_margin: Annotated[float | None, typer.Option(help="the label margin the model records, measured elsewhere "
                                                       "(default: the smallest at which what it holds out, the "
                                                       "excluded groups if any, is >= 97% right)")] = None,
    seed: int = 0,
) -> None:
    """Train the pt-PT / pt-BR classifier that `variety: {model: PATH}` applies in the data stage, the eval
    stage's variety metric and the pt_variety reward."""
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.variety.variety_corpus import read_pairs
    from amalia_ray.data.variety.variety_training import DEFAULT_C, train_variety_model

    if not pairs.is_file():
        raise AmaliaError(f"pairs not found: {pairs}")
    if not 0 <= holdout < 1:
        raise AmaliaError(f"--holdout must be within [0, 1), got {holdout}")
    if label_margin is not None and not 0 <= label_margin < 0.5:
        raise AmaliaError(f"--label-margin must be within [0, 0.5), got {label_margin}")
    meta = train_variety_model(output, read_pairs(pairs), exclude_groups=tuple(exclude_group), holdout=holdout,
                               c=DEFAULT_C if c is None else c, seed=seed, label_margin=label_margin)
    console.print_json(json.dumps({"model": str(output), "train_pairs": meta["train_pairs"],
                                   "respelled_pt_twins": meta["respelled_pt_twins"],
                                   "measured": {k: {"pairs": v["pairs"], "margin_0": v["curve"][0],
                                                    "same_content_words": v["same_content_words"]}
                                                for k, v in meta["measured"].items()}}))


@data_app.command("variety")
@guarded
def data_variety(
    input: Annotated[Path, typer.Argument(help="jsonl with a 'text' field, or plain text (one paragraph per line)")],
    output: Annotated[Path, typer.Argument(help="jsonl: each input record (a line: {'text': …}) with pt_variety "
                                           "and pt_pt_score added; for an input over 256 MB, a folder of jsonl "
                                           "parts written in parallel by Ray Data")],
    model: Annotated[Path | None, typer.Option(help="a variety model folder (`amalia data train-variety`), or "
                                               "`builtin` (the one shipped); without one, the cue scorer")] = None,
    margin: Annotated[float | None, typer.Option(help="pt_pt_score must be this far from 0.5 for a label (default: "
                                                 "the model's own margin; 0.15 for the cue scorer)")] = None,
    text_field: Annotated[str, typer.Option(help="jsonl: the field holding the text")] = "text",
) -> None:
    """Tag each text pt-PT, pt-BR or unknown with its pt_pt_score."""
    from amalia_ray.cluster.local import ray_session
    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.data.variety.variety_tagging import LOCAL_BYTES, tag_file

    if margin is not None and not 0 <= margin < 0.5:
        raise AmaliaError(f"--margin must be within [0, 0.5), got {margin}")
    if input.is_file() and input.stat().st_size > LOCAL_BYTES:  # Ray Data reads, scores and writes it in parts
        with ray_session(dashboard=False):
            counts = tag_file(input, output, model, margin, text_field)
    else:
        counts = tag_file(input, output, model, margin, text_field)
    console.print_json(json.dumps({"output": str(output), **counts}))
