"""Word n-gram overlap between training text and benchmark items (decontamination): the rule of GPT-3 and lm-eval's
decontamination docs. Text is lower-cased (after NFKC), split into runs of letters and digits (punctuation gone), and
every n consecutive words hashed to a stable 64-bit number; an item's n-grams go into an `ItemIndex` that any worker
can hold, and a document's n-grams are looked up in it. Shared by the data stage (drop or flag documents) and the
eval stage (which items a run trained on)."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)
_PRIME = np.uint64(0x100000001B3)


def words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def _word_hashes(tokens: list[str]) -> np.ndarray:
    # blake2b per distinct word: stable across processes and versions, unlike hash() or a library's seeded hash
    table = {w: int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") for w in set(tokens)}
    return np.fromiter((table[w] for w in tokens), dtype=np.uint64, count=len(tokens))


def ngram_hashes(tokens: list[str], n: int) -> np.ndarray:
    """The distinct hashes of every run of n consecutive words (none when there are fewer than n)."""
    if len(tokens) < n:
        return np.empty(0, np.uint64)
    h = _word_hashes(tokens)
    count = len(tokens) - n + 1
    acc = np.zeros(count, np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64
        for i in range(n):
            acc = acc * _PRIME + h[i:i + count]
    return np.unique(acc)


@dataclass
class ItemIndex:
    """The n-grams of a set of benchmark items: `hashes` sorted, `owners[i]` the item whose n-gram `hashes[i]` is
    (an n-gram of several items appears once per item); `items` are (task, item id) pairs."""
    hashes: np.ndarray
    owners: np.ndarray
    items: list[tuple[str, str]]
    n: int
    too_short: dict[str, int]  # task -> items with too few words to check
    short_lengths: frozenset[int] = frozenset()  # word counts of the items shorter than n

    @classmethod
    def build(cls, tasks: dict[str, list[tuple[str, str]]], n: int, min_item_words: int) -> ItemIndex:
        """tasks: name -> [(item id, item text)]. An item shorter than n words counts as one n-gram of all its
        words (it matches only where it appears whole); one shorter than `min_item_words` is not checked."""
        hashes, owners, items, short, lengths = [], [], [], {}, set()
        for task, entries in tasks.items():
            short[task] = 0
            for item_id, text in entries:
                tokens = words(text)
                if len(tokens) < min(n, min_item_words):
                    short[task] += 1
                    continue
                grams = ngram_hashes(tokens, min(n, len(tokens)))
                if len(tokens) < n:
                    lengths.add(len(tokens))
                hashes.append(grams)
                owners.append(np.full(len(grams), len(items), np.int64))
                items.append((task, item_id))
        hashes_arr = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
        owners_arr = np.concatenate(owners) if owners else np.empty(0, np.int64)
        order = np.argsort(hashes_arr, kind="stable")
        return cls(hashes_arr[order], owners_arr[order], items, n, short, frozenset(lengths))

    def overlaps(self, text: str, min_overlap: int) -> list[int]:
        """The items (indices into `items`) that share at least `min_overlap` distinct n-grams with `text` (an item
        shorter than n words: itself, whole)."""
        if not len(self.hashes):
            return []
        tokens = words(text)
        grams = [ngram_hashes(tokens, k) for k in sorted({self.n, *self.short_lengths})]
        doc = np.unique(np.concatenate(grams)) if len(grams) > 1 else grams[0]
        lo = np.searchsorted(self.hashes, doc, "left")
        hi = np.searchsorted(self.hashes, doc, "right")  # lo < hi: the document's n-gram is some item's
        if not (hit := hi > lo).any():
            return []
        owners = np.concatenate([self.owners[a:b] for a, b in zip(lo[hit], hi[hit])])
        ids, counts = np.unique(owners, return_counts=True)
        return ids[counts >= min_overlap].tolist()
