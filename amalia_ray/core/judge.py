"""An LLM judge (ALBA-style, 1–5), one implementation for the evaluation's judge tasks and the judge rewards of
GRPO and on-policy DPO: a served model reads the question, the rubric, the reference answer when there is one, and
the answer, and replies with a grade; a reply without a readable grade is None, never guessed."""

from __future__ import annotations

import re

from amalia_ray.core.openai_client import OpenAIClient, generate

# the project's pt-PT rubric: fluency, correctness, and the European variety (what AMALIA's post-training aims at)
DEFAULT_RUBRIC = ("fluência e correção linguística em português europeu (ortografia, gramática, vocabulário e "
                  "construções da variedade europeia, não do português do Brasil); correção, adequação e coerência "
                  "da resposta à pergunta")
JUDGE_TEMPLATE = (
    "És um avaliador rigoroso de respostas em português europeu.\n"
    "Critérios: {rubric}\n\n"
    "Pergunta: {prompt}\n"
    "{reference}"
    "Resposta a avaliar: {answer}\n\n"
    "Atribui uma nota inteira de 1 (muito má) a 5 (excelente) segundo os critérios. Responde na forma \"Nota: N\"."
)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def final_answer(text: str) -> str:
    """The part of a generation that gives the answer, for reasoning models (DeepSeek-R1's format, which our GRPO
    stage rewards): inside the last `<answer>…</answer>`, else what follows `</think>`; a reasoning block that never
    closed (the generation ran out of tokens mid-thought) gives no answer. Other text is the answer as it is."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    return "" if "<think>" in text else text


def judge_prompt(question: str, answer: str, rubric: str | None = None, reference: str | None = None) -> str:
    """What the judge is asked: the rubric (default DEFAULT_RUBRIC), the question, the reference answer when there
    is one, and the answer."""
    return JUDGE_TEMPLATE.format(rubric=rubric or DEFAULT_RUBRIC, prompt=question,
                                 reference=f"Resposta de referência: {reference}\n" if reference else "",
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


async def grade(judge: OpenAIClient, question: str, answer: str, *, rubric: str | None = None,
                reference: str | None = None, chat: bool = True, max_tokens: int = 32) -> tuple[int | None, str]:
    """The judge's grade of `answer` (its final answer: `final_answer`) to `question`, and its reply."""
    reply = await generate(judge, judge_prompt(question, final_answer(answer), rubric, reference),
                           max_tokens=max_tokens, chat=chat)
    return parse_score(final_answer(reply)), reply
