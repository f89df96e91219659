"""Serving overhead: the same checkpoint behind our Ray Serve application (ray.serve.llm + vLLM, with the API-key and
body-size guard) against a bare `vllm serve`, same engine settings, same load, in one run. Prints JSON.

    .venv/bin/python bench/serve_overhead.py [--checkpoint runs/demo/sft/hf] [--requests 96] [--concurrency 8]
        [--max-tokens 32] [--rounds 3]

Both servers run side by side and are measured in alternating rounds (the order flips each round), so a noisy
moment of this shared machine falls on both; only one is under load at a time. The load: real prompts (the Debian
FAQ's questions, European Portuguese) sent as /v1/completions with `max_tokens` new tokens (`ignore_eos`, so every
request generates the same count), `concurrency` in flight. Reported per server: requests/s, generated tokens/s, p50
and p99 latency (medians over rounds), and the ratio ours / bare (target >= 0.9 for throughput).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FAQ = Path("/usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz")


def prompts(n: int) -> list[str]:
    questions = []
    if FAQ.exists():
        text = gzip.open(FAQ, "rt", encoding="utf-8").read()
        questions = sorted({" ".join(q.split()) for q in re.findall(r"[A-ZÁÉÍÓÚ][^.?!\n]{15,120}\?", text)})
    questions = questions or ["O que é o Debian?"]
    return [questions[i % len(questions)] for i in range(n)]


async def load(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    latencies, tokens = [], 0

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(text: str) -> None:
            nonlocal tokens
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(f"{url}/completions", json={
                    "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                tokens += r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(t) for t in texts))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"wall_s": wall, "requests_per_s": len(texts) / wall, "tokens_per_s": tokens / wall,
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[min(len(latencies) - 1,
                                                                            int(0.99 * len(latencies)))]}


def wait_ready(url: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not come up")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "runs/demo/sft/hf")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ports", type=int, nargs=2, default=(8392, 8393))
    ap.add_argument("--gpu", action="store_true", help="both servers on this machine's GPU, 0.4 of its memory each")
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").exists():
        sys.exit(f"no HF checkpoint at {args.checkpoint}: run `make demo` first or pass --checkpoint")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.pop("AMALIA_API_KEY", None)

    import ray

    from amalia_ray.core.config import ServeConfig
    from amalia_ray.serve import app as serve_app

    # on GPU, eager in both (no CUDA graphs to capture: both engines start within the one-GPU check's time)
    cfg = ServeConfig(port=args.ports[0], **({"gpus_per_replica": 1, "engine": {"gpu_memory_utilization": 0.4,
                                                                                "enforce_eager": True}}
                                             if args.gpu else {}))
    engine = cfg.engine
    bare_url = f"http://127.0.0.1:{args.ports[1]}/v1"
    bare = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.checkpoint),
         "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(args.ports[1]),
         "--max-model-len", str(engine.max_model_len), "--gpu-memory-utilization", str(engine.memory_share(args.gpu)),
         "--dtype", engine.resolved_dtype(use_gpu=args.gpu), *(["--enforce-eager"] if engine.eager(args.gpu) else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        if args.gpu:  # one engine at a time on the GPU: each one's memory profiling would count the other's
            wait_ready(bare_url)
        ours_url = serve_app.start({"bench": args.checkpoint}, cfg, use_gpu=args.gpu, name="amalia-bench").base_url
        wait_ready(bare_url)
        texts = prompts(args.requests)
        servers = {"ray_serve": ours_url, "bare_vllm": bare_url}
        for url in servers.values():  # warm-up
            asyncio.run(load(url, "bench", texts[: args.concurrency * 2], args.concurrency, args.max_tokens))
        runs: dict[str, list[dict]] = {k: [] for k in servers}
        for r in range(args.rounds):
            for name in (list(servers) if r % 2 == 0 else list(reversed(servers))):
                runs[name].append(asyncio.run(load(servers[name], "bench", texts, args.concurrency,
                                                   args.max_tokens)))
    finally:
        serve_app.stop("amalia-bench")
        ray.shutdown()
        bare.terminate()
        bare.wait(timeout=60)
    summary = {name: {k: round(statistics.median(run[k] for run in rs), 4) for k in rs[0]} for name, rs in runs.items()}
    ours, theirs = summary["ray_serve"], summary["bare_vllm"]
    print(json.dumps({
        "benchmark": "serve_overhead", "checkpoint": str(args.checkpoint), "requests": args.requests,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds, **summary,
        "throughput_ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
        "p50_ratio": round(ours["p50_s"] / theirs["p50_s"], 3), "p99_ratio": round(ours["p99_s"] / theirs["p99_s"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
