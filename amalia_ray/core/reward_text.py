"""The tokens a reward model scores: one answer to one prompt rendered the way TRL's RewardTrainer renders each side
of a preference pair. The reward stage trains on this rendering and a served reward model scores with it, so a
completion is read the same way in both."""

from __future__ import annotations

from amalia_ray.core.formats.jsonl import is_messages


def reward_input_ids(tok, prompt, answer) -> list[int]:
    """Conversations (messages) go through the chat template, the whole exchange and no generation prompt; a plain
    string answer to a conversational prompt is the assistant's turn. Text is prompt + answer + EOS (unless the
    answer ends with it), with the tokenizer's special tokens. `prompt` None: the answer holds the whole
    conversation or text (TRL's implicit prompt)."""
    if is_messages(prompt) or is_messages(answer):
        turns = answer if is_messages(answer) else [{"role": "assistant", "content": answer}]
        rendered = tok.apply_chat_template([*(prompt or []), *turns], tokenize=True, return_dict=True)
        return list(rendered["input_ids"])
    eos = tok.eos_token or ""
    return list(tok((prompt or "") + (answer if answer.endswith(eos) else answer + eos))["input_ids"])
