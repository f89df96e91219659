"""Multiple choice scored by log-likelihood over /v1/completions (`echo` + `logprobs`), the lm-eval way:
the answer is the choice whose continuation tokens have the highest summed log-probability (acc), or the highest
per-character log-probability (acc_norm)."""

from __future__ import annotations

import asyncio
import math

from amalia_ray.core.openai_client import OpenAIClient
from amalia_ray.evals.tasks import MCItem


def prompt_of(item: MCItem) -> tuple[str, list[str]]:
    return f"Pergunta: {item.question}\nResposta:", [f" {c}" for c in item.choices]


async def context_length(client: OpenAIClient, context: str) -> int:
    """Tokens in the context alone (usage.prompt_tokens), so the continuation's tokens can be picked out of the
    echoed full prompt without a local tokenizer."""
    r = await client.post("/completions", {"prompt": context, "max_tokens": 1, "temperature": 0})
    return r["usage"]["prompt_tokens"]


async def continuation_logprob(client: OpenAIClient, context: str, continuation: str, n_ctx: int) -> float:
    r = await client.post(
        "/completions",
        {"prompt": context + continuation, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1},
    )
    n_prompt = r["usage"]["prompt_tokens"]
    token_logprobs = r["choices"][0]["logprobs"]["token_logprobs"][:n_prompt]
    return float(sum(token_logprobs[n_ctx:]))


async def score_item(client: OpenAIClient, item: MCItem) -> dict:
    context, continuations = prompt_of(item)
    n_ctx = await context_length(client, context)
    logprobs = await asyncio.gather(*(continuation_logprob(client, context, c, n_ctx) for c in continuations))
    normed = [lp / len(c) for lp, c in zip(logprobs, continuations)]
    pred = max(range(len(logprobs)), key=logprobs.__getitem__)
    pred_norm = max(range(len(normed)), key=normed.__getitem__)
    return {"id": item.id, "answer": item.answer, "pred": pred, "pred_norm": pred_norm, "logprobs": logprobs}


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


async def evaluate_mc(client: OpenAIClient, items: list[MCItem]) -> dict:
    rows = await asyncio.gather(*(score_item(client, it) for it in items))
    acc, acc_se = mean_and_stderr([float(r["pred"] == r["answer"]) for r in rows])
    acc_norm, acc_norm_se = mean_and_stderr([float(r["pred_norm"] == r["answer"]) for r in rows])
    chance = sum(1 / len(it.choices) for it in items) / len(items)
    return {
        "scores": {"acc": acc, "acc_stderr": acc_se, "acc_norm": acc_norm, "acc_norm_stderr": acc_norm_se,
                   "chance": chance},
        "n": len(rows),
        "items": rows,
    }
