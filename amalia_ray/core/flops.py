"""The one definition of model FLOPs and MFU, used by the training loop's metric, `amalia plan` and the benchmarks:
torchtitan's — 6 × the parameters of every weight matmul (forward and backward; the LM head included, the embedding
lookup not) + 12 × layers × attention width × sequence length (the score and value matmuls, not halved for the causal
mask) per token. Recomputation under activation checkpointing is not model FLOPs, so it lowers MFU rather than adding
to it. MFU is against a stated peak: the device's datasheet dense peak where we know it, else a matmul measured on
the device, and the basis is always named."""

from __future__ import annotations

# dense (no sparsity) tensor-core peaks from the vendors' datasheets, FLOP/s per device, by dtype
DATASHEET_PEAKS = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100 80GB HBM3": {"bf16": 989e12, "fp32": 67e12},  # SXM
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "GH200": {"bf16": 989e12, "fp32": 67e12},
    "B200": {"bf16": 2250e12, "fp32": 80e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "MI300X": {"bf16": 1307e12, "fp32": 163e12},
}


def model_flops_per_token(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                          seq_len: int) -> float:
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * ffn  # q, k and v, out; gate, up, down
    weights = layers * per_layer + hidden * vocab  # the LM head; the input embedding is a lookup, not a matmul
    return 6 * weights + 12 * layers * q * seq_len


def flops_per_token_of(hf_config, seq_len: int, outputs: int | None = None) -> float:
    """Model FLOPs per token of a transformers config (a decoder-only LM); `outputs`: the head's outputs when it is
    not the LM head (a reward model's score head has one)."""
    c = getattr(hf_config, "text_config", None) or hf_config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return model_flops_per_token(c.hidden_size, c.intermediate_size, c.num_hidden_layers, heads,
                                 getattr(c, "num_key_value_heads", None) or heads, head_dim,
                                 c.vocab_size if outputs is None else outputs, seq_len)


def datasheet_peak(device_name: str, dtype: str) -> float | None:
    """The datasheet peak of a device by its reported name (e.g. torch.cuda.get_device_name()), or None."""
    for key, peaks in sorted(DATASHEET_PEAKS.items(), key=lambda kv: -len(kv[0])):
        if key.lower() in device_name.lower():
            return peaks.get(dtype)
    return None
