"""Base models named by a recipe (`model.from`): a local folder or a Hugging Face hub id, resolved to a local folder.

A hub id is fetched into the Hugging Face cache once (config, tokenizer and safetensors files only) and read from
there afterwards; with `HF_HUB_OFFLINE=1` only what the cache already holds is used. Every stage that needs the
model (tokenizer, training workers, serving, `amalia plan`) resolves the same reference the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from amalia_ray.core.config import ModelConfig
from amalia_ray.core.errors import AmaliaError

# what training, export and serving read of a model repository: no PyTorch .bin/.pt, ONNX or GGUF copies
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.py"]
CONFIG_FILES = ["config.json"]


def is_local(ref: str) -> bool:
    return ref.startswith((".", "/", "~")) or Path(ref).expanduser().is_dir()


def resolve(ref: str, revision: str | None = None, patterns: list[str] | None = None) -> Path:
    """The local folder holding `ref` (downloaded into the Hugging Face cache when `ref` is a hub id and the network
    allows it). Raises one clear line when the model cannot be had."""
    if is_local(ref):
        folder = Path(ref).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise AmaliaError(f"base model folder {folder}: no config.json there (a Hugging Face model folder, as "
                              "save_pretrained writes it, or a hub id such as utter-project/EuroLLM-9B)")
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"'{ref}'" + (f" (revision {revision})" if revision else "")
    try:
        return Path(snapshot_download(ref, revision=revision, allow_patterns=patterns or MODEL_FILES))
    except HFValidationError:
        raise AmaliaError(f"base model {where}: neither a local folder with a config.json nor a valid hub id "
                          "(owner/name)") from None
    except GatedRepoError:
        raise AmaliaError(f"base model {where}: gated on the hub; accept its licence there and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise AmaliaError(f"base model {where}: the hub has no such revision") from None
    except RepositoryNotFoundError:
        raise AmaliaError(f"base model {where}: no such model on the hub (or it is private: set HF_TOKEN)") from None
    except (LocalEntryNotFoundError, OSError) as e:
        from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE

        if HF_HUB_OFFLINE:
            raise AmaliaError(f"base model {where}: not in the Hugging Face cache ({HF_HUB_CACHE}) and "
                              "HF_HUB_OFFLINE=1 forbids downloading it; download it where the network allows "
                              "(huggingface-cli download), or name a local folder") from None
        raise AmaliaError(f"base model {where}: could not be downloaded into {HF_HUB_CACHE} "
                          f"({type(e).__name__}: {e})") from None


def snapshot_commit(folder: Path) -> str | None:
    """`org/name@commit` when `folder` is a Hugging Face cache snapshot (…/models--org--name/snapshots/<commit>),
    whose content that commit fixes; None for any other folder (its files must be read to know what it holds)."""
    parts = Path(folder).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--") and \
            re.fullmatch(r"[0-9a-f]{40}", parts[-1]):
        return parts[-3].removeprefix("models--").replace("--", "/", 1) + "@" + parts[-1]
    return None


def stage_snapshot(folder: Path, hub_dir: Path) -> Path:
    """A hub snapshot as a folder every node of the cluster sees: its files placed under `hub_dir` (in the run
    folder, on the storage all nodes share) in the cache's own layout, so its commit still names it. The Hugging Face
    cache is one machine's: a worker or a Serve replica on another node would find nothing there. Files are
    hard-linked where the filesystem allows (no copy, no space), copied otherwise, only the files a model needs
    (`MODEL_FILES`: not the .bin or original/ checkpoints a full download brings); a folder that is no snapshot
    (a local model the user placed) is returned as it is. Processes staging the same snapshot at once each build
    their own copy and the first to finish wins."""
    import fnmatch
    import tempfile

    if snapshot_commit(folder) is None:
        return folder
    dest = hub_dir.joinpath(*Path(folder).parts[-3:])
    if dest.is_dir():  # staged by an earlier run of this recipe: the commit fixes what it holds
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for source in sorted(Path(folder).rglob("*")):
            relative = source.relative_to(folder)
            if source.is_dir() or not any(fnmatch.fnmatch(relative.name, p) for p in MODEL_FILES):
                continue
            target = partial / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            real = source.resolve()  # cache snapshots are links into the blob store
            try:
                os.link(real, target)
            except OSError:  # another filesystem (or one without hard links)
                shutil.copyfile(real, target)
        partial.chmod(0o755)
        partial.rename(dest)
    except OSError:
        if not dest.is_dir():  # not a process that staged it first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return dest


def read_config(ref: str, revision: str | None = None, config_file: str | None = None) -> dict:
    """The model's config.json as a dict: from `config_file` when given (a copy kept beside a recipe, so planning
    and validation work without the weights), else from the model itself (only config.json is fetched)."""
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise AmaliaError(f"model.config_file: {path} not found")
    else:
        path = resolve(ref, revision, CONFIG_FILES) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise AmaliaError(f"{path}: not a readable config.json ({e})") from None


def with_overrides(config_dict: dict, cfg: ModelConfig) -> dict:
    """A base model's config with the recipe's RoPE scaling (context extension) and attention kernel applied."""
    out = dict(config_dict)
    current = out.get("rope_parameters") or out.get("rope_scaling") or {}
    if cfg.rope_scaling and any(current.get(k) != v for k, v in cfg.rope_scaling.items()):
        # (a checkpoint exported by an earlier stage already carries the scaling: applied once)
        scaling = dict(cfg.rope_scaling)
        original = scaling.get("original_max_position_embeddings") or out.get("max_position_embeddings")
        theta = (out.get("rope_parameters") or {}).get("rope_theta", out.get("rope_theta"))
        # transformers 5 reads RoPE settings from rope_parameters (theta included); older configs say rope_scaling
        out["rope_parameters"] = {**({"rope_theta": theta} if theta is not None else {}), **scaling}
        out.pop("rope_scaling", None)
        if "factor" in scaling and original and scaling["rope_type"] in ("linear", "yarn", "dynamic", "llama3"):
            out["max_position_embeddings"] = int(original * float(scaling["factor"]))
            if scaling["rope_type"] in ("yarn", "llama3"):
                out["rope_parameters"].setdefault("original_max_position_embeddings", original)
    out["attn_implementation"] = cfg.attn_implementation
    return out


def recipe_config(cfg: ModelConfig, resolve=lambda p: p) -> dict:
    """The base model's config.json with the recipe's overrides, read without its weights (`resolve` turns the
    recipe-relative config_file into a path)."""
    config_file = str(resolve(cfg.config_file)) if cfg.config_file else None
    return with_overrides(read_config(cfg.base, cfg.revision, config_file), cfg)


def anchored(cfg: ModelConfig, resolve) -> ModelConfig:
    """`cfg` with a local `from` path taken relative to the recipe's folder (as every path in a recipe is); a hub
    id is left as it is."""
    ref = cfg.base
    if ref and (ref.startswith((".", "/", "~")) or Path(resolve(ref)).is_dir()):
        return cfg.model_copy(update={"from_": str(resolve(str(Path(ref).expanduser())))})
    return cfg
