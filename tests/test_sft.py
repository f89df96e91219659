"""SFT: assistant-only loss mask from the chat template, best-fit-decreasing packing, loss parity with transformers,
and conversations made from the Debian FAQ."""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from amalia_ray.core.config import TokenizerConfig
from amalia_ray.data.posttrain.faq_chats import faq_conversations
from amalia_ray.data.tokenize.tokenizer import train_tokenizer
from amalia_ray.train.chat import best_fit_decreasing, encode_conversation
from amalia_ray.train.objectives.sft import SFT

FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")


@pytest.fixture(scope="module")
def faq_text():
    if not FAQ.exists():
        pytest.skip("debian-faq-pt not installed (make corpus)")
    return gzip.open(FAQ, "rt", encoding="utf-8").read()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, faq_text):
    from transformers import AutoTokenizer

    corpus = tmp_path_factory.mktemp("corpus")
    pq.write_table(pa.table({"text": faq_text.split("\n\n")}), corpus / "part.parquet")
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(corpus, out, TokenizerConfig(vocab_size=1000))
    return AutoTokenizer.from_pretrained(str(out)), out


def test_faq_becomes_question_answer_conversations(faq_text):
    conversations = faq_conversations(faq_text)
    assert len(conversations) >= 100
    first = conversations[0]
    assert first["id"] == "faq-1.1" and first["messages"][0] == {"role": "user", "content": "O que é esta FAQ?"}
    assert first["messages"][1]["content"].startswith("Este documento dá as perguntas feitas frequentemente")
    assert all(len(c["messages"][1]["content"]) <= 1200 or "\n\n" not in c["messages"][1]["content"]
               for c in conversations)


def test_only_assistant_turns_are_targets(tokenizer):
    tok, _ = tokenizer
    messages = [{"role": "system", "content": "Responde em português europeu."},
                {"role": "user", "content": "Olá?"}, {"role": "assistant", "content": "Bom dia."},
                {"role": "user", "content": "E depois?"}, {"role": "assistant", "content": "Até logo."}]
    enc = encode_conversation(tok, messages)
    targets = tok.decode([i for i, t in zip(enc.ids, enc.train) if t])
    assert targets == "Bom dia.<|end|>\nAté logo.<|end|>\n"
    assert tok.decode(enc.ids) == tok.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize(("style", "targets"), [
    ("llama", "Bom dia.<|eot_id|>Até logo.<|eot_id|>"), ("chatml", "Bom dia.<|im_end|>\nAté logo.<|im_end|>\n"),
    ("mistral", "Bom dia.<eos>Até logo.<eos>"), ("gemma", "Bom dia.<end_of_turn>\nAté logo.<end_of_turn>\n")])
def test_each_base_model_family_template_trains_on_its_answers_only(tmp_path, faq_text, style, targets):
    """A base model's own chat template (Llama 3 headers, ChatML, [INST], Gemma turns): the targets are each answer
    and the token that ends its turn, and the rendered ids are the template's own text. (Ray Train runs SFT on a
    Llama and a Gemma 3 base in test_e2e_base_models.py.)"""
    from tests.base_models import family_tokenizer

    tok = family_tokenizer(tmp_path, style)
    messages = [{"role": "user", "content": "Olá?"}, {"role": "assistant", "content": "Bom dia."},
                {"role": "user", "content": "E depois?"}, {"role": "assistant", "content": "Até logo."}]
    enc = encode_conversation(tok, messages)
    assert tok.decode([i for i, t in zip(enc.ids, enc.train) if t]) == targets
    assert tok.decode(enc.ids) == tok.apply_chat_template(messages, tokenize=False)


def test_best_fit_decreasing_packs_tightly():
    bins = best_fit_decreasing([7, 5, 4, 3, 2, 1], capacity=8)
    sizes = sorted(sum([7, 5, 4, 3, 2, 1][i] for i in b) for b in bins)
    assert sizes == [6, 8, 8] and sorted(i for b in bins for i in b) == list(range(6))
    with pytest.raises(ValueError, match="exceeds"):
        best_fit_decreasing([9], capacity=8)


def test_sft_loss_equals_transformers_loss(tokenizer, faq_text, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok, tok_dir = tokenizer
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in faq_conversations(faq_text)[:40]))
    sft = SFT(data, tok_dir, seq_len=256, validation_fraction=0.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=256))
    batch = sft.batch(np.arange(min(4, len(sft.train.input_ids))))
    with torch.no_grad():
        loss_sum, ntok = sft.loss(model, batch)
        reference = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                          use_cache=False).loss
    assert ntok == int((batch["labels"][:, 1:] != -100).sum()) > 0
    assert abs(loss_sum.item() / ntok - reference.item()) < 1e-5
    rows = sft.train
    assert (rows.labels[rows.labels != -100] == rows.input_ids[rows.labels != -100]).all()
    assert rows.input_ids.shape[1] == 256 and (rows.position_ids[:, 0] == 0).all()


def test_bad_conversation_file_names_file_and_line(tokenizer, tmp_path):
    _, tok_dir = tokenizer
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"text": "no messages"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON object with 'messages'"):
        SFT(bad, tok_dir, seq_len=64)


def test_faq_chat_command_and_sft_needs_a_dataset(tmp_path, faq_text):
    from pydantic import ValidationError
    from typer.testing import CliRunner

    from amalia_ray.cli import app
    from amalia_ray.core.config import SFTStage

    out = tmp_path / "chat.jsonl"
    result = CliRunner().invoke(app, ["data", "faq-chat", str(FAQ), str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 100 and rows[0]["messages"][1]["role"] == "assistant"
    with pytest.raises(ValidationError, match=r"dataset\n  Field required"):
        SFTStage(name="sft", objective="sft", steps=20)
