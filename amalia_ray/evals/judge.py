"""Open generation graded by an LLM judge (ALBA-style, 1–5): the evaluated model answers, a served judge model reads
the question, the rubric, the reference answer when there is one, and the answer, and gives a score. A judge reply
without a readable score is kept in the items with `score: null` and counted, never guessed."""

from __future__ import annotations

import re

from amalia_ray.core.openai_client import OpenAIClient
from amalia_ray.evals.generate import final_answer, generate
from amalia_ray.evals.tasks import PromptItem

DEFAULT_RUBRIC = ("correção linguística em português europeu (ortografia, gramática, vocabulário), adequação e "
                  "coerência da resposta à pergunta")
JUDGE_TEMPLATE = (
    "És um avaliador rigoroso de respostas em português europeu.\n"
    "Critérios: {rubric}\n\n"
    "Pergunta: {prompt}\n"
    "{reference}"
    "Resposta a avaliar: {answer}\n\n"
    "Atribui uma nota inteira de 1 (muito má) a 5 (excelente) segundo os critérios. Responde na forma \"Nota: N\"."
)


def judge_prompt(item: PromptItem, answer: str, default_rubric: str = DEFAULT_RUBRIC) -> str:
    reference = f"Resposta de referência: {item.reference}\n" if item.reference else ""
    return JUDGE_TEMPLATE.format(rubric=item.rubric or default_rubric, prompt=item.prompt, reference=reference,
                                 answer=answer.strip() or "(resposta vazia)")


def parse_score(text: str) -> int | None:
    """The integer grade 1–5 in a judge's reply ("Nota: 4", "4/5", "Dou-lhe 4."); None for a non-integer grade, one
    out of range, or several candidates."""
    text = re.sub(r"(?i)\s*(?:/|de|em|out of)\s*5(?!\d)", "", text)
    if re.search(r"\d[.,]\d", text):
        return None
    m = re.search(r"(?i:nota|score|pontua[çc][ãa]o)\s*[:=]?\s*(\d+)", text)
    if m:
        return int(m.group(1)) if 1 <= int(m.group(1)) <= 5 else None
    alone = set(re.findall(r"(?<!\d)([1-5])(?!\d)", text))
    return int(alone.pop()) if len(alone) == 1 else None


async def score_judged(client: OpenAIClient, judge: OpenAIClient, item: PromptItem, *, max_tokens: int,
                       chat: bool, judge_chat: bool = True, rubric: str = DEFAULT_RUBRIC, **sampling) -> dict:
    answer = await generate(client, item.prompt, max_tokens=max_tokens, chat=chat, **sampling)
    verdict = await generate(judge, judge_prompt(item, final_answer(answer), rubric), max_tokens=32, chat=judge_chat)
    score = parse_score(final_answer(verdict))
    return {"id": item.id, "generation": answer, "judge_reply": verdict, "score": score,
            "invalid": score is None, "meta": item.meta}
