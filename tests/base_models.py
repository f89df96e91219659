"""Small random checkpoints of the base-model families training supports, written the way the hub publishes them
(save_pretrained, bf16, sharded into several safetensors files with an index) with a tokenizer saved beside them
that carries the family's own style of chat template. Nothing is downloaded."""

from __future__ import annotations

import gzip
from pathlib import Path

FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")

# each family's chat-template style (the shapes of the real ones: Llama 3 headers, ChatML, [INST], Gemma turns)
TEMPLATES = {
    "llama": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
              " + m['content'] + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                "' [/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"),
    "gemma": ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
              "{{ '<start_of_turn>' + role + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
}
SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>",
            "[INST]", "[/INST]", "<start_of_turn>", "<end_of_turn>"]

# family -> (config class name, chat template style)
FAMILIES = {
    "llama": ("LlamaConfig", "llama"),
    "qwen2": ("Qwen2Config", "chatml"),
    "qwen3": ("Qwen3Config", "chatml"),
    "mistral": ("MistralConfig", "mistral"),
    "gemma2": ("Gemma2Config", "gemma"),
    "gemma3_text": ("Gemma3TextConfig", "gemma"),
}


def faq_paragraphs() -> list[str]:
    return [p for p in gzip.open(FAQ, "rt", encoding="utf-8").read().split("\n\n") if len(p) > 40]


def family_tokenizer(out: Path, style: str, vocab_size: int = 600):
    """A byte-level BPE trained on the Debian FAQ with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>", *SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(faq_paragraphs(), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                 additional_special_tokens=SPECIALS)
    hf.chat_template = TEMPLATES[style]
    hf.save_pretrained(str(out))
    return hf


def make_base_model(out: Path, family: str, *, hidden: int = 128, layers: int = 2, vocab: int = 640,
                    shard_size: str | None = "200KB", dtype: str = "bfloat16", seed: int = 0,
                    with_tokenizer: bool = True) -> Path:
    """A random `family` checkpoint in `out` (sharded when `shard_size` is given), its tokenizer beside it. Heads are
    hidden / 4 wide: vLLM's CPU attention serves head sizes of 32 and up (32, 64, 80, …), not 16."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, style = FAMILIES[family]
    config = getattr(transformers, cls)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), **({"max_shard_size": shard_size} if shard_size else {}))
    if with_tokenizer:
        family_tokenizer(out, style)
    return out
