"""Score one task on one served model over HTTP and write its result JSON: the scores with their standard errors, n,
and every item's prediction. Requests run concurrently (bounded) with retries on transient errors."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from pathlib import Path

import httpx

from amalia_ray.core.config import EvalConfig, EvalTaskConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.openai_client import OpenAIClient, RequestRejected, chat_messages
from amalia_ray.core.storage import write_json
from amalia_ray.evals import generate, judge, loglik, sampled
from amalia_ray.evals.contamination import seen_items, with_contamination
from amalia_ray.evals.fewshot import task_items
from amalia_ray.evals.scores import by_group, rejected_row, summarize
from amalia_ray.evals.tasks import CHOICE_FORMATS

log = logging.getLogger("amalia_ray.evals")

METRICS = {
    ("choice", "loglik"): ("acc", "acc_norm"),
    ("choice", "generate"): ("acc",),
    ("cloze", "generate"): ("exact_match",),
    ("variety", "generate"): ("pt_pt", "pt_br", "unknown", "pt_pt_score"),
    ("judge", "generate"): ("score",),
}


def metrics_of(task: EvalTaskConfig) -> tuple[str, ...]:
    if task.format == "answer":
        return sampled.metric_names(task.n)
    family = "choice" if task.format in CHOICE_FORMATS else task.format
    return METRICS[(family, task.scoring)]


def _scorer(task: EvalTaskConfig, client: OpenAIClient, judge_client: OpenAIClient | None, settings: EvalConfig):
    """A coroutine function from the task's items to their rows, in item order."""
    if task.format in CHOICE_FORMATS and task.scoring == "loglik":
        chat = {"system_prompt": task.system_prompt, "multiturn": task.multiturn} if task.chat else None
        return lambda items: loglik.score_items(client, items, settings.prompts_per_request, chat)
    gen = {"max_tokens": task.max_tokens, "chat": task.chat, "temperature": task.temperature, "top_p": task.top_p,
           "system_prompt": task.system_prompt}
    if task.format == "answer":
        one = partial(sampled.score_answer, client, n=task.n, **gen)
    elif task.format in CHOICE_FORMATS:
        one = partial(generate.score_mc_generation, client, fmt=task.format, **gen)
    elif task.format == "cloze":
        one = partial(generate.score_cloze, client, **gen)
    elif task.format == "variety":
        one = partial(generate.score_variety_of_generation, client, **gen, variety_model=settings.variety.model,
                      variety_margin=settings.variety.margin)
    else:
        j = settings.judge
        one = partial(judge.score_judged, client, judge_client, **gen, judge_chat=j.chat, judge_max_tokens=j.max_tokens,
                      rubric=j.rubric or judge.DEFAULT_RUBRIC)

    async def kept(i: int, item):  # an item the server refuses, or that fails, is reported, the others still scored
        try:
            return await one(item, seed=task.seed + i)
        except RequestRejected as e:
            return rejected_row(item, e)
        except AmaliaError as e:  # retries spent, a reply over the size limit or not of the shape asked for
            return rejected_row(item, e, failed=True)

    return lambda items: asyncio.gather(*(kept(i, item) for i, item in enumerate(items)))


def requests_of(task: EvalTaskConfig, item) -> dict:
    """The exact text the harness sends for one item (what `amalia eval --show-prompt` prints): for log-likelihood,
    the context and each context + delimiter + choice scored on /v1/completions; for generation, the prompt, or
    for a `chat` task the messages (the system turn, then the prompt as the user's). (A judge task's grading prompt depends on
    the answer, so only the question is shown.)"""
    if task.format in CHOICE_FORMATS and task.scoring == "loglik" and task.chat:
        return {"id": item.id, "endpoint": "/v1/completions (echo, logprobs) after the served model's chat template "
                "renders the messages", "messages": loglik.chat_of(item, task.system_prompt, task.multiturn),
                "continuations": loglik.continuations_of(item)}
    if task.format in CHOICE_FORMATS and task.scoring == "loglik":
        context, *prompts = loglik.prompts_of(item)
        return {"id": item.id, "endpoint": "/v1/completions (echo, logprobs)", "context": context, "prompts": prompts}
    if task.format in CHOICE_FORMATS:
        prompt = generate.mc_prompt(item, task.format)
    elif task.format == "cloze":
        prompt = item.context
    else:
        prompt = item.prompt
    if task.chat:
        return {"id": item.id, "endpoint": "/v1/chat/completions",
                "messages": chat_messages(prompt, task.system_prompt)}
    return {"id": item.id, "endpoint": "/v1/completions", "prompt": prompt}


def run_task(task: EvalTaskConfig, task_path: Path, *, base_url: str, model: str, settings: EvalConfig,
             output: Path | None = None, api_key: str | None = None,
             transport: httpx.AsyncBaseTransport | None = None,
             contamination_of: list[Path] | None = None, seen: set[str] | None = None) -> dict:
    """Score the task's items; with `contamination_of` (run folders or corpora), also flag each item seen in that
    training text and score the unseen ones apart (`seen`: those ids, when already computed)."""
    items = task_items(task, task_path)
    if contamination_of and seen is None:
        seen = seen_items({task.name: items}, contamination_of)[task.name]
    client_args = {"concurrency": settings.concurrency, "timeout_s": settings.request_timeout_s,
                   "retries": settings.retries, "transport": transport}

    usage = {"prompt_tokens": 0, "completion_tokens": 0}

    async def go() -> list[dict]:
        async with OpenAIClient(base_url, model, api_key=api_key, **client_args) as client:
            judge_client = None
            if task.format == "judge":
                j = settings.judge
                # the judge's own key; the served model's key only where the judge is that same server
                judge_key = os.environ.get(j.api_key_env) if j.api_key_env else None if j.base_url else api_key
                judge_client = OpenAIClient(j.base_url or base_url, j.model, api_key=judge_key, **client_args)
            try:
                return list(await _scorer(task, client, judge_client, settings)(items))
            finally:
                for c in (client, judge_client):
                    for k, n in (c.usage.items() if c else ()):
                        usage[k] += n
                if judge_client:
                    await judge_client.__aexit__()

    t0 = time.perf_counter()
    rows = asyncio.run(go())
    rejected = [r for r in rows if "rejected" in r]
    failed = sum(bool(r.get("failed")) for r in rejected)
    if rejected:
        how = ", ".join(part for part in (f"{len(rejected) - failed} rejected by the server" if failed < len(rejected)
                                          else "", f"{failed} failed" if failed else "") if part)
        if len(rejected) == len(rows):
            raise AmaliaError(f"task {task.name}: no item could be scored ({how}), e.g. item {rejected[0]['id']}: "
                              f"{rejected[0]['rejected']}")
        log.warning(f"task {task.name}: {len(rejected)} of {len(rows)} items left out of the scores ({how}; in the "
                    f"result's items), e.g. item {rejected[0]['id']}: {rejected[0]['rejected']}")
    metrics = metrics_of(task)
    scores = summarize(rows, metrics)
    if task.format in CHOICE_FORMATS:
        scored = [it for it, r in zip(items, rows) if "rejected" not in r]
        scores["chance"] = sum(1 / len(it.choices) for it in scored) / len(scored)
    if any("invalid" in r for r in rows):
        scores["invalid"] = sum(bool(r.get("invalid")) for r in rows)
    result = {"task": task.name, "format": task.format, "method": task.scoring, "model": model, "base_url": base_url,
              "task_path": str(task_path), "wall_time_s": time.perf_counter() - t0, "scores": scores,
              "n": len(rows) - len(rejected), "rejected": len(rejected), "failed": failed, "usage": usage}
    if any("subject" in it.meta for it in items):  # PHEB's exams, EuroEval's datasets that have the column
        result["by_subject"] = by_group(rows, "subject", metrics)
    if task.format == "judge":
        result["judge"] = settings.judge.model
    result["items"] = rows
    if contamination_of:
        result = with_contamination(result, seen, metrics, contamination_of)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_json(output, result)
    return result
