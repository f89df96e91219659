"""Engine start: how long our Serve application takes from deploy to a first answered completion, with the LLM
deployment's node initialization skipped for a checkpoint served from its folder (what we deploy) against Ray Serve
LLM's default (a Ray task on the replica's node that fetches the model files, which for a folder only returns the
path). Same checkpoint, same engine settings, one local Ray, alternating rounds. Prints JSON.

    .venv/bin/python bench/serve_start.py [--checkpoint runs/demo/pretrain/hf] [--rounds 2]

The first start of the run also starts Serve and warms the page cache: it is measured but left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one_start(checkpoint: Path, port: int, skip_node_init: bool) -> float:
    from ray.llm._internal.common.callbacks.base import CallbackBase

    from amalia_ray.core.config import ServeConfig
    from amalia_ray.serve import app as serve_app
    from amalia_ray.serve import ingress

    ours = ingress.local_checkpoint_callback
    if not skip_node_init:
        ingress.local_checkpoint_callback = lambda: CallbackBase  # Ray Serve LLM's default
    cfg = ServeConfig(port=port, engine={"max_model_len": 512, "gpu_memory_utilization": 0.1})
    try:
        t0 = time.perf_counter()
        url = serve_app.start({"m": checkpoint}, cfg, use_gpu=False, name="bench-start").base_url
        r = httpx.post(f"{url}/completions", json={"model": "m", "prompt": "O Debian", "max_tokens": 4}, timeout=120)
        r.raise_for_status()
        return time.perf_counter() - t0
    finally:
        ingress.local_checkpoint_callback = ours
        serve_app.stop("bench-start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "runs/demo/pretrain/hf")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"no checkpoint at {args.checkpoint}: run `make demo` first or pass --checkpoint")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from tests.conftest import free_port

    ray.init(address="local", num_cpus=8, log_to_driver=False)
    port = free_port()
    warmup = one_start(args.checkpoint, port, True)
    times: dict[str, list[float]] = {"skipped": [], "ray_default": []}
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        for skip in order:
            times["skipped" if skip else "ray_default"].append(one_start(args.checkpoint, port, skip))
    ray.shutdown()
    skipped, default = statistics.median(times["skipped"]), statistics.median(times["ray_default"])
    print(json.dumps({
        "what": "deploy to first answered completion, one vLLM engine on CPU (fp32, enforce_eager)",
        "checkpoint": str(args.checkpoint), "rounds": args.rounds, "first_start_s": round(warmup, 1),
        "node_init_skipped_s": [round(t, 1) for t in times["skipped"]],
        "ray_default_s": [round(t, 1) for t in times["ray_default"]],
        "median_skipped_s": round(skipped, 1), "median_ray_default_s": round(default, 1),
        "saved_s": round(default - skipped, 1), "ratio_default_over_skipped": round(default / skipped, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
