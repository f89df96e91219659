"""On-policy sampling (GRPO's rollouts, on-policy DPO's candidates): task prompts, and the rollout engine — vLLM in
its own Ray actor, with its engine in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the trainer's weights can
be swapped in place before every generation — sampling completions that rule-based rewards score.

A separate actor rather than vLLM inside a training worker: the training workers already own a torch.distributed
group that vLLM would try to join, and the actor can sit on any node of the cluster (on GPU clusters it takes a
GPU of its own, as TRL's server mode does)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import ray
import torch
import torch.distributed as dist

from amalia_ray.core.config import EngineConfig
from amalia_ray.core.storage import jsonl_rows


class RolloutEngine:
    def __init__(self, model_dir: str, dtype: str, max_model_len: int, gpu_memory_utilization: float,
                 enforce_eager: bool, seed: int):
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, seed=seed)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        def reload(worker, weights):  # runs in the vLLM worker: checkpoint-format (HF) names, loaded in place
            worker.model_runner.reload_weights(weights_iterator=iter(weights.items()))

        self.llm.collective_rpc(reload, args=(weights,))
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int,
                 temperature: float) -> list[list[list[int]]]:
        """For each prompt (token ids), `n` sampled completions (token ids, the stop token included). Sampling draws
        from the engine's seeded generator, so a fresh engine given the same calls samples the same; no per-request
        seed: vLLM on CPU cannot rewind a request's own generator when the scheduler splits its prefill."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def start_engine(model_dir: str, engine: dict, seed: int, use_gpu: bool):
    dtype = EngineConfig.model_validate(engine).resolved_dtype(use_gpu)
    actor = ray.remote(RolloutEngine).options(
        num_cpus=1, num_gpus=1 if use_gpu else 0,
        runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
    )
    return actor.remote(model_dir, dtype, engine["max_model_len"], engine["gpu_memory_utilization"],
                        engine["enforce_eager"], seed)


def hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training state dict under the names of the HF checkpoint (wrappers of activation checkpointing and
    torch.compile removed)."""
    from amalia_ray.train.hf_weights import plain_name

    return {plain_name(name): tensor for name, tensor in state.items()}


def read_tasks(path: Path) -> list[dict]:
    """jsonl file(s): a `prompt` (string, or {role, content} messages) and whatever the rewards read (`answer`…)."""
    rows = []
    for f, n, row in jsonl_rows(path, "task data"):
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ok = (isinstance(prompt, str) and prompt) or (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt))
        if not ok:
            raise ValueError(f"{f}:{n}: field 'prompt' must be a non-empty string or {{role, content}} messages")
        rows.append(row)
    if not rows:
        raise ValueError(f"no task in {path}")
    return rows


def encode_prompt(tok, prompt) -> list[int]:
    """Messages through the chat template with the generation prompt (as TRL); a string as it is."""
    if isinstance(prompt, list):
        rendered = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    return list(tok(prompt)["input_ids"])


def engine_on_model(model, tokenizer_dir: Path, work_dir: Path, engine: dict, seed: int, use_gpu: bool):
    """Export the model's current weights as a HF folder (a collective: every rank calls this) and start an engine
    on it from rank 0; None on the other ranks."""
    from amalia_ray.train.hf_weights import export_hf

    init_dir = work_dir / "rollout-init"
    export_hf(model, model.config, init_dir, tokenizer_dir)
    if dist.get_world_size() > 1:
        dist.barrier()
    return start_engine(str(init_dir), engine, seed, use_gpu) if dist.get_rank() == 0 else None


def sample_and_score(engine, tok, prompts: list[list[int]], tasks: list[dict], rewards: list[Callable],
                     n: int, max_tokens: int, temperature: float) -> tuple[list, torch.Tensor]:
    """`n` completions per prompt from the engine, each scored by every reward -> ([(prompt, completion)], scores
    (completions, rewards)); completions of one prompt are consecutive."""
    sampled = ray.get(engine.generate.remote(prompts, n, max_tokens, temperature))
    items, scores = [], []
    for prompt, task, completions in zip(prompts, tasks, sampled):
        for completion in completions:
            text = tok.decode(completion, skip_special_tokens=True)
            scores.append([float(fn(text, task)) for fn in rewards])
            items.append((prompt, completion))
    return items, torch.tensor(scores, dtype=torch.float32).reshape(len(items), len(rewards))
