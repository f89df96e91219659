"""MinHash signatures and LSH banding over Arrow batches (FineWeb / datatrove conventions).

Text is simplified (lower case, punctuation dropped, whitespace folded), cut into word n-gram shingles, each shingle
hashed to 32 bits; `num_perm` universal hash functions h(x) = (a·x + b) mod (2^31 − 1) give the signature. Two
documents with Jaccard similarity J agree on one signature value with probability J, and share at least one of
`bands` bands of `rows` values with probability 1 − (1 − J^rows)^bands.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

_PRIME = np.uint64((1 << 31) - 1)
_NON_WORD = re.compile(r"[^\w\s]+")


@dataclass(frozen=True)
class MinHashParams:
    ngram: int = 5
    num_perm: int = 112
    bands: int = 14
    seed: int = 1

    def __post_init__(self):
        if self.num_perm % self.bands:
            raise ValueError(f"num_perm {self.num_perm} is not a multiple of bands {self.bands}")

    @property
    def rows(self) -> int:
        return self.num_perm // self.bands

    def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        a = rng.integers(1, int(_PRIME), size=self.num_perm, dtype=np.uint64)
        b = rng.integers(0, int(_PRIME), size=self.num_perm, dtype=np.uint64)
        return a, b


def simplify(text: str) -> str:
    text = unicodedata.normalize("NFC", text).lower()
    return " ".join(_NON_WORD.sub(" ", text).split())


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    words = simplify(text).split()
    if len(words) < ngram:
        grams = [" ".join(words)]
    else:
        grams = [" ".join(words[i:i + ngram]) for i in range(len(words) - ngram + 1)]
    digest = b"".join(hashlib.blake2b(g.encode(), digest_size=4).digest() for g in set(grams))
    return np.frombuffer(digest, dtype="<u4").astype(np.uint64) % _PRIME


def signature(hashes: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # values < 2^31 and a < 2^31, so a·x + b < 2^62 never overflows uint64
    return ((hashes[:, None] * a[None, :] + b[None, :]) % _PRIME).min(axis=0).astype(np.uint32)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    return float(np.mean(sig_a == sig_b))


class Signatures:
    """Arrow batch with `id`, `text` -> `id`, `signature` (fixed-size list of num_perm uint32)."""

    def __init__(self, params: MinHashParams):
        self.params = params
        self.a, self.b = params.coefficients()

    def __call__(self, batch: pa.Table) -> pa.Table:
        sigs = np.stack([signature(shingle_hashes(t or "", self.params.ngram), self.a, self.b)
                         for t in batch["text"].to_pylist()]) if len(batch) else np.zeros((0, self.params.num_perm),
                                                                                              np.uint32)
        return pa.table({
            "id": batch["id"],
            "signature": pa.FixedSizeListArray.from_arrays(pa.array(sigs.reshape(-1), pa.uint32()),
                                                           self.params.num_perm),
        })


class BandKeys:
    """Arrow batch of signatures -> one row per (document, band): `band`, `key` (64-bit hash of the band's rows)."""

    def __init__(self, params: MinHashParams):
        self.params = params

    def __call__(self, batch: pa.Table) -> pa.Table:
        n, r = len(batch), self.params.rows
        sigs = batch["signature"].combine_chunks().values.to_numpy().reshape(n, self.params.num_perm)
        keys = np.empty((n, self.params.bands), dtype=np.int64)
        for i in range(n):
            for band in range(self.params.bands):
                digest = hashlib.blake2b(sigs[i, band * r:(band + 1) * r].tobytes(), digest_size=8).digest()
                keys[i, band] = int.from_bytes(digest, "little", signed=True)
        ids = np.repeat(np.asarray(batch["id"].to_pylist(), dtype=object), self.params.bands)
        return pa.table({
            "band": pa.array(np.tile(np.arange(self.params.bands, dtype=np.int16), n)),
            "key": pa.array(keys.reshape(-1)),
            "id": pa.array(ids, pa.string()),
            "signature": pa.FixedSizeListArray.from_arrays(
                pa.array(np.repeat(sigs, self.params.bands, axis=0).reshape(-1), pa.uint32()), self.params.num_perm),
        })


def bucket_edges(threshold: float | None):
    """A bucket (same band, same key) -> star edges from its smallest id to every other member, optionally kept
    only when the members' signatures estimate a Jaccard similarity >= threshold."""

    def edges(group: pa.Table) -> pa.Table:
        ids = group["id"].to_pylist()
        if len(ids) < 2:
            return pa.table({"src": pa.array([], pa.string()), "dst": pa.array([], pa.string())})
        sigs = group["signature"].combine_chunks().values.to_numpy().reshape(len(ids), -1)
        root = min(range(len(ids)), key=ids.__getitem__)
        src, dst = [], []
        for i, doc in enumerate(ids):
            if i != root and doc != ids[root] and (
                threshold is None or estimated_jaccard(sigs[root], sigs[i]) >= threshold
            ):
                src.append(ids[root])
                dst.append(doc)
        return pa.table({"src": pa.array(src, pa.string()), "dst": pa.array(dst, pa.string())})

    return edges
