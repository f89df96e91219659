"""The rollout engine for on-policy RL: vLLM in its own Ray actor, with its engine in that process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the trainer's weights can be swapped in place before every generation.

A separate actor rather than vLLM inside a training worker: the training workers already own a torch.distributed
group that vLLM would try to join, and the actor can sit on any node of the cluster (on GPU clusters it takes a
GPU of its own, as TRL's server mode does)."""

from __future__ import annotations

import ray
import torch

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


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

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                 seed: int) -> list[list[list[int]]]:
        """For each prompt (token ids), `n` sampled completions (token ids, the stop token included)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed + i)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[list(c.token_ids) for c in out.outputs] for out in outputs]


def start_engine(model_dir: str, engine: dict, seed: int, use_gpu: bool):
    dtype = engine.get("dtype", "auto")
    if dtype == "auto":  # as training: bf16 on GPU, fp32 on CPU (faster there)
        dtype = "bfloat16" if use_gpu else "float32"
    actor = ray.remote(RolloutEngine).options(
        num_cpus=1, num_gpus=1 if use_gpu else 0,
        runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}},
    )
    return actor.remote(model_dir, dtype, engine["max_model_len"], engine["gpu_memory_utilization"],
                        engine["enforce_eager"], seed)


def hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training state dict under the names of the HF checkpoint (wrappers of activation checkpointing and
    torch.compile removed)."""
    out = {}
    for name, tensor in state.items():
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        out[name] = tensor
    return out
