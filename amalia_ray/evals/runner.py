"""Run evaluation tasks against an OpenAI-compatible endpoint and write one result JSON per task."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from amalia_ray.core.errors import NotImplementedYet
from amalia_ray.core.storage import write_json
from amalia_ray.core.openai_client import OpenAIClient
from amalia_ray.evals.loglik import evaluate_mc
from amalia_ray.evals.tasks import load_mc

KINDS = {"mc_loglik"}


def run_task(*, base_url: str, model: str, task_name: str, task_path: Path, kind: str, output: Path | None,
             limit: int | None = None, concurrency: int = 8, timeout_s: float = 120, retries: int = 3,
             api_key: str | None = None) -> dict:
    if kind not in KINDS:
        raise NotImplementedYet(f"evaluation task kind '{kind}'", 5)
    items = load_mc(task_path, limit)

    async def go():
        async with OpenAIClient(base_url, model, concurrency=concurrency, timeout_s=timeout_s, retries=retries,
                                api_key=api_key) as client:
            return await evaluate_mc(client, items)

    t0 = time.perf_counter()
    result = asyncio.run(go())
    result = {"task": task_name, "kind": kind, "model": model, "base_url": base_url, "task_path": str(task_path),
              "wall_time_s": time.perf_counter() - t0, **result}
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        write_json(output, result)
    return result
