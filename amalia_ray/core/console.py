"""One rich console for the whole program, so stage progress and errors look the same everywhere; and, for the
pipeline commands, a quiet terminal: everything else the process or its libraries write (Ray, Ray Data, Ray Train,
vLLM, transformers, warnings) goes to a log file in the run folder instead."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
LOG_FILE = "driver.log"


def figure(v: float) -> str:
    """A figure as the plan and reports print it: whole above 100 (with thousands separators), else 3 significant
    digits."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def stage_line(stage: str, message: str) -> None:
    console.print(f"[bold cyan]{stage:>10}[/] {message}")


@contextmanager
def quiet_output(log_dir: Path) -> Iterator[Path]:
    """Send this process's standard output and error (file descriptors 1 and 2, so C++ and child-process writes too)
    to `log_dir/driver.log`; only the two consoles above keep writing to the terminal. Yields the log's path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / LOG_FILE
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal_out = os.fdopen(os.dup(saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
    terminal_err = os.fdopen(os.dup(saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
    previous = console._file, err_console._file
    console.file, err_console.file = terminal_out, terminal_err
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(log_fd, 0o600)  # what the libraries print may quote anything: the owner reads it, no one else
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        console._file, err_console._file = previous
        terminal_out.close()
        terminal_err.close()


def warnings_in(log: Path, since: int = 0) -> int:
    """Lines of the log (from byte `since`) that report a warning or an error."""
    try:
        with log.open("rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return 0
    return len(re.findall(r"(?m)^.*(\bWARN(ING)?\b|\bERROR\b|(Warning|Error)\b)", text))


@contextmanager
def activity(name: str, every_s: float = 30.0) -> Iterator[None]:
    """A live spinner with the elapsed time while a stage without a progress bar of its own runs; on a terminal-less
    output (a log, CI) a line every `every_s` seconds instead."""
    import threading
    import time

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if console.is_terminal:
        # redirect_*: rich would otherwise route sys.stdout/stderr (Ray's streamed worker logs) to the terminal
        with Progress(SpinnerColumn(), TextColumn(f"[bold cyan]{name:>10}[/] running"), TimeElapsedColumn(),
                      console=console, transient=True, redirect_stdout=False, redirect_stderr=False) as progress:
            progress.add_task(name, total=None)
            yield
        return
    start, stop = time.monotonic(), threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            stage_line(name, f"running ({time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
