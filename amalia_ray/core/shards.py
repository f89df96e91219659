"""Packed token shards and the training read position over them.

The pack stage writes Parquet rows of `input_ids` (fixed-size list of `seq_len` token ids), `doc_starts` (where each
document begins inside the sequence, for per-document position reset or attention masks) and `source`; every
sequence holds documents of one source, so a mixture can be re-weighted at training time.

`MixtureSampler` decides which sequences each optimizer step reads: sources are drawn by weights that a curriculum
may change with the number of training tokens seen, and each source is walked through a seeded permutation per
epoch. Its whole read position is a small JSON-able `state_dict()` stored with every checkpoint, so a resumed run
reads exactly the sequences the uninterrupted run would have read.
"""

from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow.parquet as pq

# (tokens seen so far, source names) -> weight per source; the recipe's phases or a user hook
Schedule = Callable[[int, list[str]], dict[str, float]]


@dataclass
class PackedSplit:
    tokens: np.ndarray  # (sequences, seq_len) int64
    sources: np.ndarray  # (sequences,) source name of each sequence
    doc_starts: list[list[int]]

    @classmethod
    def read(cls, split_dir: Path) -> PackedSplit:
        files = sorted(split_dir.rglob("*.parquet")) if split_dir.exists() else []
        tokens, sources, starts = [], [], []
        for f in files:
            table = pq.read_table(f)
            column = table.column("input_ids").combine_chunks()
            tokens.append(column.values.to_numpy(zero_copy_only=False).reshape(-1, column.type.list_size))
            sources += (table.column("source").to_pylist() if "source" in table.column_names
                        else ["corpus"] * len(table))
            starts += (table.column("doc_starts").to_pylist() if "doc_starts" in table.column_names
                       else [[0]] * len(table))
        if not tokens:
            return cls(np.zeros((0, 0), np.int64), np.array([], dtype=object), [])
        return cls(np.concatenate(tokens).astype(np.int64), np.array(sources, dtype=object), starts)

    def position_ids(self, rows: np.ndarray) -> np.ndarray:
        """Positions that restart at 0 where each document begins. transformers reads restarting positions as
        packed documents and masks attention across them (a block-diagonal causal mask)."""
        length = self.tokens.shape[1]
        starts = np.zeros((len(rows), length), dtype=bool)
        starts[:, 0] = True
        for i, row in enumerate(rows):
            starts[i, [s for s in self.doc_starts[row] if 0 <= s < length]] = True
        index = np.broadcast_to(np.arange(length), starts.shape)
        return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)

    def rows_by_source(self) -> dict[str, np.ndarray]:
        return {s: np.flatnonzero(self.sources == s) for s in sorted(set(self.sources.tolist()))}


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


class MixtureSampler:
    """Global-batch row indices into a PackedSplit, drawn by (scheduled) source weights. Without a schedule every
    source is drawn in proportion to its number of sequences, i.e. uniformly over all sequences."""

    def __init__(self, rows_by_source: dict[str, np.ndarray], seq_len: int, seed: int,
                 schedule: Schedule | None = None):
        if not rows_by_source or not any(len(r) for r in rows_by_source.values()):
            raise ValueError("no packed training sequences to sample from")
        self.rows = rows_by_source
        self.names = sorted(rows_by_source)
        self.seq_len, self.seed = seq_len, seed
        sizes = {s: float(len(r)) for s, r in rows_by_source.items()}
        self.schedule = schedule or (lambda tokens, names: sizes)
        self.tokens = 0
        self.cursors = {s: 0 for s in self.names}
        self._perms: dict[tuple[str, int], np.ndarray] = {}

    def weights(self) -> np.ndarray:
        got = self.schedule(self.tokens, list(self.names))
        unknown = set(got) - set(self.names)
        if unknown:
            raise ValueError(f"curriculum weights name unknown source(s) {sorted(unknown)}; packed: {self.names}")
        w = np.array([max(0.0, float(got.get(s, 0.0))) for s in self.names])
        empty = [s for s, x in zip(self.names, w) if x > 0 and not len(self.rows[s])]
        if empty:
            raise ValueError(f"curriculum weights source(s) {empty} with no packed sequences")
        if w.sum() <= 0:
            raise ValueError(f"curriculum gives every source weight 0 at {self.tokens} tokens")
        return w / w.sum()

    def _row(self, source: str) -> int:
        rows = self.rows[source]
        epoch, within = divmod(self.cursors[source], len(rows))
        key = (source, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != source}
            self._perms[key] = np.random.default_rng([self.seed, zlib.crc32(source.encode()), epoch]).permutation(
                len(rows))
        self.cursors[source] += 1
        return int(rows[self._perms[key][within]])

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
