"""Rule-based rewards for GRPO: plain Python functions `(completion: str, example: dict) -> float`, registered by
name. A recipe names them (`rewards: [format, exact_answer]`) or points at its own (`package.module:function`)."""

from __future__ import annotations

import importlib
import re
from functools import partial
from typing import Callable

Reward = Callable[[str, dict], float]
REWARDS: dict[str, Reward] = {}

_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"-?\d+(?:[.\s]\d{3})*(?:,\d+)?|-?\d+(?:\.\d+)?")


def register(name: str) -> Callable[[Reward], Reward]:
    def add(fn: Reward) -> Reward:
        REWARDS[name] = fn
        return fn
    return add


def get_reward(name: str, variety_model: str | None = None) -> Reward:
    """A registered reward, or `module:function` imported (what a recipe uses for its own). `variety_model`: the
    classifier pt_variety scores with (None: the cue scorer)."""
    if name == "pt_variety":
        return partial(pt_variety_reward, model=variety_model)
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward '{name}' cannot be imported: {e}") from None
    raise ValueError(f"unknown reward '{name}'; registered: {sorted(REWARDS)} (or give module:function)")


@register("format")
def format_reward(completion: str, example: dict) -> float:
    """1 when the completion is `<think>…</think> <answer>…</answer>` and nothing else (R1's format reward)."""
    return 1.0 if _FORMAT.fullmatch(completion) else 0.0


@register("exact_answer")
def exact_answer_reward(completion: str, example: dict) -> float:
    """1 when the answer (inside <answer>, else the last number of the completion) equals `example["answer"]`,
    numbers compared as numbers (pt-PT writing: 1 234,5 or 1.234,5 = 1234.5)."""
    tagged = _ANSWER.findall(completion)
    text = tagged[-1] if tagged else completion
    if not tagged and not _NUMBER.search(text):
        return 0.0
    return 1.0 if canonical_answer(text) == canonical_answer(str(example["answer"])) else 0.0


def canonical_answer(text: str) -> str | None:
    """What an answer says, in a form two answers can be compared (or counted, for a majority vote) by: the last
    number in it as a number (pt-PT writing: 1 234,5 = 1.234,5 = 1234,50), else the text, lower-cased, its spaces
    and final full stop collapsed; None for an empty answer."""
    numbers = _NUMBER.findall(text)
    if numbers:
        # the whole answer when it is one number ("2.5" as code writes it, too), else its last number
        value = _as_number(numbers[-1] if not _NUMBER.fullmatch(text.strip()) else text)
        if value is not None:
            return repr(value + 0.0)  # -0.0 and 0.0 alike
    normalized = _normalize_text(text)
    return normalized or None


def _normalize_text(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .")


def _as_number(text: str) -> float | None:
    text = text.strip().replace(" ", "")
    if "," in text:  # decimal comma; dots are thousands separators
        text = text.replace(".", "").replace(",", ".")
    elif re.fullmatch(r"-?\d{1,3}(\.\d{3})+", text):  # 1.234 = thousands in pt-PT
        text = text.replace(".", "")
    try:
        return float(text)
    except ValueError:
        return None


@register("has_number")
def has_number_reward(completion: str, example: dict) -> float:
    """1 when the completion contains a number at all: a shaping reward that gives a small model from scratch some
    signal before it can get answers right (weigh it low next to exact_answer)."""
    return 1.0 if _NUMBER.search(completion) else 0.0


@register("pt_variety")
def pt_variety_reward(completion: str, example: dict, model: str | None = None) -> float:
    """P(pt-PT) of the completion's answer (inside <answer> when tagged) by the variety classifier, or the cue
    scorer's share of pt-PT cues (0.5 when it finds none): a reward for writing European Portuguese."""
    from amalia_ray.core.variety_model import pt_pt_scores

    tagged = _ANSWER.findall(completion)
    return float(pt_pt_scores([tagged[-1] if tagged else completion], model)[0])
