"""Run one benchmark and keep what it printed: `python bench/run.py NAME SCRIPT [ARGS...]` runs
`python bench/SCRIPT ARGS`, and writes its JSON to bench/results/NAME.json with the exact command, the date and the
machine beside it (what docs/benchmarks.md quotes). `make bench` runs them all."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    memory = next((int(ln.split()[1]) // 2**20 for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "python": platform.python_version()}


def last_json(text: str):
    """The JSON document a benchmark prints last (libraries may print their own lines, dicts included, before it)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except json.JSONDecodeError:
                continue
    raise SystemExit(f"no JSON in the output:\n{text[-2000:]}")


def main() -> None:
    name, script, *args = sys.argv[1:]
    command = ["python", f"bench/{script}", *args]
    started = time.perf_counter()
    # as `make bench` runs it: without PYTHONDONTWRITEBYTECODE, which makes every process it starts (Ray workers,
    # the peers' own) compile torch, transformers and Ray from source again
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        sys.exit(f"{shlex.join(command)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = last_json(proc.stdout)
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": shlex.join(command), "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), "machine": machine(), "wall_s": round(time.perf_counter() - started, 1),
        "result": result}, indent=2) + "\n")
    print(f"{name}: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
