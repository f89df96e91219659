"""On-policy sampling (GRPO's rollouts, on-policy DPO's candidates): task prompts, and the rollout engine — vLLM in
its own Ray actor, with its engine in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the trainer's weights can
be streamed into it in place before every generation — sampling completions that rule-based rewards score.

A separate actor rather than vLLM inside a training worker: the training workers already own a torch.distributed
group that vLLM would try to join. By default the actor is colocated: it runs on the first worker's node, reserves
nothing beyond the stage's workers and, on GPU, shares that worker's GPU, asleep (weights and KV cache released)
while the trainer steps, as TRL's and verl's colocated modes do. `placement: separate` gives it a GPU of its own."""

from __future__ import annotations

import os
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
import torch.distributed as dist

from amalia_ray.core.config import RolloutConfig
from amalia_ray.train.reward_scoring import RewardScorer

if TYPE_CHECKING:
    import numpy as np

# how much of the weights rank 0 holds at once while streaming them to the engine (two buckets are in flight)
PUSH_BUCKET_BYTES = 256 << 20
# beside its weights and KV cache, what a vLLM engine needs (CUDA context, activations, sampler) when sized for you
ENGINE_WORKSPACE_BYTES = 2 << 30
KV_SPARE_TOKENS = 512


class RolloutEngine:
    def __init__(self, model_dir: str, dtype: str, max_model_len: int, enforce_eager: bool, seed: int,
                 gpu_memory_utilization: float, kv_cache_memory_bytes: int | None, sleep: bool):
        from vllm import LLM

        kv = {"kv_cache_memory_bytes": kv_cache_memory_bytes} if kv_cache_memory_bytes else {}
        # log-probabilities, when asked for, of the distribution sampled from (after the temperature): what an
        # off-policy step weighs its policy against
        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep_mode=sleep,
                       logprobs_mode="processed_logprobs", **kv)
        self.sleeps, self.asleep = sleep, False
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="weight-reload")
        self._updating: tuple[queue.Queue, Future] | None = None

    def sleep(self) -> None:
        """Release the weights and the KV cache (GPU, colocated): the trainer has the memory until the next push,
        which brings the weights back."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def begin_update(self) -> None:
        """Start loading weights in place through vLLM's reload path, fed bucket by bucket by `push`: one reload
        over the whole stream, so layers whose checkpoint tensors vLLM fuses (q/k/v, gate/up) are only processed
        once all their parts are in. The reload runs on one long-lived thread: a fresh thread per update would
        take a fresh malloc arena each time and leave it holding the update's peak."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        stream: queue.Queue = queue.Queue(maxsize=1)

        def weights():
            while (bucket := stream.get()) is not None:
                for name, dtype, array in bucket:
                    yield name, from_wire(array, dtype)

        # the worker's own reload (checkpoint-format HF names, loaded in place under the engine's config)
        self._updating = (stream, self._loader.submit(self.llm.collective_rpc, "reload_weights",
                                                      kwargs={"weights_iterator": weights()}))

    def push(self, bucket: list[tuple[str, str, "np.ndarray"]] | None) -> None:
        stream, done = self._updating
        while not done.done():
            try:
                stream.put(bucket, timeout=1.0)
                return
            except queue.Full:
                continue
        raise RuntimeError(f"loading weights into the rollout engine failed: {done.exception()}")

    def end_update(self) -> None:
        self.push(None)
        stream, done = self._updating
        self._updating = None
        if done.exception() is not None:
            raise RuntimeError(f"loading weights into the rollout engine failed: {done.exception()}") \
                from done.exception()
        self.llm.reset_prefix_cache()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                 logprobs: bool = False) -> list[list[list[int]]] | list[list[tuple[list[int], list[float]]]]:
        """For each prompt (token ids), `n` sampled completions (token ids, the stop token included), with
        `logprobs` each as (ids, the log-probability of each id under the distribution it was drawn from). Sampling
        draws from the engine's seeded generator, so a fresh engine given the same calls samples the same; no
        per-request seed: vLLM on CPU cannot rewind a request's own generator when the scheduler splits its
        prefill."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("the rollout engine released its weights when it went to sleep: push weights first")
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0 if logprobs else None)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        if not logprobs:
            return [[list(c.token_ids) for c in out.outputs] for out in outputs]
        return [[(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                 for c in out.outputs] for out in outputs]


def to_wire(tensor: torch.Tensor) -> tuple[str, "np.ndarray"]:
    """A host tensor as (dtype, numpy array): Ray writes numpy arrays straight into its object store and the engine
    reads them there without a copy of its own (bf16, which numpy lacks, travels as its 16-bit pattern)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return dtype, tensor.numpy()


def from_wire(array: "np.ndarray", dtype: str) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # a read-only view into the object store: vLLM only copies from it
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """K and V of every layer for one token (full attention everywhere: an upper bound for sliding-window models)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def engine_memory(weight_bytes: int, kv_per_token: int, sequences: int, tokens_per_sequence: int,
                  max_model_len: int, free: int, total: int, trainer_bytes: int = 0) -> tuple[float, int]:
    """(gpu_memory_utilization, kv_cache_memory_bytes) for an engine sized to its model: the KV cache of all of a
    step's sequences at once when that fits in what the device has free (less what the trainer will still add),
    else as much as fits, never less than one sequence of max_model_len. vLLM reads the share of the device's
    memory (RAM on CPU) as what it may take, and checks it is free when it starts."""
    budget = int(0.9 * free) - trainer_bytes - weight_bytes - ENGINE_WORKSPACE_BYTES
    spare = KV_SPARE_TOKENS * kv_per_token  # vLLM's null block and each sequence's partly filled last block
    least = kv_per_token * max_model_len + spare
    if budget < least:
        raise ValueError(
            f"the rollout engine does not fit beside the training worker: its weights take "
            f"{weight_bytes / 2**30:.1f} GiB and one sequence of {max_model_len} tokens {least / 2**30:.2f} GiB of KV "
            f"cache, with {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free; use more workers (smaller shards), "
            f"a shorter seq_len or rollout.placement: separate")
    kv = max(least, min(budget, kv_per_token * sequences * tokens_per_sequence + spare))
    return min(1.0, (weight_bytes + kv + ENGINE_WORKSPACE_BYTES) / total), kv


def start_engine(model_dir: str, cfg: RolloutConfig, seed: int, use_gpu: bool, sizing: dict | None = None):
    """The rollout engine on `model_dir`. Colocated (the default), it is pinned to this process's node, takes no
    resource of its own and sees this process's GPU; call it from the first training worker. `sizing` (weights,
    KV per token, sequences per step, tokens per sequence, trainer bytes) sizes its memory when the recipe does not."""
    colocated = cfg.placement == "colocated"
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if colocated:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = {"num_cpus": 0, "num_gpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)}
        if use_gpu:  # this worker's own GPU: Ray shows a worker every GPU its node gives the stage's workers
            visible, index = os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device()
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    else:
        options = {"num_cpus": 1, "num_gpus": 1 if use_gpu else 0}
    utilization, kv = cfg.gpu_memory_utilization, None
    if sizing is not None and not colocated:  # the trainer is not on the engine's GPU
        sizing = {**sizing, "trainer_bytes": 0}
    if utilization is None:
        if sizing is None:
            raise ValueError("rollout.gpu_memory_utilization is not set and the engine has no sizing to derive it")
        utilization, kv = engine_memory(max_model_len=cfg.max_model_len, **sizing, **device_memory(
            use_gpu and colocated))
    actor = ray.remote(RolloutEngine).options(runtime_env={"env_vars": env}, **options)
    return actor.remote(model_dir, cfg.resolved_dtype(use_gpu), cfg.max_model_len, cfg.enforce_eager, seed,
                        utilization, kv, colocated and use_gpu)


def device_memory(this_gpu: bool) -> dict:
    """Free and total memory of this process's GPU, or of a GPU of the same kind (a separate engine's), or RAM."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"free": free if this_gpu else total, "total": total}
    import psutil

    mem = psutil.virtual_memory()
    return {"free": mem.available, "total": mem.total}


def push_weights(model, engine, dtype: torch.dtype, bucket_bytes: int = PUSH_BUCKET_BYTES) -> None:
    """Stream the model's current weights into the running engine, one tensor at a time in the engine's dtype: each
    sharded tensor is gathered on every rank (a collective: every rank calls this), rank 0 casts it, copies it to
    the host and sends it on in buckets of `bucket_bytes`, one in flight while the next fills. No rank ever holds
    the whole state. A model with LoRA adapters sends its merged weights (the engine serves the plain model), each
    layer merged on rank 0 once its base weight and adapters are in."""
    from torch.distributed.tensor import DTensor

    from amalia_ray.train.lora_merge import Merger, scalings
    from amalia_ray.train.weight_names import plain_name

    first = dist.get_rank() == 0
    if torch.cuda.is_available():  # what the trainer's allocator caches goes back before the engine wakes beside it
        torch.cuda.empty_cache()
    if first:
        ray.get(engine.begin_update.remote())
    merger = Merger(scalings(model))
    bucket, size, in_flight = [], 0, None
    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if first:
            for out_name, tensor in merger.feed(plain_name(name), full.detach()):
                host = tensor.to("cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
                bucket.append((out_name, *to_wire(host)))
                size += host.nbytes
        del full
        if first and size >= bucket_bytes:
            if in_flight is not None:
                ray.get(in_flight)
            in_flight, bucket, size = engine.push.remote(bucket), [], 0
    if first:
        merger.close()
        if in_flight is not None:
            ray.get(in_flight)
        if bucket:
            ray.get(engine.push.remote(bucket))
        ray.get(engine.end_update.remote())


def encode_prompt(tok, prompt) -> list[int]:
    """Messages through the chat template with the generation prompt (as TRL); a string as it is."""
    if isinstance(prompt, list):
        rendered = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    return list(tok(prompt)["input_ids"])


def engine_on_model(model, tokenizer_dir: Path, work_dir: Path, engine: RolloutConfig, seed: int, use_gpu: bool,
                    sequences: int, tokens_per_sequence: int, step_transient_bytes: int = 0):
    """Export the model's current weights as a HF folder (a collective: every rank calls this) and start an engine
    on it from rank 0, sized for `sequences` of up to `tokens_per_sequence` tokens at once, leaving the trainer its
    gradients, AdamW state and `step_transient_bytes` (a step's activations and the like, from `amalia plan`'s
    arithmetic); None on the other ranks."""
    from amalia_ray.train.hf_weights import export_hf

    init_dir = work_dir / "rollout-init"
    export_hf(model, model.config, init_dir, tokenizer_dir)
    # what this worker adds once it trains: gradients and two Adam moments of its shard of the weights
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    if dist.get_world_size() > 1:
        dist.barrier()
    if dist.get_rank() != 0:
        return None
    dtype = getattr(torch, engine.resolved_dtype(use_gpu))
    numel = sum(p.numel() for p in model.parameters())
    sizing = {"weight_bytes": numel * torch.finfo(dtype).bits // 8, "sequences": sequences,
              "kv_per_token": kv_bytes_per_token(model.config, dtype), "tokens_per_sequence": tokens_per_sequence,
              "trainer_bytes": 12 * local + step_transient_bytes}
    if use_gpu:
        torch.cuda.empty_cache()  # what the trainer's allocator caches is free for the engine
    return start_engine(str(init_dir), engine, seed, use_gpu, sizing)


def sample_and_score(engine, tok, prompts: list[list[int]], tasks: list[dict], scorer: RewardScorer,
                     n: int, max_tokens: int, temperature: float) -> tuple[list, torch.Tensor]:
    """`n` completions per prompt from the engine, each scored by every reward -> ([(prompt, completion)], scores
    (completions, rewards), NaN where a judge gave no grade); completions of one prompt are consecutive."""
    sampled = ray.get(engine.generate.remote(prompts, n, max_tokens, temperature))
    ray.get(engine.sleep.remote())  # colocated on GPU: the memory is the trainer's again before it steps
    return score_completions(tok, prompts, tasks, sampled, scorer)


def score_completions(tok, prompts: list[list[int]], tasks: list[dict], sampled: list[list[list[int]]],
                      scorer: RewardScorer) -> tuple[list, torch.Tensor]:
    """The engine's completions of each prompt, each scored by every reward (see `sample_and_score`)."""
    items, texts, scored_tasks = [], [], []
    for prompt, task, completions in zip(prompts, tasks, sampled):
        for completion in completions:
            texts.append(tok.decode(completion, skip_special_tokens=True))
            scored_tasks.append(task)
            items.append((prompt, completion))
    return items, scorer.score([t["prompt"] for t in scored_tasks], texts, scored_tasks)
