"""Open generation graded by an LLM judge (ALBA-style, 1–5; core/judge.py): the evaluated model answers, a served
judge model grades the answer. A judge reply without a readable score is kept in the items with `score: null` and
counted, never guessed."""

from __future__ import annotations

from amalia_ray.core.judge import DEFAULT_RUBRIC, grade
from amalia_ray.core.openai_client import OpenAIClient, generate
from amalia_ray.evals.tasks import PromptItem


async def score_judged(client: OpenAIClient, judge: OpenAIClient, item: PromptItem, *, max_tokens: int,
                       chat: bool, judge_chat: bool = True, judge_max_tokens: int = 32, rubric: str = DEFAULT_RUBRIC,
                       **sampling) -> dict:
    answer = await generate(client, item.prompt, max_tokens=max_tokens, chat=chat, **sampling)
    score, verdict = await grade(judge, item.prompt, answer, rubric=item.rubric or rubric, reference=item.reference,
                                 chat=judge_chat, max_tokens=judge_max_tokens)
    return {"id": item.id, "generation": answer, "judge_reply": verdict, "score": score,
            "invalid": score is None, "meta": item.meta}
