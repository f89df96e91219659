"""Tokenize documents and pack them into fixed-length sequences (Ray Data actors, one tokenizer per actor)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def tokenizer_for_workers(tokenizer_dir: str) -> dict:
    """What each packing actor rebuilds its tokenizer from: the Rust `tokenizers` backend that transformers' own
    tokenizer for the folder encodes with (as JSON, with the one setting transformers applies per call), so an actor
    needs only the `tokenizers` library — importing transformers costs each new actor 5–10 s of CPU. A tokenizer
    without such a backend (SentencePiece in Python) is loaded by transformers in each actor."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    spec = {"folder": str(tokenizer_dir), "eos_token_id": tok.eos_token_id}
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec |= {"json": backend.to_str(), "split_special_tokens": bool(getattr(tok, "split_special_tokens", False))}
    return spec


class TokenizeAndPack:
    """Arrow batch of documents -> rows of exactly `seq_len` token ids, `doc_starts` and `source`.

    Documents of one source are joined with EOS and cut into sequences, so every sequence belongs to one source and
    training can re-weight sources (core/formats/shards.py); the tail shorter than `seq_len` at the end of each batch and
    source is dropped (at most one sequence per batch and source). `doc_starts` keeps where each document begins
    inside a sequence, for objectives that reset positions or mask attention across documents.
    """

    def __init__(self, tokenizer: dict | str, seq_len: int):
        spec = tokenizer if isinstance(tokenizer, dict) else tokenizer_for_workers(tokenizer)
        if "json" in spec:
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(spec["json"])
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = spec["split_special_tokens"]
            self.encode = lambda texts: [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(spec["folder"])
            self.encode = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]
        self.seq_len = seq_len
        self.eos = spec["eos_token_id"]

    def __call__(self, batch: pa.Table) -> pa.Table:
        sources = batch["source"].to_pylist() if "source" in batch.column_names else ["corpus"] * len(batch)
        parts = []
        for source in sorted(set(sources)):
            rows = batch.filter(pa.array([s == source for s in sources]))
            packed = self.pack(rows["text"].to_pylist())
            parts.append(packed.append_column("source", pa.array([source] * len(packed), pa.string())))
        return pa.concat_tables(parts) if parts else self.pack([]).append_column("source", pa.array([], pa.string()))

    def pack(self, texts: list[str]) -> pa.Table:
        encoded = self.encode(texts) if texts else []
        stream, starts = [], []
        for ids in encoded:
            starts.append(len(stream))
            stream.extend(ids)
            stream.append(self.eos)
        n = len(stream) // self.seq_len
        tokens = np.asarray(stream[: n * self.seq_len], dtype=np.int32).reshape(n, self.seq_len)
        starts_arr = np.asarray(starts, dtype=np.int64)
        doc_starts = [
            (starts_arr[(starts_arr >= i * self.seq_len) & (starts_arr < (i + 1) * self.seq_len)] - i * self.seq_len)
            .astype(np.int32)
            .tolist()
            for i in range(n)
        ]
        return pa.table(
            {
                "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), self.seq_len),
                "doc_starts": pa.array(doc_starts, pa.list_(pa.int32())),
            }
        )
