"""Tokenizer training and packing on a small real text (the Debian FAQ when installed, else a built-in paragraph)."""

import gzip
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from amalia_ray.core.config import TokenizerConfig
from amalia_ray.data.tokenize.pack import TokenizeAndPack
from amalia_ray.data.tokenize.tokenizer import CHAT_TOKENS, EOS, train_tokenizer

FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    if not FAQ.exists():
        pytest.skip("debian-faq-pt not installed (make corpus)")
    paragraphs = [p for p in gzip.open(FAQ, "rt", encoding="utf-8").read().split("\n\n") if p.strip()]
    corpus = tmp_path_factory.mktemp("corpus")
    pq.write_table(pa.table({"text": paragraphs}), corpus / "part.parquet")
    out = tmp_path_factory.mktemp("tok")
    stats = train_tokenizer(corpus, out, TokenizerConfig(vocab_size=1000))
    assert stats["vocab_size"] == 1000
    return out


def test_hf_tokenizer_round_trips_and_has_chat_template(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = "A instalação do sistema Debian é simples: ação, coração, pôr."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == EOS and all(t in tok.get_vocab() for t in CHAT_TOKENS)
    chat = tok.apply_chat_template([{"role": "user", "content": "Olá"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nOlá<|end|>\n<|assistant|>\n"


def test_pack_makes_fixed_length_rows_with_document_starts(tokenizer_dir):
    docs = pa.table({"text": ["primeiro documento " * 20, "segundo " * 50, "terceiro"]})
    out = TokenizeAndPack(str(tokenizer_dir), seq_len=16)(docs)
    rows = out["input_ids"].to_pylist()
    assert len(rows) >= 3 and all(len(r) == 16 for r in rows)
    assert out["doc_starts"].to_pylist()[0][0] == 0
    assert set(out["source"].to_pylist()) == {"corpus"}


def test_pack_keeps_every_sequence_within_one_source(tokenizer_dir):
    docs = pa.table({"text": ["livro " * 40, "web " * 40, "livro dois " * 20], "source": ["books", "web", "books"]})
    out = TokenizeAndPack(str(tokenizer_dir), seq_len=16)(docs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for ids, source in zip(out["input_ids"].to_pylist(), out["source"].to_pylist()):
        words = set(tok.decode(ids).split())
        assert ("web" in words) == (source == "web") and ("livro" in words) == (source == "books")


@pytest.mark.parametrize("family", ["ours", "llama", "qwen3", "gemma3_text", "mistral"])
def test_the_packing_actors_tokenize_as_transformers_does(tokenizer_dir, tmp_path, family):
    """The actors encode with the tokenizers backend the driver took from transformers' tokenizer: the same ids as
    transformers' own call on text with special tokens, accents and odd spacing — for our trained tokenizer and the
    test base models' own (each family's)."""
    from transformers import AutoTokenizer

    from amalia_ray.data.tokenize.pack import tokenizer_for_workers
    from tests.base_models import make_base_model

    folder = tokenizer_dir if family == "ours" else make_base_model(tmp_path / family, family)
    tok = AutoTokenizer.from_pretrained(str(folder))
    texts = ["A instalação  do Debian\té simples:\n\n ação, coração, pôr.", f"fim{tok.eos_token} e depois",
             "  espaços   no início", "<|user|>\nOlá<|end|>", "ＦＵＬＬ width ﬁ ligature", ""]
    spec = tokenizer_for_workers(str(folder))
    assert "json" in spec, "a fast tokenizer reaches the actors without transformers"
    packer = TokenizeAndPack(spec, seq_len=8)
    assert packer.encode(texts) == tok(texts, add_special_tokens=False)["input_ids"]
    assert packer.eos == tok.eos_token_id


def test_the_tokenizer_learns_from_a_sample_of_a_large_corpus_the_same_at_every_run(tmp_path):
    """tokenizer.train_bytes bounds what BPE is trained on: row groups taken in the order of a hash of their place
    until about that many bytes, one at least (sized from the footers, so only the sample is read), the same at
    every run; all of it below the budget or with none."""
    from amalia_ray.data.tokenize.tokenizer import iter_texts

    kept = tmp_path / "kept"
    kept.mkdir()
    for f in range(8):  # 8 files × 10 row groups × 100 texts of 100 bytes: 800 KB of text
        texts = [f"f{f} t{i:05d} " + "x" * (100 - len(f"f{f} t{i:05d} ")) for i in range(1000)]
        pq.write_table(pa.table({"id": [str(i) for i in range(1000)], "text": texts}), kept / f"part-{f}.parquet",
                       row_group_size=100)
    every = sum(len(t) for batch in iter_texts(kept) for t in batch)
    assert every == 800_000 and sum(len(t) for b in iter_texts(kept, 10**9) for t in b) == every
    sample = [t for batch in iter_texts(kept, 100_000) for t in batch]
    assert 80_000 <= sum(map(len, sample)) <= 100_000, "whole row groups, up to the budget"
    assert len([t for batch in iter_texts(kept, 10) for t in batch]) == 100, "one row group at least"
    assert sample == [t for batch in iter_texts(kept, 100_000) for t in batch], "the same sample every run"
    assert len({t.split()[0] for t in sample}) > 1, "drawn from across the files"
    stats = train_tokenizer(kept, tmp_path / "tok", TokenizerConfig(vocab_size=300, train_bytes=100_000))
    assert stats["vocab_size"] <= 300


def test_pack_streams_the_corpus_without_holding_it_in_the_object_store(ray_cluster, tokenizer_dir, tmp_path,
                                                                           monkeypatch):
    """At 1 TB the corpus cannot sit in the object store, nor can its tokens: each split is read as it is packed and
    its rows staged to Parquet as they come (neither Dataset.materialize nor to_arrow_refs is called), and the
    staging files are gone after. (The same output run after run: test_faults.py.)"""
    import ray

    from amalia_ray.core.config import PackConfig
    from amalia_ray.data.curate import pack

    paragraphs = [p for p in gzip.open(FAQ, "rt", encoding="utf-8").read().split("\n\n") if p.strip()]
    (tmp_path / "corpus" / "kept").mkdir(parents=True)
    pq.write_table(pa.table({"id": [f"faq/{i}" for i in range(len(paragraphs))], "source": ["faq"] * len(paragraphs),
                             "text": paragraphs}), tmp_path / "corpus" / "kept" / "part-000000.parquet")

    def refused(*args, **kwargs):
        raise AssertionError("the corpus or its packed rows gathered in the object store")

    monkeypatch.setattr(ray.data.Dataset, "materialize", refused)
    monkeypatch.setattr(ray.data.Dataset, "to_arrow_refs", refused)
    stats = pack(tmp_path / "corpus", tokenizer_dir, tmp_path / "out", PackConfig(seq_len=64), {"faq": 1.0}, 0)
    assert stats["train_sequences"] > 100 and stats["validation_sequences"] > 0
    written = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*"))
    assert written == ["train", "train/part-000000.parquet", "validation", "validation/part-000000.parquet"]
    assert pq.read_table(tmp_path / "out" / "train").num_rows == stats["train_sequences"]
