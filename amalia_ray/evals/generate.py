"""Tasks scored on what the model generates (greedy unless the task sets a temperature; seeded): multiple choice
with the answer extracted from the text (a letter, `\\boxed{…}`, or the choice itself), cloze / last-word exact
match, and the pt-PT vs pt-BR variety of generations (P3B3-style) with the variety scorer the data stage curates
with. (Exact answers, sampled n times: sampled.py.)"""

from __future__ import annotations

import re

from amalia_ray.core.judge import final_answer
from amalia_ray.core.openai_client import OpenAIClient, generate
from amalia_ray.core.variety import score_variety
from amalia_ray.core.variety_model import label_texts
from amalia_ray.evals.tasks import LETTERS, PUNCTUATION, ClozeItem, MCItem, PromptItem, lettered_options

MC_TEMPLATE = "Pergunta: {question}\n{options}\nResponda apenas com a letra da opção correta.\nResposta:"


def mc_prompt(item: MCItem, fmt: str = "mcq") -> str:
    """The question with lettered options and the instruction to answer with a letter; for EuroEval's items,
    EuroEval's Portuguese instruction prompt (the question shows its options); for PHEB items, the prompt
    of PHEB's own evaluation script (`evaluate_mcq_instruct.py`, its letter_only format): "Pergunta:" on a line of
    its own, "A) …" options, then its instruction."""
    if item.labels:
        return EUROEVAL_INSTRUCTION.format(text=item.question.replace("\n", " ").strip(),
                                           labels=_letters([f"'{label}'" for label in item.labels]))
    if fmt == "pheb":
        options = "".join(f"{LETTERS[i]}) {c}\n" for i, c in enumerate(item.choices))
        return f"Pergunta:\n{item.question}\n{options}" + PHEB_INSTRUCTION.format(
            letters=_letters(LETTERS[:len(item.choices)]))
    return MC_TEMPLATE.format(question=item.question, options=lettered_options(item.choices))


PHEB_INSTRUCTION = ("Escolha a opção correta para a pergunta acima. Responda apenas com a letra da opção correta "
                    "({letters}). Não inclua nenhum outro texto.")


# EuroEval's Portuguese instruction for instruction-tuned models
EUROEVAL_INSTRUCTION = "Pergunta: {text}\n\nResponde à pergunta acima usando só {labels}, e nada mais."


def _letters(labels) -> str:
    """"A, B, C ou D" for four labels."""
    return ", ".join(labels[:-1]) + f" ou {labels[-1]}"


def extract_choice(text: str, choices: list[str]) -> int | None:
    """The chosen option in a generation, most explicit form first; None when it names none (or several)."""
    valid = LETTERS[:len(choices)]
    # each run of white space made one space or newline (in one linear pass), so the patterns' adjacent \s* cannot
    # make a long run quadratic
    text = re.sub(r"\s+", lambda run: "\n" if "\n" in run.group() else " ", final_answer(text))
    patterns = (
        r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}",  # \boxed{B}
        r"(?i:resposta|answer|op[çc][ãa]o|alternativa)(?:\s+(?i:correta|certa|final))?\s*(?:[:=]|(?i:é|is))?\s*"
        r"\(?([A-Z])\)?(?![\w])",  # Resposta: B / a resposta correta é (B)
        r"^\s*\(?([A-Za-z])(?:\s*[).:\-]|\s*$)",  # B / (b) / B. at the start of a line (not the article "A")
    )
    for pattern in patterns:
        for m in re.finditer(pattern, text, flags=re.MULTILINE):
            letter = m.group(1).upper()
            if letter in valid:
                return valid.index(letter)
    letters = {m for m in re.findall(r"(?<![\w])([A-Z])(?![\w])", text) if m in valid}
    if len(letters) == 1:
        return valid.index(letters.pop())
    named = [i for i, c in enumerate(choices) if c.strip().lower() in text.lower()]
    return named[0] if len(named) == 1 else None


async def score_mc_generation(client: OpenAIClient, item: MCItem, *, max_tokens: int, chat: bool,
                              fmt: str = "mcq", **sampling) -> dict:
    text = await generate(client, mc_prompt(item, fmt), max_tokens=max_tokens, chat=chat, **sampling)
    pred = extract_choice(text, item.choices)
    return {"id": item.id, "answer": item.answer, "pred": pred, "generation": text,
            "acc": float(pred == item.answer), "invalid": pred is None, "meta": item.meta}


def first_word(text: str) -> str:
    words = final_answer(text).strip().split()
    return words[0].strip(PUNCTUATION) if words else ""


async def score_cloze(client: OpenAIClient, item: ClozeItem, *, max_tokens: int, chat: bool, **sampling) -> dict:
    text = await generate(client, item.context, max_tokens=max_tokens, chat=chat, **sampling)
    pred = first_word(text)
    return {"id": item.id, "target": item.target, "pred": pred, "generation": text,
            "exact_match": float(pred == item.target.strip(PUNCTUATION)), "meta": item.meta}


async def score_variety_of_generation(client: OpenAIClient, item: PromptItem, *, max_tokens: int,
                                      chat: bool, variety_model: str | None = None, variety_margin: float | None = None,
                                      **sampling) -> dict:
    """The generation's final answer labelled pt-PT / pt-BR / unknown by the variety model (or the cue scorer),
    with the cue counts beside it."""
    text = await generate(client, item.prompt, max_tokens=max_tokens, chat=chat, **sampling)
    answer = final_answer(text)
    score = score_variety(answer)
    (label,), (pt_pt,) = label_texts([answer], variety_model, variety_margin)
    return {"id": item.id, "generation": text, "label": label, "pt_pt_score": pt_pt,
            "pt_cues": score.pt_cues, "br_cues": score.br_cues, "pt_pt": float(label == "pt-PT"),
            "pt_br": float(label == "pt-BR"), "unknown": float(label == "unknown"), "meta": item.meta}
