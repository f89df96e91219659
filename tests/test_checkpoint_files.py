"""Checkpoint checksums and resume: a damaged checkpoint is detected by the ranks that read it, every rank moves to
the next newest registered checkpoint together, and each rank fetches and verifies only the files it reads."""

import json
import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from amalia_ray.train import checkpoint
from amalia_ray.train.checkpoint import CHUNK, TRAIN_STATE, CheckpointFiles, problems, write_checksums
from amalia_ray.core.signing import sign as checkpoint_sign
from tests.conftest import free_port

pytestmark = pytest.mark.reliability  # damaged, truncated and forged checkpoints (docs/reliability.md)

KEY = "a-test-key"


def fake_checkpoint(root: Path, name: str, step: int, world: int = 2) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for rank in range(world):
        rank_dir = root / f"{name}-rank{rank}"  # each rank saves alone, then Ray Train gathers the files
        rank_dir.mkdir()
        (rank_dir / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 1000)
        if rank == 0:
            (rank_dir / TRAIN_STATE).write_text(json.dumps({"step": step, "world_size": world}))
            (rank_dir / ".metadata").write_bytes(b"meta")
        write_checksums(rank_dir, rank, KEY)
        for f in rank_dir.iterdir():
            f.rename(folder / f.name)
    return folder


def local(folder: Path) -> CheckpointFiles:
    return CheckpointFiles(pafs.LocalFileSystem(), str(folder))


def test_damaged_truncated_or_partial_checkpoints_are_detected(tmp_path):
    folder = fake_checkpoint(tmp_path, "checkpoint_000002", 30)
    assert problems(local(folder), None, 0, KEY) == []
    (folder / "__1_0.distcp").write_bytes(b"\x01" * 10)  # truncated
    assert problems(local(folder), None, 0, KEY) == ["__1_0.distcp does not match its checksum"]
    (folder / "checksums_rank1.json").unlink()  # a rank's files never arrived
    assert problems(local(folder), None, 0, KEY) == ["checksums of rank 1 of 2 missing"]
    (folder / TRAIN_STATE).unlink()
    assert problems(local(folder), None, 0, KEY) == [f"{TRAIN_STATE} missing"]


def test_files_of_a_checkpoint_in_a_bucket_are_downloaded_only_when_asked_for(tmp_path):
    """A remote filesystem (pyarrow's SubTreeFileSystem stands in for the bucket): nothing is fetched up front."""
    folder = fake_checkpoint(tmp_path / "bucket", "checkpoint_000001", 20)
    bucket = pafs.SubTreeFileSystem(str(tmp_path / "bucket"), pafs.LocalFileSystem())
    (folder / "big").write_bytes(os.urandom(3 * CHUNK))
    files = CheckpointFiles(bucket, "checkpoint_000001")
    assert not files.in_place and not list(files.folder.iterdir())
    assert files.get("__1_0.distcp").read_bytes() == (folder / "__1_0.distcp").read_bytes()
    assert files.get("nope") is None
    part = files.get("big", [1]).read_bytes()
    assert len(part) == 3 * CHUNK and part[CHUNK:2 * CHUNK] == (folder / "big").read_bytes()[CHUNK:2 * CHUNK]
    assert part[:CHUNK] == part[2 * CHUNK:] == bytes(CHUNK), "the other chunks were not fetched"
    (folder / "short").write_bytes(b"x" * 10)  # shorter than its checksums say: its size tells, no error
    assert files.get("short", [0, 3]).stat().st_size == 10
    assert sorted(p.name for p in files.folder.iterdir()) == ["__1_0.distcp", "big", "short"]
    files.close()
    assert not files.folder.exists()


def _gathered(root: Path, name: str, rank: int, world: int) -> Path:
    """Every rank's own folder `name-rank{r}` moved into one folder `name`, as Ray Train gathers a checkpoint."""
    folder = root / name
    dist.barrier()
    if rank == 0:
        folder.mkdir()
        for r in range(world):
            for f in (root / f"{name}-rank{r}").iterdir():
                f.rename(folder / f.name)
    dist.barrier()
    return folder


def _resume(rank: int, world: int, port: int, root: str, out: str) -> None:
    """Two FSDP2 ranks save three checkpoints (each rank into its own folder, then gathered, as Ray Train does);
    rank 1's shard of the newest is damaged; both ranks resume."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from ray.train import Checkpoint

    from amalia_ray.train import checkpoint

    checkpoint.CHUNK = 256  # many chunks per shard file of this small model
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    folders, weights = [], []
    for step in (10, 20, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        weights.append([p.full_tensor().clone() for p in model.parameters()])
        mine = Path(root) / f"checkpoint_{step}-rank{rank}"
        mine.mkdir(parents=True)
        checkpoint.save(mine, model, optimizer, {"step": step}, KEY, json.dumps({"rollout_of": step}))
        folders.append(_gathered(Path(root), f"checkpoint_{step}", rank, world))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    read = checkpoint.ranges_read(state, FileSystemReader(str(folders[-1])).read_metadata())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, read)
    if rank == 0:  # damage a chunk of rank 1's shard file that only rank 1 reads
        theirs = checkpoint._chunks(everyone[1]["__1_0.distcp"])
        ours = checkpoint._chunks(everyone[0].get("__1_0.distcp", []))
        chunk = next(c for c in theirs if c not in ours)
        newest = folders[-1] / "__1_0.distcp"
        data = bytearray(newest.read_bytes())
        data[chunk * checkpoint.CHUNK + 3] ^= 0xFF
        newest.write_bytes(bytes(data))
    dist.barrier()
    found = problems(local(folders[-1]), state, rank, KEY)
    candidates = [Checkpoint.from_directory(str(f)) for f in reversed(folders)]
    train_state = checkpoint.restore(candidates, model, optimizer, torch.device("cpu"), KEY)
    restored = [p.full_tensor() for p in model.parameters()]
    result = {"read": {name: sum(n for _, n in r) for name, r in read.items()}, "problems": found,
              "step": train_state["step"], "objective": train_state["objective"],
              "weights_of_20": all(torch.equal(a, b) for a, b in zip(restored, weights[1]))}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_each_rank_verifies_what_it_reads_and_all_fall_back_together(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_resume, args=(2, free_port(), str(tmp_path / "ckpt"), str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, (own, other) in enumerate([("__0_0.distcp", "__1_0.distcp"), ("__1_0.distcp", "__0_0.distcp")]):
        # its own shard, and of the other rank's file only the small replicated items (step counts, param groups)
        assert ranks[rank]["read"].get(other, 0) < 0.1 * ranks[rank]["read"][own], ranks[rank]["read"]
    assert ranks[0]["problems"] == [], "rank 0 does not read rank 1's shard"
    assert ranks[1]["problems"] == ["__1_0.distcp does not match its checksum"]
    assert all(r["step"] == 20 and r["weights_of_20"] for r in ranks), "both ranks resumed from step 20"
    assert all(r["objective"] == {"rollout_of": 20} for r in ranks), "with the objective's state of that step"


class _Planted:
    """What a forged .metadata holds: unpickling it runs code (here: creates a marker file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_forged_metadata_with_valid_plain_checksums_is_refused_before_it_is_unpickled(tmp_path):
    """Someone who can write the bucket replaces DCP's .metadata with a pickle that runs code, and rewrites the
    checksums so their sha256 are right: the checksums are not signed with the key, so the checkpoint is refused
    and nothing of it is unpickled."""
    import hashlib
    import pickle

    folder = fake_checkpoint(tmp_path, "checkpoint_000003", 30)
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    for rank in range(2):  # the forger's checksums: right sha256, the format kept, no key
        path = folder / f"checksums_rank{rank}.json"
        listed = json.loads(path.read_text())
        for name, entry in listed["files"].items():
            data = (folder / name).read_bytes()
            entry.update(size=len(data), sha256=[hashlib.sha256(data[i:i + CHUNK]).hexdigest()
                                                 for i in range(0, len(data), CHUNK)])
        listed["hmac"] = hashlib.sha256(json.dumps(listed["files"], sort_keys=True).encode()).hexdigest()
        path.write_text(json.dumps(listed))
    state = {"model": {"w": torch.zeros(2)}}
    found = problems(local(folder), state, 0, KEY)
    assert found and all("not signed with this machine's checkpoint key" in f for f in found), found
    assert not marker.exists(), "nothing was unpickled"
    assert problems(local(folder), None, 0, "the forger's guess") != []


@pytest.mark.parametrize("world", [0, None, "2", True, -1])
def test_a_train_state_that_names_no_writers_cannot_skip_the_checks(tmp_path, world):
    """The signed checksums are left alone and .metadata replaced by a code-running pickle; train_state.json (read
    before it is verified: it says how many writers there were) is made to name no writer, so that no checksum would
    be read and nothing checked: refused before .metadata is unpickled."""
    import pickle

    folder = fake_checkpoint(tmp_path, "checkpoint_000003", 30)
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    state = json.loads((folder / TRAIN_STATE).read_text())
    if world is None:
        del state["world_size"]
    else:
        state["world_size"] = world
    (folder / TRAIN_STATE).write_text(json.dumps(state))
    found = problems(local(folder), {"model": {"w": torch.zeros(2)}}, 0, KEY)
    assert found and "is not a count of ranks" in found[0], found
    assert not marker.exists(), "nothing was unpickled"


def test_metadata_without_a_signed_checksum_is_not_read(tmp_path):
    """Every writer's checksums signed, but none lists .metadata (a forger dropped it from a manifest it could not
    re-sign: impossible; or a writer that never listed it): refused, not read unchecked."""
    import pickle

    folder = fake_checkpoint(tmp_path, "checkpoint_000003", 30)
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    for rank in range(2):  # re-signed with the key, .metadata left out: what the check must not take as enough
        path = folder / f"checksums_rank{rank}.json"
        listed = json.loads(path.read_text())
        listed["files"].pop(".metadata", None)
        listed["hmac"] = checkpoint_sign(KEY, listed["files"])
        path.write_text(json.dumps(listed))
    found = problems(local(folder), {"model": {"w": torch.zeros(2)}}, 0, KEY)
    assert found == [".metadata has no checksum"], found
    assert not marker.exists()


def test_an_objective_state_that_no_writer_signed_is_not_read(tmp_path):
    """A rollout planted as the objective's state of a checkpoint whose writers kept none: training data someone
    who can write the bucket chose. The checkpoint is refused, not resumed on it."""
    folder = fake_checkpoint(tmp_path, "checkpoint_000003", 30)
    (folder / checkpoint.OBJECTIVE_STATE).write_text(json.dumps({"rollout": "planted"}))
    found = problems(local(folder), {"model": {"w": torch.zeros(2)}}, 0, KEY)
    assert found == [f"{checkpoint.OBJECTIVE_STATE} has no checksum"], found


def _save_in_background(rank: int, world: int, port: int, root: str, out: str) -> None:
    """Two FSDP2 ranks start a background save, take an optimizer step while it is written, then finish it; both
    restore it into a new model and optimizer."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard
    from ray.train import Checkpoint

    from amalia_ray.train import checkpoint

    def built():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(model, optimizer):
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    import threading

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    released, write = threading.Event(), FileSystemWriter.write_data

    def held_back(self, plan, planner):  # DCP's thread writes only once the next step has changed the weights
        assert released.wait(60), "the main thread never released the write"
        return write(self, plan, planner)

    FileSystemWriter.write_data = held_back
    model, optimizer = built()
    step(model, optimizer)
    saved = [p.full_tensor().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].full_tensor().clone() for p in model.parameters()]
    mine = Path(root) / f"checkpoint_1-rank{rank}"  # each rank's own folder, gathered after, as Ray Train does
    group = dist.new_group(backend="gloo")
    pending = checkpoint.BackgroundSave(mine, model, optimizer, {"step": 1}, KEY, group)
    step(model, optimizer)  # while the write waits (collectives on the default group beside the save's own)
    unwritten = not any(mine.glob("*.distcp"))
    released.set()
    seconds = pending.finish()
    folder = _gathered(Path(root), "checkpoint_1", rank, world)
    fresh, fresh_optimizer = built()
    train_state = checkpoint.restore([Checkpoint.from_directory(str(folder))], fresh, fresh_optimizer,
                                     torch.device("cpu"), KEY)
    restored = [p.full_tensor() for p in fresh.parameters()]
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "step": train_state["step"], "seconds": seconds, "unwritten_during_the_step": unwritten,
        "weights_saved": all(torch.equal(a, b) for a, b in zip(restored, saved)),
        "moments_saved": all(torch.equal(optimizer_state, m) for optimizer_state, m in zip(
            [fresh_optimizer.state[p]["exp_avg"].full_tensor() for p in fresh.parameters()], moments)),
        "moved_on": not any(torch.equal(a, b) for a, b in zip([p.full_tensor() for p in model.parameters()], saved)),
        "files": sorted(f.name for f in folder.iterdir())}))
    dist.destroy_process_group()


def test_a_checkpoint_written_in_the_background_holds_the_step_it_was_taken_at(tmp_path):
    """DCP's async_save through BackgroundSave: the shard's write is held back until the next optimizer step has
    changed the weights, yet what is restored is the weights and AdamW moments of the step the save was started at
    (the staged copy), with its checksums signed so that `restore` accepts it."""
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_save_in_background, args=(2, free_port(), str(tmp_path / "ckpt"), str(out)), nprocs=2)
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["unwritten_during_the_step"], "the write was held back until the next step had run"
        assert got["step"] == 1 and got["weights_saved"] and got["moments_saved"] and got["moved_on"], got
        assert got["seconds"] > 0 and {"checksums_rank0.json", "checksums_rank1.json", ".metadata",
                                       "train_state.json"} <= set(got["files"]), got


def test_a_ranks_random_state_comes_back_as_saved_and_from_a_bare_host_state(tmp_path):
    """The file holds the host's generator and, on a GPU, the device's; it loads without unpickling code, and a
    checkpoint holding only the host's state (an earlier version's) still resumes it."""
    from amalia_ray.train.checkpoint import rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rng.pt")
    ahead = torch.rand(4)
    saved = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert set(saved) == ({"cpu", "cuda"} if torch.cuda.is_initialized() else {"cpu"})
    set_rng_state(saved)
    assert torch.equal(torch.rand(4), ahead)
    set_rng_state(saved["cpu"])
    assert torch.equal(torch.rand(4), ahead)


@pytest.mark.parametrize("manifest", [b"\xff\xfe not UTF-8", b'{"files": {}, "hmac": "\xc3\xa9"}', b"[" * 100_000,
                                      b'{"files": {"a": 1' + b"0" * 5000 + b'}, "hmac": "00"}'])
def test_a_damaged_checksums_file_makes_the_checkpoint_damaged_not_the_resume_fail(tmp_path, manifest):
    """Bit rot or a forger's bytes in a writer's checksums (not UTF-8, a hmac that is not ASCII, nesting past the
    parser's depth, a 5,000-digit number): the checkpoint is reported damaged (so a resume moves to an older one),
    instead of the check raising and failing every retry of the stage the same way."""
    folder = fake_checkpoint(tmp_path, "checkpoint_000003", 30)
    (folder / "checksums_rank1.json").write_bytes(manifest)
    found = problems(local(folder), {"model": {"w": torch.zeros(2)}}, 0, KEY)
    assert found == ["checksums of rank 1 are not signed with this machine's checkpoint key (AMALIA_CHECKPOINT_KEY): "
                     "written with another key, or forged"], found
