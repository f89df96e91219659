"""MinHash signatures and LSH band keys, vectorized over whole Arrow batches.

Text is simplified as datatrove simplifies it (lower case, every number written 0, diacritics dropped, everything but
letters and digits a space, whitespace folded: copies that differ in accents, dates or counts still match) and cut
into word n-gram shingles; a shingle's 64-bit hash combines its words' hashes position by position. The `num_perm` hash
functions are multiply-add-shift hashes h(x) = (a·x + b mod 2^64) >> 32, a universal family that needs no modulo: two
documents with Jaccard similarity J agree on one signature value with probability ≈ J, and share at least one of
`bands` bands of `rows` values with probability 1 − (1 − J^rows)^bands.

Everything runs on whole batches (pyarrow string kernels, polars' seeded word hash, numpy) instead of a Python loop
per shingle; that is where the speed against datatrove comes from. Hashes are deterministic for a given seed and
installed polars version.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

_U64 = np.uint64
_NOT_WORD = r"[^\pL\pN\pM_\t\n\f\r ]+"  # ASCII white space only, as split below; spacing marks stay in words
_NUMBER = r"\p{Nd}+([.,،٫⎖⎗⎘]\p{Nd}+)?"  # digits of any script, with a decimal part (datatrove's pattern)


@dataclass(frozen=True)
class MinHashParams:
    ngram: int = 5
    num_perm: int = 112
    bands: int = 14
    seed: int = 1

    def __post_init__(self):
        if self.ngram < 1 or self.num_perm < 1 or self.bands < 1:
            raise ValueError(f"ngram, num_perm and bands must be positive: {self}")
        if self.num_perm % self.bands:
            raise ValueError(f"num_perm {self.num_perm} is not a multiple of bands {self.bands}")

    @property
    def rows(self) -> int:
        return self.num_perm // self.bands

    def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(self.seed)
        a = rng.integers(0, 2**63, size=self.num_perm, dtype=np.uint64) * _U64(2) + _U64(1)  # odd multipliers
        b = rng.integers(0, 2**63, size=self.num_perm, dtype=np.uint64)
        return a, b

    def position_multipliers(self, n: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 7])
        return rng.integers(0, 2**63, size=n, dtype=np.uint64) * _U64(2) + _U64(1)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads every input bit over the output."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def simplify(texts: pa.Array) -> pa.Array:
    """datatrove's TextNormConfig defaults: lower case, numbers → 0, diacritics dropped (NFD less its nonspacing
    marks, so precomposed and decomposed accents agree; spacing marks, as in Devanagari, stay), punctuation and
    symbols → spaces, whitespace folded."""
    lowered = pl.Series(pc.utf8_lower(pc.fill_null(texts, "")))
    # polars' regex engine runs these replacements in about half the time of pyarrow's (RE2)
    kept = (lowered.str.replace_all(_NUMBER, "0").str.normalize("NFD").str.replace_all(r"\p{Mn}+", "")
            .str.replace_all(_NOT_WORD, " ").to_arrow())
    if kept.type not in (pa.string(), pa.large_string()):  # a string view, from some polars versions
        kept = kept.cast(pa.large_string())
    return pc.utf8_trim_whitespace(kept)


def words(texts: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Flattened words of every text and the number of words per text."""
    simple = simplify(texts)
    lists = pc.ascii_split_whitespace(simple)  # simplify() left only ASCII spaces
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    flat = lists.flatten()
    counts = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    empty = pc.equal(pc.utf8_length(simple), 0).to_numpy(zero_copy_only=False)
    if empty.any():  # an empty text splits into one empty word
        flat = flat.filter(pc.not_equal(pc.utf8_length(flat), 0))
        counts[empty] = 0
    return flat, counts


@dataclass
class Shingles:
    """Shingle hashes of a batch of texts, grouped by text: `hashes[offsets[i]:offsets[i+1]]` is text i's, in text
    order (a repeated shingle appears again: sets are taken where needed)."""

    hashes: np.ndarray
    offsets: np.ndarray

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def to_arrow(self) -> pa.Array:
        return pa.LargeListArray.from_arrays(pa.array(self.offsets), pa.array(self.hashes, pa.uint64()))


def shingles(texts: pa.Array, params: MinHashParams) -> Shingles:
    """Word n-grams (a text shorter than n words is one shingle; an empty text has none)."""
    flat, counts = words(texts)
    k = params.ngram
    total = int(counts.sum())
    word_hash = pl.Series(flat).hash(seed=params.seed).to_numpy().astype(np.uint64) if total else np.zeros(0, _U64)
    ends = np.cumsum(counts)
    starts = ends - counts
    per_doc = np.where(counts >= k, counts - k + 1, np.minimum(counts, 1))  # a short text is one shingle
    offsets = np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)
    # word positions that start a shingle: all but a text's last k-1 words (a short text: its first word only),
    # marked with +1/-1 at the bounds of the excluded runs and a running sum
    bounds = np.zeros(total + 1, np.int8)
    last = np.where(counts >= k, ends - (k - 1), np.minimum(starts + 1, ends))
    np.add.at(bounds, last, 1)
    np.add.at(bounds, ends, -1)
    pos = np.flatnonzero(np.cumsum(bounds[:total]) == 0)
    padded = np.concatenate([word_hash, np.zeros(k, _U64)])
    mult = params.position_multipliers(k)
    # the n-gram starting at every word position, on contiguous slices (n-grams that cross a text end are not used)
    grams = padded[:total] * mult[0]
    for j in range(1, k):
        grams += padded[j:j + total] * mult[j]
    hashes = grams[pos]
    short = np.flatnonzero((counts < k) & (counts > 0))
    for j in range(1, k):  # a short text's shingle stops at its end
        cut = short[counts[short] <= j]
        hashes[offsets[cut]] -= padded[starts[cut] + j] * mult[j]
    return Shingles(mix64(hashes), offsets)


def signatures(sh: Shingles, a: np.ndarray, b: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """(texts, num_perm) uint32 minimum hash values; a text without shingles gets all 0xFFFFFFFF. Texts are taken
    in runs of about `chunk` shingles so that all permutations of a run are computed while it sits in cache."""
    counts = sh.counts()
    out = np.full((len(counts), len(a)), np.iinfo(np.uint32).max, dtype=np.uint32)
    bounds = np.unique(np.concatenate([
        [0], np.searchsorted(sh.offsets, np.arange(0, sh.offsets[-1] + chunk, chunk)), [len(counts)]]))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rows = np.arange(lo, hi)[counts[lo:hi] > 0]
        if not len(rows):
            continue
        first = sh.offsets[lo]
        x = sh.hashes[first:sh.offsets[hi]]
        seg = sh.offsets[rows] - first
        v = np.empty(len(x), _U64)
        for j in range(len(a)):
            np.multiply(x, a[j], out=v)
            v += b[j]
            out[rows, j] = np.minimum.reduceat(v, seg) >> _U64(32)  # the shift is monotonic: shift the minimum only
    return out


def band_keys(sigs: np.ndarray, params: MinHashParams) -> np.ndarray:
    """(texts, bands) int64: one hash of each band's `rows` signature values (band number mixed in)."""
    n = len(sigs)
    per_band = sigs.reshape(n, params.bands, params.rows).astype(_U64)
    acc = np.zeros((n, params.bands), _U64)
    for r, m in enumerate(params.position_multipliers(params.rows)):
        acc += per_band[:, :, r] * m
    acc += np.arange(params.bands, dtype=_U64) * _U64(0x9E3779B97F4A7C15)
    return mix64(acc).view(np.int64)


class ShingleSets:
    """Arrow batch with `id`, `text` -> `id`, `values` (the shingle hashes as large_list<uint64>, for exact
    Jaccard)."""

    def __init__(self, params: MinHashParams):
        self.params = params

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch["text"].combine_chunks() if len(batch) else pa.array([], pa.string())
        return pa.table({"id": batch["id"], "values": shingles(texts, self.params).to_arrow()})


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    return float(np.mean(sig_a == sig_b))


class SignatureSets:
    """Arrow batch with `id`, `text` -> `id`, `values` (the MinHash signature as large_list<uint64>): what an
    estimated-Jaccard check needs of a document, `num_perm` numbers whatever its length."""

    def __init__(self, params: MinHashParams):
        self.params = params
        self.a, self.b = params.coefficients()

    def __call__(self, batch: pa.Table) -> pa.Table:
        sh = shingles(batch["text"].combine_chunks() if len(batch) else pa.array([], pa.string()), self.params)
        sigs = signatures(sh, self.a, self.b).astype(np.uint64)
        offsets = pa.array(np.arange(0, sigs.size + 1, max(1, sigs.shape[1]), dtype=np.int64)[:len(sigs) + 1])
        return pa.table({"id": batch["id"], "values": pa.LargeListArray.from_arrays(offsets, pa.array(sigs.ravel()))})


def pair_jaccard(a: pa.Array, b: pa.Array, similarity: str) -> np.ndarray:
    """Row-wise Jaccard of two list<uint64> columns: `exact` over the shingle sets, `estimated` as the share of equal
    positions of two signatures."""
    if similarity == "exact":
        return exact_jaccard(a, b)
    left = np.asarray(pa.array(a).flatten().to_numpy(zero_copy_only=False)).reshape(len(a), -1)
    right = np.asarray(pa.array(b).flatten().to_numpy(zero_copy_only=False)).reshape(len(b), -1)
    return (left == right).mean(axis=1) if left.size else np.ones(len(a))


def exact_jaccard(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Row-wise Jaccard similarity of the sets of two list<uint64> shingle columns (two empty sets: 1.0)."""
    df = pl.DataFrame({"a": pl.from_arrow(a), "b": pl.from_arrow(b)})
    inter = df.select(pl.col("a").list.set_intersection("b").list.len()).to_series().to_numpy().astype(np.float64)
    union = df["a"].list.n_unique().to_numpy() + df["b"].list.n_unique().to_numpy() - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


class BandKeys:
    """Arrow batch with `id`, `text` -> `id` and one `key_<band>` int64 column per LSH band."""

    def __init__(self, params: MinHashParams):
        self.params = params
        self.a, self.b = params.coefficients()

    def __call__(self, batch: pa.Table) -> pa.Table:
        sh = shingles(batch["text"].combine_chunks() if len(batch) else pa.array([], pa.string()), self.params)
        keys = band_keys(signatures(sh, self.a, self.b), self.params)
        cols = {"id": batch["id"]}
        cols.update({f"key_{band}": pa.array(keys[:, band]) for band in range(self.params.bands)})
        return pa.table(cols)
