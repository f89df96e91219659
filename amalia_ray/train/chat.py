"""Chat data for supervised fine-tuning: conversations rendered with the tokenizer's own chat template, a loss mask
that keeps assistant tokens only, and best-fit-decreasing packing into fixed-length rows.

The mask comes from the template itself: the assistant turn i spans from the end of the render of messages[:i] with
the generation prompt to the end of the render of messages[:i+1]; tokens whose characters start inside such a span
are trained on (the answer and its end-of-turn marker), everything else (system, user, role headers) is not.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass
class Encoded:
    ids: list[int]
    train: list[bool]  # whether the token is a target (an assistant token)


def encode_conversation(tok, messages: list[dict]) -> Encoded:
    if not messages or any(set(m) < {"role", "content"} for m in messages):
        raise ValueError("a conversation is a non-empty list of {role, content} messages")
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)) if i else 0
        upto = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        if not full.startswith(upto):
            raise ValueError("the chat template does not render conversations prefix by prefix; cannot mask turns")
        spans.append((start, len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in enc["offset_mapping"]]
    train = [any(a <= s < b for a, b in spans) for s in starts]
    return Encoded(list(enc["input_ids"]), train)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Item indices per bin: longest first, each into the fullest bin it still fits (a new bin when none)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    bins: list[list[int]] = []
    for i in order:
        size = lengths[i]
        if size > capacity:
            raise ValueError(f"item of length {size} exceeds the bin capacity {capacity}")
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - size, len(bins) - 1))
        else:
            remaining, b = free.pop(at)
            bins[b].append(i)
            bisect.insort(free, (remaining - size, b))
    return bins


@dataclass
class PackedChats:
    input_ids: np.ndarray  # (rows, seq_len)
    labels: np.ndarray  # (rows, seq_len): the token where it is a target, -100 elsewhere (HF convention)
    position_ids: np.ndarray  # restart at every conversation (and padding): attention stays within one
    lengths: np.ndarray  # (rows,): tokens of conversations in each row, the rest is padding


def pack_conversations(encoded: list[Encoded], seq_len: int, pad_id: int) -> PackedChats:
    """Conversations longer than seq_len are cut to it (their tail is lost, counted by the caller if needed)."""
    items = [Encoded(e.ids[:seq_len], e.train[:seq_len]) for e in encoded if any(e.train[:seq_len])]
    bins = best_fit_decreasing([len(e.ids) for e in items], seq_len)
    ids = np.full((len(bins), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(bins), seq_len), -100, dtype=np.int64)
    positions = np.zeros((len(bins), seq_len), dtype=np.int64)
    lengths = np.zeros(len(bins), dtype=np.int64)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            e = items[i]
            n = len(e.ids)
            ids[row, at:at + n] = e.ids
            labels[row, at:at + n] = np.where(e.train, e.ids, -100)
            positions[row, at:at + n] = np.arange(n)
            at += n
        positions[row, at:] = np.arange(seq_len - at)
        lengths[row] = at
    return PackedChats(ids, labels, positions, lengths)
