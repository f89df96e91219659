"""Packed token shards and the training read position over them.

The pack stage writes Parquet rows of `input_ids` (fixed-size list of `seq_len` token ids), `doc_starts` (where each
document begins inside the sequence, for per-document position reset or attention masks) and `source`, in row groups
of a bounded size; every sequence holds documents of one source, so a mixture can be re-weighted at training time.

`PackedSplit` streams a split: opening it reads only the Parquet footers (and the `source` column of a row group
whose statistics do not already say it holds one source), and a batch reads just the row groups its rows lie in, a
few of them cached. What a worker holds is bounded by the row-group size, not by the split's.

`MixtureSampler` decides which sequences each optimizer step reads: sources are drawn by weights that a curriculum
may change with the number of training tokens seen. Each source is walked once per epoch in a seeded block shuffle
(the order of its row-group runs is permuted, then rows are permuted within windows of `SHUFFLE_WINDOW` runs), so
reads stay within a few row groups at a time. Its whole read position is a small JSON-able `state_dict()` stored
with every checkpoint, so a resumed run reads exactly the sequences the uninterrupted run would have read.
"""

from __future__ import annotations

import importlib
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq

# (tokens seen so far, source names) -> weight per source; the recipe's phases or a user hook
Schedule = Callable[[int, list[str]], dict[str, float]]

SHUFFLE_WINDOW = 4  # row-group runs of one source whose rows are shuffled together
ROW_GROUP_BYTES = 2 << 20  # token bytes per row group the pack stage writes: a worker caches a few of these


def micro_batches_per_rank(rows: int, micro: int, world: int) -> int:
    """How many micro-batches of at most `micro` rows every one of `world` workers runs for a step of `rows`."""
    return max(1, -(-rows // (micro * world)))


def fillers_per_step(rows: int, micro: int, world: int) -> int:
    """The filler passes a step of `rows` rows costs over `world` workers (0 when they divide it evenly): the
    micro-batch slots left without a row, each run on one real row whose loss is zeroed."""
    return max(0, micro_batches_per_rank(rows, micro, world) * world - rows)


def rows_per_group(seq_len: int) -> int:
    """Rows per Parquet row group for int32 sequences of `seq_len` tokens."""
    return max(1, ROW_GROUP_BYTES // (4 * seq_len))


def one_block(n: int) -> np.ndarray:
    """Rows 0..n-1 as one block: an in-memory dataset shuffled whole every epoch."""
    return np.array([[0, n]], dtype=np.int64)


class PackedSplit:
    """One split of packed sequences on disk (a folder of Parquet files), read a row group at a time."""

    def __init__(self, groups: list[tuple[Path, int]], offsets: np.ndarray, seq_len: int,
                 blocks: dict[str, np.ndarray], cache_groups: int | None = None):
        self.groups, self.offsets, self.seq_len, self.blocks = groups, offsets, seq_len, blocks
        self.cache_groups = cache_groups or SHUFFLE_WINDOW * max(1, len(blocks)) + 1
        self._cache: OrderedDict[int, tuple[np.ndarray, list]] = OrderedDict()

    @classmethod
    def read(cls, split_dir: Path, cache_groups: int | None = None) -> PackedSplit:
        files = sorted(split_dir.rglob("*.parquet")) if split_dir.exists() else []
        groups, sizes, runs, seq_len, start = [], [], {}, 0, 0
        for f in files:
            parquet = pq.ParquetFile(f)  # one footer read per file
            meta, names = parquet.metadata, parquet.schema_arrow.names
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                if not n:
                    continue
                for source, a, length in _source_runs(parquet, g, names):
                    runs.setdefault(source, []).append((start + a, length))
                groups.append((f, g))
                sizes.append(n)
                start += n
            if not seq_len and meta.num_rows:
                seq_len = parquet.schema_arrow.field("input_ids").type.list_size
        offsets = np.cumsum([0, *sizes], dtype=np.int64)
        blocks = {s: np.array(r, dtype=np.int64).reshape(-1, 2) for s, r in sorted(runs.items())}
        return cls(groups, offsets, seq_len, blocks, cache_groups)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def rows_by_source(self) -> dict[str, np.ndarray]:
        """Every row id of each source (for the validation split, which is read whole)."""
        return {s: np.concatenate([np.arange(a, a + n) for a, n in b]) for s, b in self.blocks.items()}

    def _group(self, g: int) -> tuple[np.ndarray, list]:
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        path, index = self.groups[g]
        pf = pq.ParquetFile(path)
        columns = [c for c in ("input_ids", "doc_starts") if c in pf.schema_arrow.names]
        table = pf.read_row_group(index, columns=columns)
        ids = table.column("input_ids").combine_chunks()
        tokens = ids.values.to_numpy(zero_copy_only=False).reshape(-1, ids.type.list_size)
        starts = table.column("doc_starts").to_pylist() if "doc_starts" in columns else [[0]] * len(table)
        self._cache[g] = (tokens, starts)
        while len(self._cache) > self.cache_groups:
            self._cache.popitem(last=False)
        return self._cache[g]

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
        """Tokens (len(rows), seq_len) int64 and the document starts of the given global row ids, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        tokens = np.empty((len(rows), self.seq_len), dtype=np.int64)
        starts: list[list[int]] = [[]] * len(rows)
        where = np.searchsorted(self.offsets, rows, side="right") - 1
        for g in np.unique(where):  # each row group once per batch
            group_tokens, group_starts = self._group(int(g))
            for i in np.flatnonzero(where == g):
                local = int(rows[i] - self.offsets[g])
                tokens[i] = group_tokens[local]
                starts[i] = group_starts[local]
        return tokens, starts


def document_positions(doc_starts: list[list[int]], length: int) -> np.ndarray:
    """Positions that restart at 0 where each document begins. transformers reads restarting positions as
    packed documents and masks attention across them (a block-diagonal causal mask)."""
    starts = np.zeros((len(doc_starts), length), dtype=bool)
    starts[:, 0] = True
    for i, row in enumerate(doc_starts):
        starts[i, [s for s in row if 0 <= s < length]] = True
    index = np.broadcast_to(np.arange(length), starts.shape)
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


def _source_runs(parquet: pq.ParquetFile, group: int, names: list[str]) -> list[tuple[str, int, int]]:
    """(source, first row, rows) runs of one row group: from the column statistics when they show a single source,
    else from that group's `source` column alone."""
    meta = parquet.metadata
    n = meta.row_group(group).num_rows
    if "source" not in names:
        return [("corpus", 0, n)]
    row_group = meta.row_group(group)  # leaf columns: a list column's index is not its arrow field's
    leaf = next(i for i in range(row_group.num_columns) if row_group.column(i).path_in_schema == "source")
    stats = row_group.column(leaf).statistics
    if stats is not None and stats.has_min_max and stats.min == stats.max and not stats.null_count:
        value = stats.min.decode() if isinstance(stats.min, bytes) else stats.min
        return [(value, 0, n)]
    column = parquet.read_row_group(group, columns=["source"]).column("source")
    encoded = column.combine_chunks().dictionary_encode()
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    edges = np.flatnonzero(np.diff(codes)) + 1
    firsts = np.concatenate([[0], edges])
    lengths = np.diff(np.concatenate([firsts, [n]]))
    values = encoded.dictionary.to_pylist()
    return [(str(values[codes[a]]), int(a), int(m)) for a, m in zip(firsts, lengths)]


def phase_schedule(phases: list[dict]) -> Schedule:
    """Piecewise-constant weights: each phase {until_tokens, weights} holds until that many training tokens
    (None: to the end); a source a phase does not name gets weight 0 in it."""

    def weights(tokens: int, sources: list[str]) -> dict[str, float]:
        for phase in phases:
            if phase.get("until_tokens") is None or tokens < phase["until_tokens"]:
                return {s: float(phase["weights"].get(s, 0.0)) for s in sources}
        return {s: float(phases[-1]["weights"].get(s, 0.0)) for s in sources}

    return weights


def load_hook(spec: str) -> Schedule:
    """'package.module:function' -> the function (called with tokens seen and the source names)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"curriculum hook '{spec}' must look like 'package.module:function'")
    return getattr(importlib.import_module(module), name)


class EpochOrder:
    """The order one source's rows are read in during one epoch: its blocks (runs of consecutive row ids, one row
    group or less each) in a seeded order, rows shuffled within each window of `SHUFFLE_WINDOW` blocks. Holds one
    window's rows at a time."""

    def __init__(self, blocks: np.ndarray, key: list[int]):
        order = blocks[np.random.default_rng(key).permutation(len(blocks))]
        self.key = key
        self.windows = [order[i:i + SHUFFLE_WINDOW] for i in range(0, len(order), SHUFFLE_WINDOW)]
        self.ends = np.cumsum([int(w[:, 1].sum()) for w in self.windows])
        self._current: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def __getitem__(self, k: int) -> int:
        w = int(np.searchsorted(self.ends, k, side="right"))
        if self._current[0] != w:
            rows = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in self.windows[w]])
            self._current = (w, rows[np.random.default_rng([*self.key, w]).permutation(len(rows))])
        return int(self._current[1][k - (int(self.ends[w - 1]) if w else 0)])


class MixtureSampler:
    """Global-batch row ids drawn by (scheduled) source weights from each source's blocks ((first row, count)
    pairs). Without a schedule every source is drawn in proportion to its number of sequences, i.e. uniformly over
    all sequences."""

    def __init__(self, blocks_by_source: dict[str, np.ndarray], seq_len: int, seed: int,
                 schedule: Schedule | None = None):
        self.blocks = {s: np.asarray(b, dtype=np.int64).reshape(-1, 2) for s, b in blocks_by_source.items()}
        self.sizes = {s: int(b[:, 1].sum()) for s, b in self.blocks.items()}
        if not any(self.sizes.values()):
            raise ValueError("no packed training sequences to sample from")
        self.names = sorted(self.blocks)
        self.seq_len, self.seed = seq_len, seed
        sizes = {s: float(n) for s, n in self.sizes.items()}
        self.schedule = schedule or (lambda tokens, names: sizes)
        self.tokens = 0
        self.cursors = {s: 0 for s in self.names}
        self._orders: dict[str, tuple[int, EpochOrder]] = {}

    def weights(self) -> np.ndarray:
        got = self.schedule(self.tokens, list(self.names))
        unknown = set(got) - set(self.names)
        if unknown:
            raise ValueError(f"curriculum weights name unknown source(s) {sorted(unknown)}; packed: {self.names}")
        w = np.array([max(0.0, float(got.get(s, 0.0))) for s in self.names])
        empty = [s for s, x in zip(self.names, w) if x > 0 and not self.sizes[s]]
        if empty:
            raise ValueError(f"curriculum weights source(s) {empty} with no packed sequences")
        if w.sum() <= 0:
            raise ValueError(f"curriculum gives every source weight 0 at {self.tokens} tokens")
        return w / w.sum()

    def _row(self, source: str) -> int:
        epoch, within = divmod(self.cursors[source], self.sizes[source])
        if self._orders.get(source, (None,))[0] != epoch:
            key = [self.seed, zlib.crc32(source.encode()), epoch]
            self._orders[source] = (epoch, EpochOrder(self.blocks[source], key))
        self.cursors[source] += 1
        return self._orders[source][1][within]

    def next_rows(self, n: int) -> np.ndarray:
        """The next global batch of n sequences; weights are evaluated once per batch."""
        probs = self.weights()
        draws = np.random.default_rng([self.seed, self.tokens]).choice(len(self.names), size=n, p=probs)
        out = np.array([self._row(self.names[i]) for i in draws], dtype=np.int64)
        self.tokens += n * self.seq_len
        return out

    def state_dict(self) -> dict:
        return {"tokens": self.tokens, "cursors": dict(self.cursors)}

    def load_state_dict(self, state: dict) -> None:
        if set(state["cursors"]) != set(self.names):
            raise ValueError(f"data read position is for sources {sorted(state['cursors'])}, packed data has "
                             f"{self.names}: the packed data changed since the checkpoint")
        self.tokens, self.cursors = int(state["tokens"]), {s: int(c) for s, c in state["cursors"].items()}
