"""One process at a time per stage of a run. Two `amalia run`s of one run name (or a run and a stage job) would
otherwise write the same outputs and checkpoints, delete each other's half-written files, and both record the stage
"completed". A stage is run under an exclusive `flock` on `<run>/.locks/<stage>.lock`, which names its holder; the
kernel drops it when the holder exits, however it exits, so a crash leaves no stale lock. Different stages of one
run still go side by side (per-stage jobs on a cluster). The lock is as wide as the run folder's filesystem: a
folder every node mounts (NFS, Lustre with flock) locks across them; two machines that share only `run.storage` (a
bucket) do not see each other's locks."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from amalia_ray.core.errors import AmaliaError

LOCKS = ".locks"


class StageBusy(AmaliaError):
    """Another process holds the stage."""


@contextmanager
def stage_lock(run_dir: Path, stage: str) -> Iterator[None]:
    path = run_dir / LOCKS / f"{stage}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StageBusy(f"stage '{stage}' of run '{run_dir.name}' is being run by another process "
                            f"({_holder(path)}): wait for it to finish, or stop it, then run again") from None
        except OSError as e:  # a filesystem without flock: run unlocked rather than not at all
            from amalia_ray.core.console import stage_line

            stage_line(stage, f"[yellow]unlocked[/]: {path.parent} does not support locks ({e.strerror})")
            yield
            return
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text())
        return f"process {who['pid']} on {who['host']}, since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
