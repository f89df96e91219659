"""Build the decoder from the recipe as a transformers model, so checkpoints are plain HF and vLLM loads them."""

from __future__ import annotations

from amalia_ray.core.config import ModelConfig


def llama_config(cfg: ModelConfig, vocab_size: int, bos_id: int, eos_ids: list[int], pad_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
