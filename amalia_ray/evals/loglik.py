"""Choices scored by log-likelihood over /v1/completions (`echo` + `logprobs`), the lm-eval way: the prediction is
the choice whose continuation tokens have the highest summed log-probability (acc), or the highest per character of
the choice (acc_norm). As in lm-eval, the context+continuation is tokenized whole and split after the context's own
token count, which the server reports (usage.prompt_tokens) — no local tokenizer, the model is reached only over
HTTP."""

from __future__ import annotations

import asyncio

from amalia_ray.core.openai_client import OpenAIClient
from amalia_ray.evals.tasks import MCItem

TEMPLATE = "Pergunta: {question}\nResposta:"
DELIMITER = " "


def context_of(item: MCItem) -> str:
    return TEMPLATE.format(question=item.question)


async def context_length(client: OpenAIClient, context: str) -> int:
    r = await client.post("/completions", {"prompt": context, "max_tokens": 1, "temperature": 0})
    return r["usage"]["prompt_tokens"]


async def continuation_logprob(client: OpenAIClient, context: str, continuation: str, n_ctx: int) -> tuple[float, bool]:
    """Summed log-probability of the continuation's tokens, and whether each was the model's greedy pick."""
    r = await client.post(
        "/completions",
        {"prompt": context + continuation, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1},
    )
    n_prompt = r["usage"]["prompt_tokens"]
    logprobs = r["choices"][0]["logprobs"]
    token_logprobs = logprobs["token_logprobs"][n_ctx:n_prompt]
    top = (logprobs.get("top_logprobs") or [])[n_ctx:n_prompt]
    greedy = all(lp >= max(t.values()) for lp, t in zip(token_logprobs, top) if t)
    return float(sum(token_logprobs)), greedy


async def score_item(client: OpenAIClient, item: MCItem) -> dict:
    context = context_of(item)
    n_ctx = await context_length(client, context)
    scored = await asyncio.gather(*(continuation_logprob(client, context, DELIMITER + c, n_ctx) for c in item.choices))
    logprobs = [lp for lp, _ in scored]
    normed = [lp / len(c) for lp, c in zip(logprobs, item.choices)]  # lm-eval divides by the choice's characters
    pred = max(range(len(logprobs)), key=logprobs.__getitem__)
    pred_norm = max(range(len(normed)), key=normed.__getitem__)
    return {"id": item.id, "answer": item.answer, "pred": pred, "pred_norm": pred_norm, "logprobs": logprobs,
            "acc": float(pred == item.answer), "acc_norm": float(pred_norm == item.answer), "meta": item.meta}
