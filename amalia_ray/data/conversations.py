"""Conversations for supervised fine-tuning made from real question-and-answer text: a FAQ's numbered questions
(`1.2. O que é Debian GNU/Linux?`) become user turns and the text under each becomes the assistant's answer."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

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
    conversations = faq_conversations(text, max_answer_chars)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as f:
        for c in conversations:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    return len(conversations)
