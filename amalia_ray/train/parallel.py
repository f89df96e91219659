"""FSDP2: shard each decoder block, then the root; precision policy chosen per device. Activation checkpointing and
torch.compile are applied per block first (torchtitan's order: AC, compile, FSDP)."""

from __future__ import annotations

import torch


def process_group_backend(use_gpu: bool) -> str:
    """The workers' torch.distributed backend. On GPUs NCCL is registered for CUDA tensors only, yet the loop also
    reduces metrics, gathers objects and plans checkpoints with CPU tensors: those go through gloo."""
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


def resolve_precision(precision: str, device: torch.device) -> str:
    """bf16 on GPU; fp32 on CPU, where fp32 matmul is faster than bf16 on the machines we measured."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" else "fp32"


def apply_fsdp(model, precision: str, activation_checkpointing: bool, compile_blocks: bool = False) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    layers = model.model.layers
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    if compile_blocks:  # every block has the same code: one compilation, reused
        for layer in layers:
            layer.compile()
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
