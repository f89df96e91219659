"""Choices scored by log-likelihood over /v1/completions (`echo` + `logprobs`), the lm-eval way: the prediction is
the choice whose continuation tokens have the highest summed log-probability (acc), or the highest per character of
the choice (acc_norm). As in lm-eval, context+continuation is tokenized whole and split after the context's own token
count, and the one generated token (`max_tokens` 1) is dropped — so no local tokenizer is needed, the model is reached
only over HTTP. The context's token count comes from the server's tokenizer (vLLM's /tokenize); a server without that
endpoint gets the context alone as one more prompt, whose echo gives the count. Items travel in groups: one request
carries, for several items, each context+choice as a list of prompts, which the server runs as one batch (an item's
prompts never split across requests) — per-request overhead, not the model, is what costs most on a small served
model. Contexts follow lm-eval's layout, few-shot examples included; a chat task's context is the served model's
chat template rendering of lm-eval's chat messages."""

from __future__ import annotations

import asyncio

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.openai_client import MAX_REPLY_BYTES, OpenAIClient, RequestRejected
from amalia_ray.evals.scores import rejected_row
from amalia_ray.evals.tasks import MCItem, is_completion

TEMPLATE = "Pergunta: {question}\nResposta:"
DELIMITER = " "
# EuroEval's Portuguese multiple-choice prompt for base models (its prompt_templates/multiple_choice.py)
EUROEVAL_PREFIX = "As seguintes são perguntas de escolha múltipla (com respostas)."
FEWSHOT_DELIMITER = "\n\n"  # after each answered example, as lm-eval and EuroEval join them


def description_of(item: MCItem) -> str:
    """What comes before the examples and the question: EuroEval's prefix for its items, else nothing."""
    return EUROEVAL_PREFIX + "\n\n" if item.labels else ""


def query_of(item: MCItem) -> str:
    """The item's own part of the context: the question asked and answered ("Pergunta: …\nResposta:"); for a
    question that is a sentence to complete, the sentence itself (its trailing space left to the delimiter); for a
    question that shows its options (EuroEval's), EuroEval's template, its text on one line as EuroEval writes it."""
    if is_completion(item):
        return item.question.rstrip()
    if item.labels:
        return TEMPLATE.format(question=one_line(item.question))
    return TEMPLATE.format(question=item.question)


def context_of(item: MCItem) -> str:
    """What each choice continues: the description, each few-shot example answered (query, delimiter, its right
    continuation, a blank line), then the item's query — lm-eval's layout of a few-shot context."""
    answered = "".join(query_of(s) + DELIMITER + continuations_of(s)[s.answer] + FEWSHOT_DELIMITER
                       for s in item.shots)
    return description_of(item) + answered + query_of(item)


def one_line(text: str) -> str:
    return text.replace("\n", " ").strip()


def continuations_of(item: MCItem) -> list[str]:
    """What is scored after the context: each choice's text, or its label where the question shows the options."""
    return item.labels or item.choices


def prompts_of(item: MCItem) -> list[str]:
    """An item's context (whose token count the server's tokenizer gives), then the prompts scored: context +
    delimiter + each continuation."""
    context = context_of(item)
    return [context] + [context + DELIMITER + c for c in continuations_of(item)]


def _continuation(choice: dict, n_ctx: int) -> tuple[float, bool]:
    """Summed log-probability of the tokens after the context (the last, generated token left out), and whether
    each was the model's greedy pick."""
    logprobs = choice["logprobs"]
    token_logprobs = logprobs["token_logprobs"][n_ctx:-1]
    top = (logprobs.get("top_logprobs") or [])[n_ctx:-1]
    greedy = all(lp >= max(t.values()) for lp, t in zip(token_logprobs, top) if t)
    return float(sum(token_logprobs)), greedy


def groups_of(items: list[MCItem], prompts_per_request: int, context_prompt: bool = True) -> list[list[MCItem]]:
    """Consecutive items whose prompts (the context where it is echoed alone, then context+choice for each choice)
    fit one request; an item with more prompts than the cap goes alone."""
    groups: list[list[MCItem]] = []
    size = 0
    for item in items:
        n = int(context_prompt) + len(item.choices)
        if not groups or size + n > prompts_per_request:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def _check_echo(items: list[MCItem], outputs: list[dict], usage: dict | None) -> None:
    """Every echo must be its prompt's tokens then exactly one generated token, or the split after the context
    would be off: checked against the server's own token counts when it reports them."""
    if not all(isinstance((o.get("logprobs") or {}).get("token_logprobs"), list) for o in outputs):
        raise AmaliaError(
            f"items {items[0].id}…{items[-1].id}: the server returned no prompt log-probabilities for `echo` + "
            "`logprobs` on /v1/completions; log-likelihood scoring needs a server that echoes them (vLLM does), "
            "or score the task by generation (method: generate)")
    counts = [(usage or {}).get(k) for k in ("prompt_tokens", "completion_tokens")]
    if not all(isinstance(n, int) for n in counts):
        return
    echoed = sum(len(o["logprobs"]["token_logprobs"]) for o in outputs)
    if usage["completion_tokens"] != len(outputs) or echoed != usage["prompt_tokens"] + usage["completion_tokens"]:
        raise AmaliaError(
            f"items {items[0].id}…{items[-1].id}: the server echoed {echoed} tokens for {len(outputs)} prompts of "
            f"{usage['prompt_tokens']} tokens with {usage['completion_tokens']} generated; log-likelihood scoring "
            "needs each prompt's tokens followed by exactly one generated token (max_tokens 1)")


def _delimited(first: str | None, second: str) -> str:
    """lm-eval's join of the system prompt and the description: a blank line between them unless one side
    already has whitespace there."""
    if not first or not second:
        return first or second
    return first + second if first[-1].isspace() or second[0].isspace() else first + FEWSHOT_DELIMITER + second


def chat_of(item: MCItem, system_prompt: str | None = None, multiturn: bool = False) -> list[dict]:
    """lm-eval's chat layout of an item's context: a system turn (the system prompt, then the description), each
    example's query and answer, then the item's query — as one user turn, or with `multiturn` as user and assistant
    turns."""
    system = _delimited(system_prompt, description_of(item))
    turns = [t for s in item.shots for t in (("user", query_of(s), DELIMITER),
                                              ("assistant", continuations_of(s)[s.answer], FEWSHOT_DELIMITER))]
    turns.append(("user", query_of(item), ""))
    if not multiturn:
        turns = [("user", "".join(text + delimiter for _, text, delimiter in turns), "")]
    return [*([{"role": "system", "content": system}] if system else []),
            *({"role": role, "content": text} for role, text, _ in turns)]


async def chat_contexts(client: OpenAIClient, items: list[MCItem], system_prompt: str | None,
                        multiturn: bool) -> tuple[list[str], list[int]]:
    """Each item's context rendered by the served model's chat template, and its token count as lm-eval splits it:
    the rendered text's trailing whitespace goes to the continuation, no special tokens added."""
    contexts = await asyncio.gather(*(client.render_chat(chat_of(it, system_prompt, multiturn)) for it in items))
    counts = await asyncio.gather(*(client.token_count(c.rstrip(), special_tokens=False) for c in contexts))
    if None in counts:
        raise AmaliaError(f"{client.base_url}: chat-template scoring needs the server's /tokenize (vLLM's)")
    return list(contexts), list(counts)


async def score_group(client: OpenAIClient, items: list[MCItem], chat: dict | None = None) -> list[dict]:
    """One request for a group of items; with `chat` (system_prompt, multiturn), each context rendered by the
    served model's chat template."""
    if chat is not None:
        contexts, counts = await chat_contexts(client, items, **chat)
    else:
        contexts = [context_of(item) for item in items]
        counts = await asyncio.gather(*(client.token_count(c) for c in contexts))
    # after a chat template's assistant turn the choice follows at once, no delimiter (lm-eval)
    delimiter = "" if chat is not None else DELIMITER
    scored = [[c + delimiter + x for x in continuations_of(item)] for item, c in zip(items, contexts)]
    echo_contexts = None in counts  # no /tokenize: each context goes first, echoed alone
    prompts = [p for c, full in zip(contexts, scored) for p in ([c] if echo_contexts else []) + full]
    # an echoed prompt comes back as a JSON entry per token (its text, log-probability and top alternative): the
    # reply may be a couple of hundred times the prompts' size, and is read up to that
    r = await client.post("/completions", {"prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True,
                                           "logprobs": 1, **({"add_special_tokens": False} if chat else {})},
                          reply_limit=max(MAX_REPLY_BYTES, 256 * sum(map(len, prompts))))
    outputs = sorted(r["choices"], key=lambda c: c["index"])
    if len(outputs) != len(prompts):
        raise AmaliaError(f"items {items[0].id}…{items[-1].id}: {len(prompts)} prompts sent, "
                          f"{len(outputs)} completions returned")
    _check_echo(items, outputs, r.get("usage"))
    rows, at = [], 0
    for item, n_ctx, full in zip(items, counts, scored):
        if echo_contexts:  # the context's tokens: its echo without the one generated token
            n_ctx = len(outputs[at]["logprobs"]["token_logprobs"]) - 1
            at += 1
        rows.append(_row(item, [_continuation(out, n_ctx) for out in outputs[at:at + len(full)]]))
        at += len(full)
    return rows


async def score_items(client: OpenAIClient, items: list[MCItem], prompts_per_request: int,
                      chat: dict | None = None) -> list[dict]:
    if items and client.can_tokenize is None:
        await client.token_count(context_of(items[0]))  # whether the server tokenizes decides the groups' sizes
    groups = groups_of(items, prompts_per_request, context_prompt=not client.can_tokenize)
    done = await asyncio.gather(*(_group_or_each(client, g, chat) for g in groups))
    return [row for rows in done for row in rows]


async def _group_or_each(client: OpenAIClient, items: list[MCItem], chat: dict | None) -> list[dict]:
    """A group the server refuses is sent again item by item, so one item it cannot take (a prompt over the model's
    context) is reported as rejected without losing the others. A group whose request fails (retries spent, a reply
    over the size limit or not of the shape asked for) fails its items; the other groups are still scored."""
    try:
        return await score_group(client, items, chat)
    except RequestRejected as e:
        if len(items) == 1:
            return [rejected_row(items[0], e)]
        return await score_items(client, items, prompts_per_request=1, chat=chat)  # a group of one item each
    except AmaliaError as e:
        return [rejected_row(item, e, failed=True) for item in items]


def _row(item: MCItem, scored: list[tuple[float, bool]]) -> dict:
    logprobs = [lp for lp, _ in scored]
    # lm-eval divides by the continuation's characters
    normed = [lp / len(c) for lp, c in zip(logprobs, continuations_of(item))]
    pred = max(range(len(logprobs)), key=logprobs.__getitem__)
    pred_norm = max(range(len(normed)), key=normed.__getitem__)
    return {"id": item.id, "answer": item.answer, "pred": pred, "pred_norm": pred_norm, "logprobs": logprobs,
            "greedy": [g for _, g in scored], "acc": float(pred == item.answer),
            "acc_norm": float(pred_norm == item.answer), "meta": item.meta}
