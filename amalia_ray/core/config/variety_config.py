"""How European vs Brazilian Portuguese is told, shared by the data stage's tagging and the evaluation's variety
tasks."""

from __future__ import annotations

from pydantic import Field

from amalia_ray.core.config.strict import Strict


class VarietyScoring(Strict):
    """How European vs Brazilian Portuguese is told: a pt_pt_score, and a label when it is far enough from 0.5."""
    margin: float | None = Field(None, ge=0, lt=0.5, description="pt_pt_score must be this far from 0.5 for a "
                                 "label; default: the model's own (the smallest margin at which it was >= 97% right "
                                 "on text held out from its training: 0.375 for `builtin`), 0.15 for the cue scorer")
    model: str | None = Field(None, description="a variety classifier trained by `amalia data train-variety` "
                              "(a folder, relative to the recipe: `./builtin` for one of that name; `builtin`: "
                              "the one shipped with amalia-ray, trained on ~1,200 Debian packages translated by "
                              "both varieties' teams): pt_pt_score is its P(pt-PT); null = the cue scorer's share "
                              "of pt-PT cues")
