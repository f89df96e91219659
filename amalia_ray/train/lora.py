"""LoRA with PEFT under FSDP2: adapters are injected into the model (PEFT's own layers, `inject_adapter_in_model`)
before it is sharded; the base weights are frozen, so the optimizer, the gradients' reduce-scatter and the DCP
checkpoints hold the adapters only. Module names keep the model's own (a base weight is `...q_proj.base_layer.weight`,
its adapter `...q_proj.lora_A.default.weight`), so the base checkpoint loads shard by shard as without adapters.

The export goes through PEFT's `PeftModel`, whose inner model has exactly these names: `save_pretrained` writes the
adapter folder (adapter_config.json, adapter_model.safetensors) and `merge_and_unload` the merged weights."""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from amalia_ray.core.config import LoraConfig
from amalia_ray.train.hf_weights import fill_local, gather_full, write_hf
from amalia_ray.train.weight_names import ADAPTER_NAME, is_adapter, plain_name


def peft_config(cfg: LoraConfig, base: str | None = None, with_modules_to_save: bool = True):
    """PEFT's config of these adapters (`with_modules_to_save=False`: the modules trained in full left out)."""
    from peft import LoraConfig as PeftLoraConfig, TaskType

    return PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules,
                          modules_to_save=(cfg.modules_to_save or None) if with_modules_to_save else None,
                          task_type=TaskType.CAUSAL_LM, base_model_name_or_path=base)


def trainable(name: str, cfg: LoraConfig) -> bool:
    parts = name.split(".")
    return is_adapter(name) or any(m in parts for m in cfg.modules_to_save)


def add_adapters(model, cfg: LoraConfig) -> None:
    """Inject the adapters (on whatever device the model is: meta before a checkpoint is loaded) and freeze the
    rest."""
    from peft import inject_adapter_in_model

    # modules_to_save train in place here; PEFT's wrapper of them is built at export
    inject_adapter_in_model(peft_config(cfg, with_modules_to_save=False), model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(trainable(name, cfg))


@torch.no_grad()
def init_adapters(model, seed: int) -> None:
    """PEFT's initialization for adapters created on the meta device and then materialized uninitialized: A as
    `kaiming_uniform_(a=√5)`, B zeros (so the adapted model starts equal to the base). Each A is drawn whole from a
    generator seeded by the seed and its name — the same on every rank and every run — and each rank keeps its
    shard."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        name = plain_name(name)  # activation checkpointing's wrapper does not change what is drawn
        full = torch.zeros(param.shape, dtype=param.dtype)
        if ".lora_A." in name or ".lora_embedding_A." in name:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            fan_in = full.shape[1]
            bound = math.sqrt(6 / ((1 + 5) * fan_in))  # kaiming_uniform_ with a = sqrt(5)
            full.uniform_(-bound, bound, generator=gen)
        if isinstance(param, DTensor):
            fill_local(param, full)
        else:
            param.copy_(full.to(param.device))


@contextmanager
def adapters_off(model):
    """The model as its base while inside: every LoRA layer's adapters switched off by the flag its forward reads
    (PEFT's `enable_adapters` would also flip requires_grad, which FSDP2 settled when it sharded the model)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m._disable_adapters = False


def export(model, hf_config, cfg: LoraConfig, adapter_dir: Path, merged_dir: Path | None, tokenizer_dir: Path,
           generation_config: dict | None, dtype: str | None, base: str | None) -> None:
    """Gather the adapted model (a collective) and let rank 0 write the PEFT adapter folder and, with `merged_dir`,
    the merged checkpoint (write_hf: what transformers and vLLM load, in the starting checkpoint's dtype). Without a
    merge only the trained weights are gathered: the base stays where it is."""
    import shutil

    state = gather_full(model, trained_only=merged_dir is None)
    if state is None:
        return
    wrapped = _peft_model(state, hf_config, cfg, base, with_base=merged_dir is not None)
    tmp = adapter_dir.with_name(adapter_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    wrapped.save_pretrained(str(tmp))
    shutil.rmtree(adapter_dir, ignore_errors=True)
    tmp.rename(adapter_dir)
    if merged_dir is not None:
        merged = wrapped.merge_and_unload()
        write_hf(merged.state_dict(), hf_config, merged_dir, tokenizer_dir, generation_config, dtype)


def _peft_model(state: dict, hf_config, cfg: LoraConfig, base: str | None, with_base: bool):
    """PEFT's own model of the base with these adapters, holding the gathered weights (`with_base`: all of them;
    else the trained ones, the base left on the meta device — enough to write the adapter folder)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    wrapped = get_peft_model(plain, peft_config(cfg, base), adapter_name=ADAPTER_NAME)
    inner = wrapped.base_model.model
    names = set(inner.state_dict())
    full = dict(state)
    for module in cfg.modules_to_save:  # trained in place: PEFT's copy of the module and its original get it
        for name, value in state.items():
            parts = name.split(".")
            if module in parts:
                at = parts.index(module) + 1
                for kept in ([f"modules_to_save.{ADAPTER_NAME}"], ["original_module"]):
                    full[".".join(parts[:at] + kept + parts[at:])] = value
    needed = names if with_base else {n for n in names if is_adapter(n) or ".modules_to_save." in n}
    if missing := sorted(needed - set(full)):
        raise RuntimeError(f"the LoRA export lacks {len(missing)} weight(s) of PEFT's model: {missing[:5]}")
    inner.load_state_dict({k: full[k] for k in needed}, strict=with_base, assign=True)
    inner.tie_weights()
    return wrapped
