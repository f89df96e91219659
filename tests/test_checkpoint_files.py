"""Checkpoint checksums: a truncated or corrupt checkpoint is detected and the newest intact one is used."""

import json
from pathlib import Path

from amalia_ray.train.checkpoint import TRAIN_STATE, intact, problems, write_checksums


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
        write_checksums(rank_dir, rank)
        for f in rank_dir.iterdir():
            f.rename(folder / f.name)
    return folder


def test_intact_checkpoint_passes(tmp_path):
    folder = fake_checkpoint(tmp_path, "checkpoint_000001", 20)
    assert problems(folder) == []
    assert intact(folder) == folder


def test_corrupt_truncated_or_partial_checkpoints_fall_back_to_the_newest_intact(tmp_path):
    old = fake_checkpoint(tmp_path, "checkpoint_000000", 10)
    mid = fake_checkpoint(tmp_path, "checkpoint_000001", 20)
    latest = fake_checkpoint(tmp_path, "checkpoint_000002", 30)
    (latest / "__1_0.distcp").write_bytes(b"\x01" * 10)  # truncated
    assert problems(latest) == ["__1_0.distcp does not match its checksum"]
    assert intact(latest) == mid
    (mid / "checksums_rank1.json").unlink()  # a rank's files never arrived
    assert "checksums of 1 of 2 ranks" in problems(mid)
    assert intact(latest) == old
    (old / TRAIN_STATE).unlink()
    assert intact(latest) is None


def test_a_failed_checkpoint_write_reaches_the_user_as_its_one_line():
    """Ray Train hands a worker's exception back wrapped (with its traceback as the text); the stage unwraps the
    checkpoint-write failure into the plain message."""
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from amalia_ray.core.errors import AmaliaError
    from amalia_ray.train.checkpoint import CheckpointWriteError
    from amalia_ray.train.stage import _plain

    wrapped = UserExceptionWithTraceback(CheckpointWriteError("[pretrain] the checkpoint of step 10 could not be "
                                                              "written (OSError: disk full)"), "Traceback …")
    plain = _plain(WorkerGroupError("Training failed", {0: wrapped, 1: wrapped}))
    assert isinstance(plain, AmaliaError) and str(plain).startswith("[pretrain] the checkpoint of step 10")
    other = WorkerGroupError("Training failed", {0: UserExceptionWithTraceback(ValueError("x"), "tb")})
    assert _plain(other) is other
    from ray.train import ControllerError

    as_text = ControllerError(RuntimeError("worker died: amalia_ray.train.checkpoint.CheckpointWriteError: [sft] the "
                                           "checkpoint of step 4 could not be written (OSError: EIO)\nmore"))
    assert str(_plain(as_text)) == "[sft] the checkpoint of step 4 could not be written (OSError: EIO)"
