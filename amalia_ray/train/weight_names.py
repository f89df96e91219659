"""How the model's parameters are named: the prefixes its wrappers add (activation checkpointing, torch.compile),
which a checkpoint's names leave out, and the names PEFT gives a LoRA layer's parts (a base weight is
`...q_proj.base_layer.weight`, its adapter `...q_proj.lora_A.default.weight`)."""

from __future__ import annotations

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
ADAPTER_MARK = ".lora_"  # lora_A, lora_B, lora_dropout, lora_embedding_A, ...
BASE_LAYER = ".base_layer"
ADAPTER_NAME = "default"


def plain_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_adapter(name: str) -> bool:
    return ADAPTER_MARK in name


def base_name(name: str) -> str:
    """The checkpoint name of a base weight inside a LoRA layer."""
    return name.replace(BASE_LAYER, "")
