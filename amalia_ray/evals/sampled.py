"""Exact-answer tasks: the answer read from each generation (`<answer>…</answer>`, else after `</think>`, then the
last `\\boxed{…}`, else the text) and compared with the item's as numbers (pt-PT writing included) or as normalized
text. With one greedy generation per item the task reports exact_match; with `n` samples it reports pass@1 and
pass@n — the unbiased estimator of Chen et al. (2021), 1 − C(n−c, k) / C(n, k) for c right answers among n — and
maj@n, whether the most frequent answer is right (DeepSeek-R1's cons@n). Each is a mean over items, so its standard
error is the items' sample sd / √n like every other score."""

from __future__ import annotations

import re
from collections import Counter
from math import comb

from amalia_ray.core.judge import final_answer
from amalia_ray.core.openai_client import OpenAIClient, generate_n
from amalia_ray.core.rewards import canonical_answer
from amalia_ray.evals.tasks import AnswerItem

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def extracted(text: str) -> str | None:
    """The answer a generation gives, in canonical form (None: it gives none)."""
    text = final_answer(text)
    boxed = _BOXED.findall(text)
    return canonical_answer(boxed[-1] if boxed else text)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn from these n (c of them right) is right."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def metric_names(n: int) -> tuple[str, ...]:
    return ("exact_match",) if n == 1 else ("pass@1", f"pass@{n}", f"maj@{n}")


async def score_answer(client: OpenAIClient, item: AnswerItem, *, n: int, max_tokens: int, chat: bool,
                       temperature: float, top_p: float, seed: int, system_prompt: str | None = None) -> dict:
    generations = await generate_n(client, item.prompt, n=n, max_tokens=max_tokens, chat=chat,
                                   temperature=temperature, top_p=top_p, seed=seed, system_prompt=system_prompt)
    want = canonical_answer(item.answer)
    answers = [extracted(g) for g in generations]
    right = [a is not None and a == want for a in answers]
    row = {"id": item.id, "answer": item.answer, "preds": answers, "correct": right, "generations": generations,
           "seed": seed, "meta": item.meta}
    if n == 1:
        return {**row, "exact_match": float(right[0])}
    votes = Counter(a for a in answers if a is not None)
    majority = votes.most_common(1)[0][0] if votes else None  # ties: the answer sampled first
    return {**row, "pass@1": pass_at_k(n, sum(right), 1), f"pass@{n}": pass_at_k(n, sum(right), n),
            f"maj@{n}": float(majority is not None and majority == want), "majority": majority}
