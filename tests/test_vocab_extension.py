"""Extending a base model's vocabulary (tokenizer.add_tokens): tokens learned from the corpus as BPE merges after
the base's, in byte-level (Llama 3, Qwen) and SentencePiece-style (Llama 2, Mistral, Gemma) tokenizers, or listed;
the embeddings and LM head grow under FSDP2 with each new row at the mean of the checkpoint's rows, tied weights
stay tied, and the export's tokenizer and config agree."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError

from amalia_ray.core.config import ModelConfig, TokenizerConfig
from amalia_ray.core.vocabulary import read_extension, write_extension
from amalia_ray.data.tokenize.vocab_extension import extend
from tests.base_models import FAQ, faq_paragraphs, family_tokenizer, make_base_model
from tests.conftest import free_port

pytestmark = pytest.mark.skipif(not FAQ.exists(), reason="debian-faq-pt not installed (make corpus)")


def sentencepiece_style_tokenizer(out: Path):
    """A Llama 2 / Mistral style tokenizer: spaces become ▁ in the normalizer, no pre-tokenizer, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")  # for training only
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens],
                                  show_progress=False)
    tok.train_from_iterator(faq_paragraphs(), trainer=trainer)
    tok.pre_tokenizer = None
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(str(out))
    return hf


def qwen_style_tokenizer(out: Path):
    """Byte-level, loaded through a tokenizer class that rebuilds its backend from vocabulary and merges and keeps
    its special token outside the BPE vocabulary (as Qwen's and Llama 3's are)."""
    family_tokenizer(out, "chatml")
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))


@pytest.mark.parametrize("style", ["byte_level", "qwen_class", "sentencepiece"])
def test_tokens_learned_from_the_corpus_shorten_it_and_keep_the_base_segmentation(tmp_path, style):
    from transformers import AutoTokenizer

    make = {"byte_level": lambda out: family_tokenizer(out, "llama"), "qwen_class": qwen_style_tokenizer,
            "sentencepiece": sentencepiece_style_tokenizer}[style]
    make(tmp_path / "base")
    base = AutoTokenizer.from_pretrained(str(tmp_path / "base"))
    paragraphs = faq_paragraphs()
    text = "\n\n".join(paragraphs[:300])
    extended, record = extend(AutoTokenizer.from_pretrained(str(tmp_path / "base")), 40, lambda: iter([paragraphs]))
    extended.save_pretrained(str(tmp_path / "extended"))
    extended = AutoTokenizer.from_pretrained(str(tmp_path / "extended"))  # as the next stage reads it

    assert len(record["added"]) == 40 and record["requested"] == 40
    assert len(extended) == len(base) + 40 and record["new_ids"] == list(range(len(base), len(base) + 40))
    before, after = base(text)["input_ids"], extended(text)["input_ids"]
    assert len(after) < 0.99 * len(before), "the learned tokens are frequent in the corpus"
    assert extended.decode(after) == base.decode(before) == text, "the same text, fewer tokens"
    assert {t: i for t, i in base.get_vocab().items()} == {t: i for t, i in extended.get_vocab().items()
                                                           if i not in record["new_ids"]}, "base ids unchanged"
    assert set(record["new_ids"]) & set(after), "new tokens are reachable by the tokenizer, not just listed"
    # a word with none of the new tokens keeps the base's tokens
    untouched = [w for w in ("xylophone", "kwzq") if not set(extended(w)["input_ids"]) & set(record["new_ids"])]
    assert all(extended(w)["input_ids"] == base(w)["input_ids"] for w in untouched) and untouched


def test_a_base_trained_on_the_same_corpus_still_gets_new_tokens(tmp_path):
    """Its vocabulary already holds the corpus's most frequent merges: learning goes further until n are new."""
    from transformers import AutoTokenizer

    family_tokenizer(tmp_path / "base", "llama", vocab_size=3000)
    base = AutoTokenizer.from_pretrained(str(tmp_path / "base"))
    extended, record = extend(base, 10, lambda: iter([faq_paragraphs()]))
    assert len(record["added"]) == 10 and len(extended) == 3010


def test_listed_tokens_are_added_once_and_known_ones_skipped(tmp_path):
    from transformers import AutoTokenizer

    family_tokenizer(tmp_path / "base", "chatml")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "base"))
    known = tok.convert_ids_to_tokens(100)
    extended, record = extend(tok, ["Saudade", "Lisboa-Porto", known], lambda: iter([]))
    assert record["added"] == ["Saudade", "Lisboa-Porto"] and record["new_ids"] == [len(extended) - 2,
                                                                                     len(extended) - 1]
    assert extended("Saudade")["input_ids"][-1] == record["new_ids"][0]


def test_add_tokens_is_validated_before_any_work():
    assert TokenizerConfig.model_validate({"from": "model", "add_tokens": 64}).add_tokens == 64
    for bad, says in [({"add_tokens": 64}, "extends a base model's tokenizer"),
                      ({"from": "model", "add_tokens": 0}, "greater than or equal to 1"),
                      ({"from": "model", "add_tokens": ["a", "b", "a"]}, "more than once: ['a']"),
                      ({"from": "model", "add_tokens": []}, "non-empty")]:
        with pytest.raises(ValidationError, match=re.escape(says)):
            TokenizerConfig.model_validate(bad)


def _grow_on_ranks(rank: int, world: int, port: int, cases: list[tuple[str, str]], out: str) -> None:
    """Each case's base model built for its extended tokenizer's vocabulary under FSDP2 on gloo ranks, loaded
    shard by shard with the new rows at the mean, then exported."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from amalia_ray.train.hf_weights import export_hf, stored_dtype
    from amalia_ray.train.model import build, config_from_dict
    from amalia_ray.train.parallel import apply_fsdp
    from amalia_ray.train.train_stage import hf_config_dict

    for base, tokenizer in ((Path(b), Path(t)) for b, t in cases):
        config = config_from_dict(hf_config_dict(ModelConfig.model_validate({"from": str(base)}), tokenizer, base))
        model = build(config, torch.device("cpu"), lambda m: apply_fsdp(m, "fp32", activation_checkpointing=False),
                      init_dir=base, seed=0, new_token_ids=read_extension(tokenizer)["new_ids"])
        export_hf(model, config, Path(out) / base.name, tokenizer, None, stored_dtype(base))
    dist.destroy_process_group()


def test_embeddings_grow_under_fsdp2_with_new_rows_at_the_mean_and_the_export_agrees(tmp_path):
    """qwen2 (untied; its embeddings padded past the tokenizer, as Qwen's are) and gemma2 (tied)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cases = []
    for family in ("qwen2", "gemma2"):
        base = make_base_model(tmp_path / family, family, dtype="float32")
        tokenizer = tmp_path / f"{family}-tokenizer"
        extended, record = extend(AutoTokenizer.from_pretrained(str(base)), 48, lambda: iter([faq_paragraphs()]))
        extended.save_pretrained(str(tokenizer))
        write_extension(tokenizer, record)
        cases.append((str(base), str(tokenizer)))
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_grow_on_ranks, args=(2, free_port(), cases, str(out)), nprocs=2)

    for base, tokenizer in ((Path(b), Path(t)) for b, t in cases):
        record, export = read_extension(tokenizer), out / base.name
        before = {k: v for f in sorted(base.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
        rows = before["model.embed_tokens.weight"].shape[0]
        new = torch.tensor(record["new_ids"])
        assert len(AutoTokenizer.from_pretrained(str(export))) == record["tokens"]
        assert json.loads((export / "config.json").read_text())["vocab_size"] == max(rows, record["tokens"])
        pairs = [(model.get_input_embeddings().weight, before["model.embed_tokens.weight"])]
        if model.config.tie_word_embeddings:
            assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
            assert "lm_head.weight" not in before
        else:
            pairs.append((model.get_output_embeddings().weight, before["lm_head.weight"]))
        for grown, stored in pairs:
            old = torch.ones(rows, dtype=torch.bool)
            old[new[new < rows]] = False
            assert torch.equal(grown[:rows][old], stored[old]), "the base's rows are kept exactly"
            mean = stored[old].double().mean(0).float()
            assert torch.allclose(grown[new], mean.expand(len(new), -1), atol=1e-6), base.name
        if base.name == "qwen2":
            assert (new < rows).any() and (new >= rows).any(), "the padded rows and rows past them both taken"
