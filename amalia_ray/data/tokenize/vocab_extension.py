"""Extending a base model's vocabulary. A given list of tokens is added as whole tokens; N tokens learned from the
corpus are added as new BPE merges ranked after all of the base's, so text keeps the base's segmentation except
where a new merge joins two of its pieces (what vocabulary-extension work on Llama and Mistral tokenizers does).
The record of which ids are new goes beside the tokenizer (core.vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator

from amalia_ray.core.errors import AmaliaError

WORD_START = "▁"  # SentencePiece-style tokenizers mark a word's start with it (in the normalizer)


def extend(tok, add_tokens: int | list[str], texts: Callable[[], Iterator[list[str]]]):
    """`tok` (a transformers fast tokenizer) with `add_tokens` more tokens; returns (tokenizer, record)."""
    base_len = len(tok)
    if isinstance(add_tokens, list):
        known = tok.get_vocab()
        added = readable = [t for t in add_tokens if t not in known]
        tok.add_tokens(added)
    else:
        tok, added, readable = _with_learned_merges(tok, add_tokens, texts)
    return tok, {"base_tokens": base_len, "tokens": len(tok), "new_ids": tok.convert_tokens_to_ids(added),
                 "added": readable, "requested": add_tokens if isinstance(add_tokens, int) else len(add_tokens)}


def _with_learned_merges(tok, n: int, texts: Callable[[], Iterator[list[str]]]):
    from tokenizers import Tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise AmaliaError(f"tokenizer.add_tokens: {n} learns BPE merges from the corpus, but the base model's "
                          f"tokenizer is {model.get('type')}; give the tokens to add as a list instead")
    vocab: dict[str, int] = model["vocab"]
    # tokenizers gives an added token missing from the model's vocabulary the id after the model's last; special
    # tokens (Llama 3's, Qwen's) sit there, so they enter the vocabulary at their ids before new tokens follow them
    for added_token in spec.get("added_tokens", []):
        vocab.setdefault(added_token["content"], added_token["id"])
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise AmaliaError("tokenizer.add_tokens: the base model's token ids are not contiguous, so learned tokens "
                          "have no free ids; give the tokens to add as a list instead")
    base_merges = _pairs(model["merges"])
    byte_level = _byte_level(spec)
    # the corpus's most frequent merges are mostly the base's own (all of them when the base was trained on text
    # like it): learn more merges until n are new, the corpus has no more, or the learner's vocabulary is the
    # base's size plus a margin
    budget, most = 8 * n + 2000, len(vocab) + 8 * n + 2000
    while True:
        learned, exhausted = _corpus_merges(tok.backend_tokenizer, byte_level, budget, texts)
        merged_vocab, merges, added = _new_merges(learned, dict(vocab), list(base_merges), n)
        if len(added) == n or exhausted or budget >= most:
            break
        budget = min(2 * budget, most)
    vocab.update(merged_vocab)
    model["merges"] = [list(m) for m in merges]
    tok._tokenizer = Tokenizer.from_str(json.dumps(spec))
    # as text: byte-level tokens decode through the tokenizer, SentencePiece-style ones by their ▁
    readable = tok.convert_tokens_to_string if byte_level else (lambda ts: ts[0].replace(WORD_START, " "))
    return tok, added, [readable([t]) for t in added]


def _new_merges(learned: Iterable[tuple[str, str]], vocab: dict[str, int], merges: list[tuple[str, str]], n: int):
    """Up to n of the learned merges whose token the vocabulary lacks, each appended to `merges` as the two pieces
    the base (and the merges added so far) segment its token into — so it is reachable, not just listed."""
    ranks = {pair: i for i, pair in enumerate(merges)}
    added: list[str] = []
    for a, b in learned:
        token = a + b
        if token in vocab:
            continue
        pieces = _segment(token, vocab, ranks)
        if pieces is None or len(pieces) != 2:
            continue
        ranks[tuple(pieces)] = len(merges)
        merges.append(tuple(pieces))
        vocab[token] = len(vocab)
        added.append(token)
        if len(added) == n:
            break
    return vocab, merges, added


def _corpus_merges(base, byte_level: bool, budget: int, texts: Callable[[], Iterator[list[str]]]
                   ) -> tuple[list, bool]:
    """The merges a BPE of `budget` tokens trained on the corpus with the base's normalizer and pre-tokenizer
    learns, most frequent first: the candidates for new tokens. True when the corpus had fewer to give."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.normalizer = base.normalizer
    # without a pre-tokenizer (SentencePiece style: spaces become ▁ in the normalizer) words start at ▁
    learner.pre_tokenizer = base.pre_tokenizer or pre_tokenizers.Split(WORD_START, behavior="merged_with_next")
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + budget, min_frequency=2, show_progress=False,
                                  initial_alphabet=alphabet)
    learner.train_from_iterator(texts(), trainer=trainer)
    merges = _pairs(json.loads(learner.to_str())["model"]["merges"])
    return merges, learner.get_vocab_size() < len(alphabet) + budget


def _pairs(merges: list) -> list[tuple[str, str]]:
    """tokenizer.json's merges, written as "a b" strings (older files) or [a, b] lists."""
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _byte_level(spec: dict) -> bool:
    return "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))


def _segment(word: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[str] | None:
    """BPE applied to one pre-tokenized word: the lowest-ranked merge first, until none applies. None when a
    character is not in the vocabulary (the base would fall back to bytes there)."""
    pieces = list(word)
    if any(p not in vocab for p in pieces):
        return None
    while len(pieces) > 1:
        pair = min(zip(pieces, pieces[1:]), key=lambda p: ranks.get(p, len(ranks) + 1))
        if pair not in ranks:
            break
        i = next(i for i in range(len(pieces) - 1) if (pieces[i], pieces[i + 1]) == pair)
        pieces[i:i + 2] = [pair[0] + pair[1]]
    return pieces
