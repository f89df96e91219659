"""An LLM judge (ALBA-style, 1–5), one implementation for the evaluation's judge tasks and the judge rewards of
GRPO and on-policy DPO: a served model reads the question, the rubric, the reference answer when there is one, and
the answer, and replies with a grade; a reply without a readable grade is None, never guessed."""

from __future__ import annotations

import re

from amalia_ray.core.openai_client import OpenAIClient, complete_n

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
# what of a judge's reply is parsed: a grade is asked for in a few tokens; the regexes below are quadratic in the
# worst case, and a reply (an external judge's) may be megabytes
REPLY_PARSED = 1024


def final_answer(text: str) -> str:
    """The part of a generation that gives the answer, for reasoning models (DeepSeek-R1's format, which our GRPO
    stage rewards): inside the last `<answer>…</answer>`, else what follows `</think>`; a reasoning block that never
    closed (the generation ran out of tokens mid-thought) gives no answer. Other text is the answer as it is."""
    tagged, at = None, 0
    while (start := text.find("<answer>", at)) >= 0 and (end := text.find("</answer>", start + 8)) >= 0:
        tagged, at = text[start + 8:end], end + 9  # the pairs a left-to-right scan closes, as a lazy regex would
    if tagged is not None:
        return tagged
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    return "" if "<think>" in text else text


def judge_prompt(question: str, answer: str, rubric: str | None = None, reference: str | None = None) -> str:
    """What the judge is asked: the rubric (default DEFAULT_RUBRIC), the question, the reference answer when there
    is one, and the answer."""
    return JUDGE_TEMPLATE.format(rubric=rubric or DEFAULT_RUBRIC, prompt=question,
                                 reference=f"Resposta de referência: {reference}\n" if reference else "",
                                 answer=answer.strip() or "(resposta vazia)")


def parse_score(text: str, cut_short: bool = False) -> int | None:
    """The integer grade 1–5 in a judge's reply: after "Nota:" (or score, pontuação; markdown around it allowed),
    else a grade alone on the reply's first line ("4", then the reasons) or one that ends the reply ("4/5",
    "Dou-lhe 4."); None for a non-integer grade, one out of range, two different named grades, or a digit elsewhere
    ("tem 2 erros…": a count, not a grade). A reply `cut_short` (at max_tokens) counts only with its "Nota:" or
    its first line: what ends it is where it was cut. Of a longer reply, its first and last `REPLY_PARSED`
    characters."""
    if len(text) > 2 * REPLY_PARSED:
        text = f"{text[:REPLY_PARSED]}\n{text[-REPLY_PARSED:]}"
    text = re.sub(r"(?i)\s*(?:/|de|em|out of)\s*5(?!\d)", "", text)
    if re.search(r"\d[.,]\d", text):
        return None
    named = re.findall(r"(?i:nota|score|pontua[çc][ãa]o)[*_\s]*[:=]?[*_\s]*(\d+)", text)
    if named:
        return int(named[0]) if len(set(named)) == 1 and 1 <= int(named[0]) <= 5 else None
    if first := re.match(r"[\W_]*([1-5])[*_.)\s]*?(?:\n|\Z)", text):
        return int(first.group(1))
    if cut_short:
        return None
    last = re.search(r"(?<![\d.,])([1-5])\W*\Z", text)
    return int(last.group(1)) if last and len(set(re.findall(r"(?<!\d)([1-5])(?!\d)", text))) == 1 else None


async def grade(judge: OpenAIClient, question: str, answer: str, *, rubric: str | None = None,
                reference: str | None = None, chat: bool = True, max_tokens: int = 32) -> tuple[int | None, str]:
    """The judge's grade of `answer` (its final answer: `final_answer`) to `question`, and its reply."""
    ((reply, finish),) = await complete_n(judge, judge_prompt(question, final_answer(answer), rubric, reference), n=1,
                                          max_tokens=max_tokens, chat=chat)
    return parse_score(final_answer(reply), cut_short=finish == "length"), reply
