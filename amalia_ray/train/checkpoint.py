"""Checkpoints: DCP shards of model and optimizer plus a small train state (the HF export is hf_weights.py).

Every rank writes its own DCP shard into its own local folder, with the sha256 of each file it wrote, and hands it
to `ray.train.report`, which gathers all ranks' files into one checkpoint folder in the run's storage (a local
path or a bucket). Loading reshards, so a checkpoint written by N workers resumes on M.

On resume each rank fetches and verifies only what it reads: the train state, DCP's metadata and the shard files
its own load plan names — not the whole checkpoint, which at scale is far larger than one rank's part and may sit
in a bucket. If any rank finds a file missing or damaged, all ranks move together to the next newest checkpoint
Ray Train has registered for the run.

Checksums are signed with the project's key (core/signing.py). Restoring unpickles DCP's metadata and small items,
so a checksum anyone who can write the bucket could recompute would let a planted file run code on every worker: a
checkpoint whose checksums are not signed with the key is refused before anything of it is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from amalia_ray.core.signing import KEY_ENV, signed_list, verified_list


# what trains: every weight in full training; with LoRA the adapters only (the frozen base comes from its export)
TRAINED = StateDictOptions(ignore_frozen_params=True)


def loading_options(model) -> StateDictOptions:
    """Loading what `TRAINED` saved: every weight strictly, or with frozen weights (LoRA's base, loaded from its
    export) the trained ones only."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)

TRAIN_STATE = "train_state.json"
OBJECTIVE_STATE = "objective_state.json"  # what the objective keeps across steps (a rollout being trained on)
DCP_METADATA = ".metadata"
CHECKSUMS = "checksums_rank{rank}.json"
RNG = "rng_rank{rank}.pt"
log = logging.getLogger("amalia_ray.train")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written in full (disk or bucket full, I/O error). Each checkpoint is a folder of its
    own that Ray Train registers only once every file is there, so the ones before it are untouched."""


def _state(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
    return {"model": model_sd, "optim": optim_sd}


def save(folder: Path, model, optimizer, train_state: dict, key: str, objective_state: str = "") -> None:
    dcp.save(_state(model, optimizer), checkpoint_id=str(folder))
    _write_rest(folder, train_state, key, rng_state(), objective_state)


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's random generators: the host's and, on a GPU, its device's (dropout, sampling on the device). A
    worker that has not used CUDA (training on the CPU of a GPU node) does not start it here."""
    return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_initialized()
                                             else {})}


def set_rng_state(state: dict[str, torch.Tensor] | torch.Tensor) -> None:
    if isinstance(state, torch.Tensor):  # a checkpoint of an earlier version: the host's generator only
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def _write_rest(folder: Path, train_state: dict, key: str, rng: dict[str, torch.Tensor],
                objective_state: str = "") -> None:
    """What follows the DCP shard in a rank's folder: its RNG state, rank 0's train state and objective state (JSON
    text, taken when the step ended), the signed checksums of every file (so after the shard is complete)."""
    rank = dist.get_rank()
    torch.save(rng, folder / RNG.format(rank=rank))
    if rank == 0:
        (folder / TRAIN_STATE).write_text(json.dumps({**train_state, "world_size": dist.get_world_size()}, indent=2))
        if objective_state:
            (folder / OBJECTIVE_STATE).write_text(objective_state)
    write_checksums(folder, rank, key)


class BackgroundSave:
    """A checkpoint written while training goes on (DCP's `async_save`): the weights and optimizer state are first
    copied into host memory (the staged copy, one more copy of this rank's shard there, so the next optimizer step
    cannot change what is written), then a thread writes the shard. `finish` waits for it and writes the rest.

    The thread's collectives (DCP plans the save across ranks) go through `group`, a gloo group of their own: on the
    training's group they could interleave with the step's collectives running at the same time."""

    def __init__(self, folder: Path, model, optimizer, train_state: dict, key: str, group,
                 objective_state: str = "") -> None:
        self.folder, self.train_state, self.key, self.objective_state = folder, train_state, key, objective_state
        self.rng = rng_state()  # the step's, as a save that does not wait would take it
        self.started = time.perf_counter()
        self.written: float | None = None
        self.future = dcp.async_save(_state(model, optimizer), checkpoint_id=str(folder), process_group=group)
        self.future.add_done_callback(lambda _: setattr(self, "written", time.perf_counter()))

    def finish(self) -> float:
        """Wait for the shard, write the rest; the seconds the whole save took (what one written in place would)."""
        self.future.result()
        _write_rest(self.folder, self.train_state, self.key, self.rng, self.objective_state)
        return (self.written or time.perf_counter()) - self.started


CHUNK = 16 << 20  # bytes per checksum: a rank verifies (and downloads) only the chunks holding what it reads


def write_checksums(folder: Path, rank: int, key: str) -> None:
    """sha256 of every `CHUNK` bytes of each file this rank wrote (each rank saves into its own folder before Ray
    Train gathers them), so a reader can verify just the parts it reads; the list signed with `key`."""
    files = {}
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.startswith("checksums_"):
            with f.open("rb") as src:
                files[f.name] = {"size": f.stat().st_size,
                                 "sha256": [hashlib.sha256(c).hexdigest() for c in iter(lambda: src.read(CHUNK), b"")]}
    (folder / CHECKSUMS.format(rank=rank)).write_text(signed_list(files, key))


class CheckpointFiles:
    """The files of one checkpoint as a local folder: the folder itself when the checkpoint is on this machine's
    filesystem, else a temporary folder of sparse files into which only the chunks asked for are downloaded."""

    def __init__(self, filesystem: pafs.FileSystem, path: str):
        self.fs, self.path = filesystem, path.rstrip("/")
        self.in_place = isinstance(filesystem, pafs.LocalFileSystem)
        self.folder = Path(path) if self.in_place else Path(tempfile.mkdtemp(prefix="amalia-resume-"))
        self._fetched: dict[str, set[int]] = {}

    @classmethod
    def of(cls, checkpoint) -> CheckpointFiles:
        """From a `ray.train.Checkpoint`."""
        return cls(checkpoint.filesystem, checkpoint.path)

    def get(self, name: str, chunks: list[int] | None = None) -> Path | None:
        """The local path of file `name` with (at least) the given chunks present (None: the whole file)."""
        local = self.folder / name
        if self.in_place:
            return local if local.is_file() else None
        try:
            with self.fs.open_input_file(f"{self.path}/{name}") as src:
                size = src.size()
                wanted = set(range(-(-size // CHUNK))) if chunks is None else set(chunks)
                # chunks past the end (a file shorter than its checksums say) are not there to fetch
                missing = sorted(c for c in wanted - self._fetched.setdefault(name, set()) if c * CHUNK < size)
                with open(local, "r+b" if local.exists() else "wb") as dst:
                    dst.truncate(size)  # sparse: what is not fetched is never read
                    for c in missing:
                        dst.seek(c * CHUNK)
                        dst.write(src.read_at(min(CHUNK, size - c * CHUNK), c * CHUNK))
                self._fetched[name] |= set(missing)
        except (FileNotFoundError, OSError):
            return None
        return local

    def close(self) -> None:
        if not self.in_place:
            shutil.rmtree(self.folder, ignore_errors=True)


def ranges_read(state: dict, metadata) -> dict[str, list[tuple[int, int]]]:
    """The (offset, length) byte ranges of each DCP shard file that a load of `state` (this rank's part of the
    model and optimizer) reads: its load plan's items. Small replicated items (optimizer step counts) may sit in
    another rank's file; only their bytes count."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for item in planner.create_local_plan().items:
        stored = metadata.storage_data[item.storage_index]
        ranges.setdefault(stored.relative_path, []).append((stored.offset, stored.length))
    return ranges


def _chunks(ranges: list[tuple[int, int]]) -> list[int]:
    return sorted({c for offset, length in ranges for c in range(offset // CHUNK, (offset + max(length, 1) - 1) // CHUNK + 1)})


def problems(files: CheckpointFiles, state: dict | None, rank: int, key: str) -> list[str]:
    """What is wrong with the part of a checkpoint that `rank` reads to load `state` (None: every file of it):
    missing or damaged files, a writer rank's checksums missing or not signed with `key`; [] when intact. Nothing
    is unpickled before the checksums it is checked against are known to be signed."""
    train_state = files.get(TRAIN_STATE)
    if train_state is None:
        return [f"{TRAIN_STATE} missing"]
    # world_size is read before the file is verified (it says how many writers' checksums to read), so it must be
    # a count: none, zero or a string would read no checksums, and with none nothing below would be checked
    try:
        world = json.loads(train_state.read_text()).get("world_size")
    except (ValueError, RecursionError, AttributeError):  # not JSON, not UTF-8, a 5,000-digit number, too deep
        return [f"{TRAIN_STATE} unreadable"]
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= 1 << 20:
        return [f"{TRAIN_STATE}: world_size {world!r} is not a count of ranks"]
    digests, found = {}, []
    for writer in range(world):
        manifest = files.get(CHECKSUMS.format(rank=writer))
        if manifest is None:  # the first one missing says enough (a forged world_size would look up a million)
            found.append(f"checksums of rank {writer} of {world} missing")
            break
        if (signed := verified_list(manifest.read_bytes().decode("utf-8", "replace"), key)) is None:
            found.append(f"checksums of rank {writer} are not signed with this machine's checkpoint key ({KEY_ENV}): "
                         "written with another key, or forged")
        else:
            digests.update(signed)
    if found:
        return found
    if state is None:
        return _damaged(files, {name: None for name in digests}, digests)
    # the train state, DCP's metadata (a pickle) and the objective's state wherever it is (a restore reads it when
    # it is there) must have signed checksums; a rank's RNG file only where its writer was (an elastic stage may
    # resume on more ranks than saved)
    rng = RNG.format(rank=rank)
    whole = {TRAIN_STATE: None, DCP_METADATA: None, **({rng: None} if rng in digests else {}),
             **({OBJECTIVE_STATE: None} if OBJECTIVE_STATE in digests or files.get(OBJECTIVE_STATE) else {})}
    wrong = _damaged(files, whole, digests)
    if wrong:
        return wrong
    try:
        ranges = ranges_read(state, FileSystemReader(str(files.folder)).read_metadata())
    except Exception as e:  # noqa: BLE001 - a metadata file that does not parse is a damaged checkpoint
        return [f"{DCP_METADATA} unreadable ({type(e).__name__})"]
    return _damaged(files, {name: _chunks(r) for name, r in ranges.items()}, digests)


def _damaged(files: CheckpointFiles, wanted: dict[str, list[int] | None], digests: dict) -> list[str]:
    """Checks the given chunks (None: all) of each file against the writers' checksums."""
    found = []
    for name, chunks in sorted(wanted.items()):
        if name not in digests:
            found.append(f"{name} has no checksum")
            continue
        expected = digests[name]
        local = files.get(name, chunks)
        if local is None:
            found.append(f"{name} missing")
            continue
        if local.stat().st_size != expected["size"]:
            found.append(f"{name} does not match its checksum")
            continue
        with local.open("rb") as f:
            for c in range(len(expected["sha256"])) if chunks is None else chunks:
                f.seek(c * CHUNK)
                if c >= len(expected["sha256"]) or hashlib.sha256(f.read(CHUNK)).hexdigest() != expected["sha256"][c]:
                    found.append(f"{name} does not match its checksum")
                    break
    return found


def restore(candidates: list, model, optimizer, device: torch.device, key: str) -> dict:
    """Load the newest of `candidates` (ray.train.Checkpoint, newest first) whose files every rank finds intact and
    signed with `key`; returns its train state. Every rank takes part in each check (a collective on `device`)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
    state = {"model": model_sd, "optim": optim_sd}
    rank = dist.get_rank()
    first = []
    for checkpoint in candidates:
        files = CheckpointFiles.of(checkpoint)
        try:
            wrong = problems(files, state, rank, key)
            first = first or wrong
            flag = torch.tensor([1.0 if wrong else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                if wrong:
                    log.warning(f"checkpoint {checkpoint.path} is damaged ({'; '.join(wrong[:3])}): trying an older one")
                continue
            dcp.load(state, checkpoint_id=str(files.folder))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=loading_options(model))
            rng = files.get(RNG.format(rank=rank))
            if rng is not None:
                set_rng_state(torch.load(rng, weights_only=True))
            train_state = json.loads(files.get(TRAIN_STATE).read_text())
            if (objective := files.get(OBJECTIVE_STATE)) is not None:
                train_state["objective"] = json.loads(objective.read_text())
            return train_state
        finally:
            files.close()
    unsigned = any("not signed" in p for p in first)
    raise RuntimeError(f"no intact checkpoint to resume from among the {len(candidates)} registered (the newest: "
                       f"{first[0] if first else 'damaged on another rank'})" + (
                           f": set {KEY_ENV} to the key they were written with (~/.amalia/checkpoint.key of the "
                           "user and machine that wrote them), or delete the stage's checkpoints (its ray/ folder) "
                           "to train it from the start" if unsigned else ""))


def registered(latest, reported: list) -> list:
    """The checkpoint to resume from, then the other checkpoints Ray Train has registered for the run (reported:
    `ray.train.get_all_reported_checkpoints()`), newest step first."""
    older = sorted((r for r in reported if r.checkpoint.path != latest.path),
                   key=lambda r: r.metrics.get("step", -1), reverse=True)
    return [latest, *(r.checkpoint for r in older)]
