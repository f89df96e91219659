"""A rich progress bar in the driver's terminal for a training stage, fed by the metrics.jsonl rank 0 appends (the
workers run elsewhere in the cluster; the file is the one thing both sides share)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from amalia_ray.core.console import console


class StageProgress:
    """A live bar on a terminal; elsewhere (a log, CI) a plain line at most every `line_every_s` seconds."""

    def __init__(self, name: str, metrics_path: Path, total_steps: int, poll_s: float = 0.5,
                 line_every_s: float = 10.0):
        self.metrics_path, self.poll_s = metrics_path, poll_s
        self.name, self.total, self.live = name, total_steps, console.is_terminal
        if not self.live:
            self.poll_s, self.last_line = line_every_s, None
        self.progress = Progress(
            TextColumn("[bold cyan]{task.description:>10}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]}"), TextColumn("MFU {task.fields[mfu]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
            redirect_stdout=False, redirect_stderr=False,  # Ray's streamed worker logs stay where stdout points
        )
        self.task = self.progress.add_task(name, total=total_steps, loss="-", speed="", mfu="-")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> StageProgress:
        if self.live:
            self.progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._update()
        if self.live:
            self.progress.stop()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._update()

    def _update(self) -> None:
        last = _last_record(self.metrics_path)
        if last and not self.live:
            if last["step"] != self.last_line:
                self.last_line = last["step"]
                console.print(f"[bold cyan]{self.name:>10}[/] step {last['step']}/{self.total} loss {last['loss']:.4f} "
                              f"{last.get('tokens_per_s', 0):,.0f} tok/s MFU {last.get('mfu', 0):.0%}")
            return
        if last:
            self.progress.update(self.task, completed=last["step"], loss=f"{last['loss']:.4f}",
                                 speed=f"{last.get('tokens_per_s', 0):,.0f} tok/s", mfu=f"{last.get('mfu', 0):.0%}")


def _last_record(path: Path) -> dict | None:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError, IndexError):
        return None
