"""Synthetic data from seed prompts with a served model, as a Ray Data step (DeepSeek-R1's "a few thousand seeds →
600k samples" by rejection sampling, at small scale): every seed prompt is sent `per_seed` times to a model behind an
OpenAI-compatible API (`n` samples per request); with a reward, only samples scoring at least `min_reward` are kept.
Rows come out as conversations an sft stage reads, with the seed, the generating model and the reward. A seed the
server refuses (400/413/422: e.g. a prompt over the model's context) goes to a quarantine file beside the output with
the server's message; the other seeds are still expanded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow as pa
import ray

from amalia_ray.core.errors import AmaliaError
from amalia_ray.core.formats.jsonl import checked_rows, line_id
from amalia_ray.core.formats.rl_tasks import validate_task
from amalia_ray.core.openai_client import OpenAIClient, RequestRejected
from amalia_ray.core.rewards import get_reward

SCHEMA = pa.schema([("id", pa.string()), ("seed_id", pa.string()), ("messages", pa.string()),
                    ("model", pa.string()), ("reward", pa.float64()), ("rejected", pa.string())])


def as_messages(prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


class ExpandSeeds:
    """Ray Data callable class: one HTTP client per actor, requests of a batch in flight together."""

    def __init__(self, base_url: str, model: str, per_seed: int, temperature: float, max_tokens: int,
                 reward: str | None, min_reward: float, concurrency: int, timeout_s: float,
                 api_key: str | None = None):
        self.args = (base_url, model, concurrency, timeout_s, api_key)
        self.per_seed, self.temperature, self.max_tokens = per_seed, temperature, max_tokens
        self.reward, self.min_reward = (get_reward(reward) if reward else None), min_reward

    def __call__(self, batch: pa.Table) -> pa.Table:
        return asyncio.run(self._expand(batch.to_pylist()))

    async def _expand(self, seeds: list[dict]) -> pa.Table:
        import json

        base_url, model, concurrency, timeout_s, api_key = self.args
        async with OpenAIClient(base_url, model, concurrency=concurrency, timeout_s=timeout_s,
                                api_key=api_key) as client:
            async def ask(seed: dict) -> dict:
                try:
                    return await client.post("/chat/completions", {
                        "messages": as_messages(json.loads(seed["prompt"])), "n": self.per_seed,
                        "temperature": self.temperature, "max_tokens": self.max_tokens})
                except RequestRejected as e:
                    return {"rejected": str(e)}

            answers = await asyncio.gather(*(ask(seed) for seed in seeds))
        rows = []
        for seed, answer in zip(seeds, answers):
            if "rejected" in answer:
                rows.append({"id": seed["id"], "seed_id": seed["id"], "messages": seed["prompt"], "model": model,
                             "reward": None, "rejected": answer["rejected"]})
                continue
            task = {**seed, "prompt": json.loads(seed["prompt"])}
            for k, choice in enumerate(answer.get("choices", [])):
                text = (choice.get("message") or {}).get("content") or ""
                score = self.reward(text, task) if self.reward else None
                if not text.strip() or (score is not None and score < self.min_reward):
                    continue
                messages = as_messages(task["prompt"]) + [{"role": "assistant", "content": text}]
                rows.append({"id": f"{seed['id']}-s{k}", "seed_id": seed["id"], "messages": json.dumps(
                    messages, ensure_ascii=False), "model": model, "reward": score, "rejected": None})
        return pa.Table.from_pylist(rows, schema=SCHEMA)


def synthesize(seeds: Path, output: Path, *, base_url: str, model: str, per_seed: int = 4, temperature: float = 1.0,
               max_tokens: int = 256, reward: str | None = None, min_reward: float = 1.0, concurrency: int = 8,
               actors: int = 2, batch_size: int = 16, timeout_s: float = 300, api_key: str | None = None) -> dict:
    """seeds jsonl ({id?, prompt, answer?, …}) -> OUTPUT jsonl of {id, seed_id, messages, model, reward}; stats.
    Seeds the server refused: OUTPUT with `.rejected.jsonl` for its suffix ({seed_id, prompt, error})."""
    import json

    if not seeds.exists():
        raise AmaliaError(f"seed file not found: {seeds}")
    rows = []
    try:
        for f, n, row in checked_rows(seeds, "seed prompts", validate_task):
            # nested fields travel as JSON text so every row has one Arrow schema
            rows.append({**{k: json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v
                            for k, v in row.items()}, "id": str(row.get("id", line_id(seeds, f, n))),
                         "prompt": json.dumps(row["prompt"], ensure_ascii=False)})
    except ValueError as e:
        raise AmaliaError(str(e)) from None
    columns = list(dict.fromkeys(k for row in rows for k in row))  # seeds may differ in their fields: one schema
    rows = [{k: row.get(k) for k in columns} for row in rows]
    expanded = ray.data.from_items(rows).map_batches(
        ExpandSeeds, fn_constructor_args=(base_url, model, per_seed, temperature, max_tokens, reward, min_reward,
                                          concurrency, timeout_s, api_key),
        batch_size=batch_size, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=0.5)
    table = pa.concat_tables([t for t in ray.get(expanded.to_arrow_refs())] or [SCHEMA.empty_table()])
    everything = sorted(table.to_pylist(), key=lambda r: r["id"])
    kept = [r for r in everything if r["rejected"] is None]
    refused = [r for r in everything if r["rejected"] is not None]
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as f:
        for row in kept:
            row.pop("rejected")
            f.write(json.dumps({**row, "messages": json.loads(row["messages"])}, ensure_ascii=False) + "\n")
    quarantine = output.with_suffix(".rejected.jsonl")
    quarantine.unlink(missing_ok=True)
    if refused:
        with quarantine.open("w", encoding="utf-8") as f:
            for row in refused:
                f.write(json.dumps({"seed_id": row["seed_id"], "prompt": json.loads(row["messages"]),
                                    "error": row["rejected"]}, ensure_ascii=False) + "\n")
    sampled = (len(rows) - len(refused)) * per_seed
    return {"seeds": len(rows), "sampled": sampled, "kept": len(kept),
            "kept_fraction": len(kept) / sampled if sampled else 0.0, "rejected_seeds": len(refused),
            **({"rejected_file": str(quarantine)} if refused else {})}
