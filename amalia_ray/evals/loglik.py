"""Choices scored by log-likelihood over /v1/completions (`echo` + `logprobs`), the lm-eval way: the prediction is
the choice whose continuation tokens have the highest summed log-probability (acc), or the highest per character of
the choice (acc_norm). As in lm-eval, context+continuation is tokenized whole and split after the context's own token
count, and the one generated token (`max_tokens` 1) is dropped — so no local tokenizer is needed, the model is reached
only over HTTP. Per item, one request carries every context+choice as a list of prompts, which the server runs as
one batch, and a light one (no echo) counts the context's tokens."""

from __future__ import annotations

import asyncio

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.openai_client import OpenAIClient
from amalia_ray.evals.tasks import MCItem

TEMPLATE = "Pergunta: {question}\nResposta:"
DELIMITER = " "


def context_of(item: MCItem) -> str:
    return TEMPLATE.format(question=item.question)


def _continuation(choice: dict, n_ctx: int) -> tuple[float, bool]:
    """Summed log-probability of the tokens after the context (the last, generated token left out), and whether
    each was the model's greedy pick."""
    logprobs = choice["logprobs"]
    token_logprobs = logprobs["token_logprobs"][n_ctx:-1]
    top = (logprobs.get("top_logprobs") or [])[n_ctx:-1]
    greedy = all(lp >= max(t.values()) for lp, t in zip(token_logprobs, top) if t)
    return float(sum(token_logprobs)), greedy


async def context_length(client: OpenAIClient, context: str) -> int:
    """The context's own token count, from a plain completion (no echo: prompt log-probabilities are the costly
    part of scoring, and this one needs none)."""
    r = await client.post("/completions", {"prompt": context, "max_tokens": 1, "temperature": 0})
    return r["usage"]["prompt_tokens"]


async def score_item(client: OpenAIClient, item: MCItem) -> dict:
    context = context_of(item)
    prompts = [context + DELIMITER + c for c in item.choices]
    n_ctx, r = await asyncio.gather(context_length(client, context), client.post(
        "/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}))
    outputs = sorted(r["choices"], key=lambda c: c["index"])
    if len(outputs) != len(prompts):
        raise AmaliaError(f"item {item.id}: {len(prompts)} prompts sent, {len(outputs)} completions returned")
    scored = [_continuation(out, n_ctx) for out in outputs]
    logprobs = [lp for lp, _ in scored]
    normed = [lp / len(c) for lp, c in zip(logprobs, item.choices)]  # lm-eval divides by the choice's characters
    pred = max(range(len(logprobs)), key=logprobs.__getitem__)
    pred_norm = max(range(len(normed)), key=normed.__getitem__)
    return {"id": item.id, "answer": item.answer, "pred": pred, "pred_norm": pred_norm, "logprobs": logprobs,
            "greedy": [g for _, g in scored], "acc": float(pred == item.answer),
            "acc_norm": float(pred_norm == item.answer), "meta": item.meta}
