"""Hugging Face checkpoints in and out of FSDP2: each rank reads only its own rows of each tensor from the
safetensors files (single file or sharded with an index), names checked strictly; export gathers the full weights
once and writes a folder transformers and vLLM load, in the dtype the checkpoint came in."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from amalia_ray.core.errors import AmaliaError
from amalia_ray.train.heads import auto_class
from amalia_ray.train.lora_merge import merged, scalings
from amalia_ray.train.weight_names import base_name, is_adapter, plain_name

INDEX = "model.safetensors.index.json"
# activation checkpointing's and torch.compile's wrappers: part of the training module's names, not a checkpoint's
def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors a checkpoint holds, by their name there: without the wrappers' prefixes and, in a model
    with LoRA adapters, the base weights by their own names (the adapters are not in it)."""
    return {base_name(plain_name(n)): t for n, t in model.state_dict(keep_vars=True).items() if not is_adapter(n)}


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AmaliaError(f"{folder}: no safetensors weights (model.safetensors or {INDEX}); convert a PyTorch .bin "
                          "checkpoint with transformers' save_pretrained first")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def check_names(model, available: set[str], folder: Path, fresh: frozenset[str] = frozenset()) -> dict[str, str]:
    """Model state name -> the checkpoint name it loads from. Tied weights (one tensor under two names, e.g. an LM
    head tied to the embeddings) need one of their names only. Any missing or unexpected name fails with the names,
    but the `fresh` ones, which start new (left out of the plan)."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, tensor in checkpoint_tensors(model).items():
        by_tensor[id(tensor)].append(name)
    plan, missing = {}, []
    for names in by_tensor.values():
        found = [n for n in names if n in available]
        if not found and set(names) <= fresh:
            continue
        if not found:
            missing.append(names[0])
        for n in names:
            plan[n] = found[0] if found else n
    unexpected = sorted(available - set(plan))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} weight(s) the model has but the checkpoint lacks: {sorted(missing)[:8]}")
        if unexpected:
            parts.append(f"{len(unexpected)} weight(s) in the checkpoint the model does not have: {unexpected[:8]}")
        raise AmaliaError(f"{folder}: the checkpoint does not match the model's architecture "
                          f"({getattr(model.config, 'model_type', '?')}): " + "; ".join(parts))
    return plan


def score_head(model) -> list[str]:
    """A sequence classifier's (reward model's) head weights by checkpoint name: what a causal LM's checkpoint
    lacks; none for a causal LM."""
    if model.get_output_embeddings() is not None or not isinstance(getattr(model, "score", None), torch.nn.Module):
        return []
    return [n for n in checkpoint_tensors(model) if n.startswith("score.")]


@torch.no_grad()
def init_new(model, seed: int) -> None:
    """A new model's weights, as transformers initializes them, into its (sharded, materialized, uninitialized)
    parameters: module by module, transformers' own `_init_weights` fills full-size stand-ins on the CPU, from a
    generator seeded by the seed and the module's name — the same on every rank, for any number of ranks — and
    each rank keeps its shard. One module's weights at a time are whole in memory (the largest, the embeddings),
    never the model's. A parameter `_init_weights` leaves unset is an error naming it."""
    from torch.distributed.tensor import DTensor

    from amalia_ray.train.weight_names import base_name, plain_name

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    done: set[int] = set()
    for name, module in hf.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if all(id(p) in done for p in own.values()):
            continue
        # every parameter of the module gets a stand-in, so that _init_weights never writes into a real one (a weight
        # tied to one already filled); only those not yet filled are kept
        stand_ins = {n: torch.nn.Parameter(torch.full(p.shape, float("nan"))) for n, p in own.items()}
        module._parameters.update(stand_ins)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed * 1_000_003 + zlib.crc32(base_name(plain_name(name)).encode()))
                hf._init_weights(module)
        finally:
            module._parameters.update(own)
        for n, p in own.items():
            if id(p) in done:
                continue
            full = stand_ins[n].detach()
            if full.isnan().any():
                raise AmaliaError(f"a new {type(hf).__name__}: transformers' _init_weights leaves {name}.{n} "
                                  f"({type(module).__name__}) unset, so it cannot be initialized sharded; start from "
                                  "a checkpoint (model.from)")
            if isinstance(p, DTensor):
                fill_local(p, full.to(p.dtype))
            else:
                p.copy_(full.to(p.dtype))
            done.add(id(p))


@torch.no_grad()
def init_score_head(model, names: list[str], seed: int) -> None:
    """A new score head as transformers initializes one (weights ~ N(0, initializer_range), biases 0), drawn from
    `seed` on every rank alike, each rank keeping its own shard."""
    from torch.distributed.tensor import DTensor

    generator = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    targets = checkpoint_tensors(model)
    for name in sorted(names):
        target = targets[name]
        full = torch.zeros(target.shape) if name.endswith("bias") else \
            torch.normal(0.0, std, tuple(target.shape), generator=generator)
        if isinstance(target, DTensor):
            fill_local(target, full.to(target.dtype))
        else:
            target.copy_(full)


@torch.no_grad()
def load_sharded(model, folder: Path, new_token_ids: list[int] | None = None, seed: int = 0) -> None:
    """Fill the model's (FSDP2-sharded, materialized but uninitialized) parameters from `folder`'s safetensors:
    this rank reads only the rows of its own shard of each tensor, converted to the parameter's dtype. With
    `new_token_ids` (an extended vocabulary) the embeddings and LM head may have more rows than the checkpoint:
    those tokens' rows start at the mean of the checkpoint's rows. A sequence classifier (a reward model) loads a
    causal LM's checkpoint without its LM head, and a score head the checkpoint lacks starts from `seed`."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    files = weight_files(folder)
    available, fresh = set(files), frozenset()
    if head := score_head(model):
        available = {n for n in available if not n.startswith("lm_head.")}
        fresh = frozenset(n for n in head if n not in available)
    plan = check_names(model, available, folder, fresh)
    if fresh:
        init_score_head(model, sorted(fresh), seed)
    targets = {n: t for n, t in checkpoint_tensors(model).items() if n in plan}
    vocab_sized = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings())
                   if m is not None} if new_token_ids else set()
    by_file: dict[Path, list[str]] = defaultdict(list)
    seen: set[int] = set()
    for name, tensor in targets.items():
        if id(tensor) not in seen:  # a tied tensor is filled once
            seen.add(id(tensor))
            by_file[files[plan[name]]].append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                target, stored = targets[name], handle.get_slice(plan[name])
                if id(target) in vocab_sized:
                    _load_vocab_rows(target, stored, new_token_ids, f"{file.name}: '{plan[name]}'")
                    continue
                if tuple(stored.get_shape()) != tuple(target.shape):
                    raise AmaliaError(f"{file.name}: '{plan[name]}' has shape {tuple(stored.get_shape())}, the model "
                                      f"expects {tuple(target.shape)} (config.json and weights disagree)")
                if isinstance(target, DTensor):
                    fill_local(target, stored)
                else:
                    target.copy_(stored[:] if len(target.shape) else handle.get_tensor(plan[name]))


def fill_local(target, full) -> None:
    """Copy into a sharded parameter this rank's part of `full` (a tensor, or a safetensors slice read lazily): no
    collective, each rank takes its own rows."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    local = target.to_local()
    if local.numel():
        local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))])


def _load_vocab_rows(target, stored, new_ids: list[int], where: str) -> None:
    """An embedding or LM-head matrix whose vocabulary grew: the checkpoint's rows where it has them, then each new
    token's row set to the mean of the checkpoint's other rows — summed over the rows each rank holds and added up
    across ranks, so no rank reads the whole matrix."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rows, cols = stored.get_shape()
    if target.shape[1] != cols or target.shape[0] < rows or not set(range(rows, target.shape[0])) <= set(new_ids):
        raise AmaliaError(f"{where} has shape {(rows, cols)}, the model expects {tuple(target.shape)} with "
                          f"{len(new_ids)} new token(s) (config.json, weights and tokenizer disagree)")
    if isinstance(target, DTensor):
        (n, _), (start, _) = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        local, sharded = target.to_local(), any(isinstance(p, Shard) for p in target.placements)
    else:
        (n, start), local, sharded = (target.shape[0], 0), target, False
    new = torch.zeros(n, dtype=torch.bool)
    new[[i - start for i in new_ids if start <= i < start + n]] = True
    stored_here = max(min(start + n, rows) - start, 0)  # this shard's rows that the checkpoint has
    if stored_here:
        local[:stored_here].copy_(stored[start:start + stored_here])
    old = ~new[:stored_here]
    total = local[:stored_here][old.to(local.device)].double().sum(0)  # zeros when the shard has none
    count = torch.tensor([float(old.sum())], dtype=torch.float64, device=local.device)
    if sharded:  # summed over the ranks the rows are split across (one mesh dimension: HSDP's shard groups)
        group = target.device_mesh.get_group(next(i for i, p in enumerate(target.placements) if isinstance(p, Shard)))
        dist.all_reduce(total, group=group)
        dist.all_reduce(count, group=group)
    if new.any():
        local[new.to(local.device)] = (total / count).to(local.dtype)


SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype(folder: Path) -> str | None:
    """The dtype the checkpoint's floating-point weights are stored in (torch's name), None if it has none."""
    from safetensors import safe_open

    for name, file in sorted(weight_files(folder).items()):
        with safe_open(str(file), framework="pt") as handle:
            if (kind := handle.get_slice(name).get_dtype()) in SAFETENSORS_FLOATS:
                return SAFETENSORS_FLOATS[kind]
    return None


def gather_full(model, trained_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) weights on rank 0's CPU — or only those that train (LoRA's adapters) — by module name
    without the wrappers' prefixes; None on the other ranks. A collective: every rank calls it."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=trained_only))
    return {plain_name(k): v for k, v in full.items()} if dist.get_rank() == 0 else None


def export_hf(model, hf_config, out_dir: Path, tokenizer_dir: Path, generation_config: dict | None = None,
              dtype: str | None = None) -> None:
    """Gather the full weights (a collective: every rank calls this) and let rank 0 write a HF checkpoint that
    transformers and vLLM load (write_hf); a model with LoRA adapters is written merged."""
    head = "score" if score_head(model) else "lm"
    state = gather_full(model)
    if state is not None:
        if layers := scalings(model):
            state = merged(state, layers)
        write_hf(state, hf_config, out_dir, tokenizer_dir, generation_config, dtype, head)


def write_hf(state: dict[str, torch.Tensor], hf_config, out_dir: Path, tokenizer_dir: Path,
             generation_config: dict | None = None, dtype: str | None = None, head: str = "lm") -> None:
    """Write full weights as a HF checkpoint: config.json, safetensors weights (in `dtype`: a base model's own, so
    loading and exporting untrained weights is bit-identical; `state` is cast in place), generation_config.json (a
    causal LM's) and the tokenizer files (chat template included). `head` "score": a sequence classifier (a reward
    model), which transformers' AutoModelForSequenceClassification loads."""
    from transformers import GenerationConfig

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.device("meta"):
        plain = auto_class(head).from_config(hf_config, dtype=torch.float32)
    cast = getattr(torch, dtype) if dtype else None
    # cast in place, tensor by tensor: each fp32 tensor is freed as its cast replaces it, where a second dict would
    # hold both copies of the model at once (54 GB for a 9B exported in bf16)
    if cast is not None:
        for k, v in state.items():
            if v.is_floating_point():
                state[k] = v.to(cast)
    plain.load_state_dict(state, assign=True, strict=False)
    plain.tie_weights()
    if cast is not None:
        plain.config.dtype = cast
    plain.save_pretrained(str(tmp), safe_serialization=True)
    # the starting checkpoint's own generation settings, else the config's special token ids
    ids = {k: getattr(hf_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if head == "lm":
        GenerationConfig(**(generation_config or ids)).save_pretrained(str(tmp))
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and not (tmp / f.name).exists():  # a checkpoint's own files win (a folder of both)
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
