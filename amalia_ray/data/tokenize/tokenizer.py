"""The run's tokenizer as HF files (with a chat template): a byte-level BPE trained with `tokenizers`, or a base
model's own tokenizer kept as it is."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from amalia_ray.core.config import TokenizerConfig
from amalia_ray.core.vocabulary import write_extension
from amalia_ray.data.steps.base import unit_hash
from amalia_ray.data.tokenize.vocab_extension import extend

BOS, EOS, PAD = "<|bos|>", "<|endoftext|>", "<|pad|>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *CHAT_TOKENS]


def iter_texts(parquet_dir: Path, max_bytes: int | None = None, batch_size: int = 1024) -> Iterator[list[str]]:
    """The corpus's texts in batches; with `max_bytes`, those of a sample of its row groups: taken in the order of a
    hash of their file and place (the same sample at every run, drawn from across the corpus) until about that
    much text, one at least, sized from the files' footers, so a corpus of any size costs the reading of the sample
    only."""
    groups = []
    for path in sorted(parquet_dir.rglob("*.parquet")):
        meta = pq.ParquetFile(path).metadata
        column = meta.schema.names.index("text")
        groups += [(path, i, meta.row_group(i).column(column).total_uncompressed_size)
                   for i in range(meta.num_row_groups)]
    if max_bytes is not None and sum(size for _, _, size in groups) > max_bytes:
        drawn, taken = [], 0
        for path, i, size in sorted(groups, key=lambda g: unit_hash(f"{g[0].relative_to(parquet_dir)}:{g[1]}")):
            if drawn and taken + size > max_bytes:
                continue  # a smaller group further on may still fit
            drawn.append((path, i, size))
            taken += size
        groups = sorted(drawn, key=lambda g: (g[0], g[1]))  # read in file order
    for path, i, _ in groups:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size, row_groups=[i], columns=["text"]):
            yield batch.column("text").to_pylist()


def train_tokenizer(corpus_dir: Path, out_dir: Path, cfg: TokenizerConfig) -> dict:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(corpus_dir, cfg.train_bytes), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=CHAT_TOKENS,
        model_max_length=1_000_000,
    )
    hf.chat_template = cfg.chat_template
    hf.save_pretrained(str(out_dir))
    return {"vocab_size": tok.get_vocab_size()}


def base_tokenizer(model_dir: Path, out_dir: Path, cfg: TokenizerConfig, trust_remote_code: bool = False,
                   corpus_dir: Path | None = None) -> dict:
    """The base model's tokenizer files and chat template, unchanged unless the recipe extends the vocabulary
    (tokenizer.add_tokens, learned from `corpus_dir` or listed); the recipe's chat_template replaces the base's only
    when the recipe sets one, or when the base has none (base models often ship without)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if "chat_template" in cfg.model_fields_set or not tok.chat_template:
        tok.chat_template = cfg.chat_template
    extension = None
    if cfg.add_tokens is not None:
        tok, extension = extend(tok, cfg.add_tokens, lambda: iter_texts(corpus_dir, cfg.train_bytes))
        if len(extension["added"]) < extension["requested"]:
            logging.getLogger("amalia_ray.data").warning(
                f"tokenizer.add_tokens: {len(extension['added'])} of {extension['requested']} tokens added (the "
                "others are in the base vocabulary already, or the corpus has no more merges it lacks)")
    tok.save_pretrained(str(out_dir))
    if extension:
        write_extension(out_dir, extension)
    return {"vocab_size": len(tok), "from": str(model_dir), "chat_template": "recipe" if tok.chat_template ==
            cfg.chat_template else "base model",
            **({"tokens_added": len(extension["added"]), "tokens_requested": extension["requested"]}
               if extension else {})}
