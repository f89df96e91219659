"""Stopping a run on purpose, at a checkpoint, to carry it on later: what a batch system's time limit needs.

A scheduler warns a job before its time is up (Slurm: `--signal=B:USR1@120`). The driver turns that signal into a
file in the run folder; the training workers look for it after every step, and when it is there they save a
checkpoint at once and end the stage early (every rank at the same step: the flag travels with the step's
all-reduce). The stage is recorded as `stopped`, no later stage starts, and the next `amalia run` of the same recipe
(the next job of the chain) resumes from that checkpoint. The file lives in the run folder, so workers on other nodes
see it where the run folder is shared (which a multi-node Slurm run needs anyway)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path

from amalia_ray.core.errors import AmaliaError

STOP_FILE = "stop_requested"
STOP_SIGNALS = (signal.SIGUSR1,)
EXIT_STOPPED = 75  # EX_TEMPFAIL: not done, run again to carry on


class StageStopped(AmaliaError):
    """A stage ended early because a stop was requested; its checkpoint is where the next run resumes."""


def stop_file(run_dir: Path) -> Path:
    return Path(run_dir) / STOP_FILE


def request_stop(run_dir: Path, reason: str) -> None:
    path = stop_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason + "\n")


def stop_requested(run_dir: Path) -> str | None:
    """Why a stop was requested, or None."""
    path = stop_file(run_dir)
    try:
        return path.read_text().strip() or "stop requested"
    except FileNotFoundError:
        return None


def clear_stop(run_dir: Path) -> None:
    stop_file(run_dir).unlink(missing_ok=True)


@contextmanager
def stop_on_signals(run_dir: Path, signals=STOP_SIGNALS):
    """While inside: each of `signals` requests a stop of the run in `run_dir` (main thread only, as Python's
    signal handlers are; elsewhere it does nothing). The handlers in place before are put back on the way out."""
    def handler(signum, _frame):
        request_stop(run_dir, f"{signal.Signals(signum).name} received (a batch system's time limit is near)")

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
