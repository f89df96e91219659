"""Checkpoints: DCP shards of model and optimizer plus a small train state (the HF export is hf_weights.py).

Every rank writes its own DCP shard into its own local folder and hands it to `ray.train.report`, which gathers
all ranks' files into one checkpoint folder in the run's storage. Loading reshards, so a checkpoint written by N
workers resumes on M.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from amalia_ray.core.storage import hash_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAIN_STATE = "train_state.json"
CHECKSUMS = "checksums_rank{rank}.json"
log = logging.getLogger("amalia_ray.train")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written in full (disk or bucket full, I/O error). Each checkpoint is a folder of its
    own that Ray Train registers only once every file is there, so the ones before it are untouched."""


def save(folder: Path, model, optimizer, train_state: dict) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    rank = dist.get_rank()
    torch.save(torch.get_rng_state(), folder / f"rng_rank{rank}.pt")
    if rank == 0:
        (folder / TRAIN_STATE).write_text(json.dumps({**train_state, "world_size": dist.get_world_size()}, indent=2))
    write_checksums(folder, rank)


def write_checksums(folder: Path, rank: int) -> None:
    """sha256 of every file this rank wrote (each rank saves into its own folder before Ray Train gathers them)."""
    files = {f.name: hash_file(f) for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith("checksums_")}
    (folder / CHECKSUMS.format(rank=rank)).write_text(json.dumps(files, indent=1))


def problems(folder: Path) -> list[str]:
    """What is wrong with a checkpoint folder (missing or corrupt files, a rank's files missing); [] when intact."""
    state = folder / TRAIN_STATE
    if not state.exists():
        return [f"{TRAIN_STATE} missing"]
    try:
        world = json.loads(state.read_text()).get("world_size")
    except json.JSONDecodeError:
        return [f"{TRAIN_STATE} unreadable"]
    manifests = sorted(folder.glob(CHECKSUMS.format(rank="*")))
    found = []
    if world is not None and len(manifests) != world:
        found.append(f"checksums of {len(manifests)} of {world} ranks")
    for manifest in manifests:
        for name, digest in json.loads(manifest.read_text()).items():
            f = folder / name
            if not f.exists():
                found.append(f"{name} missing")
            elif hash_file(f) != digest:
                found.append(f"{name} does not match its checksum")
    return found


def _step(folder: Path) -> int:
    try:
        return int(json.loads((folder / TRAIN_STATE).read_text())["step"])
    except (OSError, KeyError, ValueError):
        match = re.search(r"(\d+)$", folder.name)
        return int(match.group(1)) if match else -1


def intact(latest: Path) -> Path | None:
    """`latest` if its checksums hold, else the newest intact checkpoint kept beside it (Ray Train keeps
    `checkpoints_to_keep` of them); None when none is intact."""
    others = sorted((p for p in latest.parent.glob("checkpoint_*") if p.is_dir() and p != latest), key=_step,
                    reverse=True)
    for folder in [latest, *others]:
        wrong = problems(folder)
        if not wrong:
            return folder
        log.warning(f"checkpoint {folder} is damaged ({'; '.join(wrong[:3])}): trying an older one")
    return None


def load(folder: Path, model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = folder / f"rng_rank{dist.get_rank()}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((folder / TRAIN_STATE).read_text())
