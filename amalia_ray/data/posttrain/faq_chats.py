"""Conversations for supervised fine-tuning made from real question-and-answer text: a FAQ's numbered questions
(`1.2. O que é Debian GNU/Linux?`) become user turns and the text under each becomes the assistant's answer."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

from amalia_ray.core.formats.conversations import write_conversations

_HEADING = re.compile(r"^\d+(?:\.\d+)*\.\s+\S")
_QUESTION = re.compile(r"^(\d+(?:\.\d+)+)\.\s+(.*)$")


def faq_conversations(text: str, max_answer_chars: int = 1200) -> list[dict]:
    """Every numbered question with a non-empty answer -> {"id", "messages": [user, assistant]}. A long answer keeps
    its first paragraphs up to `max_answer_chars` (at least one paragraph)."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        match = _QUESTION.match(lines[i])
        if not match:
            i += 1
            continue
        number, question = match.group(1), [match.group(2).strip()]
        i += 1
        while i < len(lines) and lines[i].strip() and not _HEADING.match(lines[i]):
            question.append(lines[i].strip())  # a wrapped title
            i += 1
        body = []
        while i < len(lines) and not _HEADING.match(lines[i]):
            body.append(lines[i])
            i += 1
        answer = _first_paragraphs(body, max_answer_chars)
        if answer:
            out.append({"id": f"faq-{number}", "messages": [{"role": "user", "content": " ".join(question)},
                                                            {"role": "assistant", "content": answer}]})
    return out


def _first_paragraphs(body: list[str], limit: int) -> str:
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", "\n".join(body)) if p.strip()]
    kept: list[str] = []
    for p in paragraphs:
        if kept and len("\n\n".join([*kept, p])) > limit:
            break
        kept.append(p)
    return "\n\n".join(kept)


def write_faq_conversations(source: Path, output: Path, max_answer_chars: int = 1200) -> int:
    text = (gzip.open(source, "rt", encoding="utf-8") if source.suffix == ".gz" else source.open(encoding="utf-8")).read()
    return write_conversations(faq_conversations(text, max_answer_chars), output)


def mismatched_answer_pairs(conversations: list[dict], seed: int = 0) -> list[dict]:
    """DPO pairs from question-answer conversations, made by code from real text: for each question, the chosen
    answer is its own and the rejected one is the answer to another question (a seeded derangement; never a
    text-identical answer). Teaches "answer the question that was asked". TRL's conversational format."""
    import random

    usable = [c for c in conversations if len(c["messages"]) >= 2 and c["messages"][-1]["role"] == "assistant"]
    if len(usable) < 2:
        raise ValueError(f"need at least two conversations ending in an assistant turn, got {len(usable)}")
    order = list(range(len(usable)))
    random.Random(seed).shuffle(order)
    pairs = []
    for k, i in enumerate(order):
        chosen = usable[i]["messages"][-1]
        # the next conversation in the shuffled cycle whose answer differs from this one's
        for step in range(1, len(order)):
            rejected = usable[order[(k + step) % len(order)]]["messages"][-1]
            if rejected["content"] != chosen["content"]:
                break
        else:
            continue
        pairs.append({"id": f"{usable[i].get('id', i)}-pair", "prompt": usable[i]["messages"][:-1],
                      "chosen": [chosen], "rejected": [{"role": "assistant", "content": rejected["content"]}]})
    return sorted(pairs, key=lambda p: p["id"])

