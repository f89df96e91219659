"""A rollout engine: vLLM in its own Ray actor, with its engine in that process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
and the trainer's weights loaded into it in place, through vLLM's weight-update path, before every generation
(`weight_sync`); and the sizing and placement of each engine of the rollout fleet (`rollout_fleet`).

A separate actor rather than vLLM inside a training worker: the training workers already own a torch.distributed
group that vLLM would try to join. By default an engine is colocated: it runs on a training worker's node, reserves
nothing beyond the stage's workers and, on GPU, shares that worker's GPU, asleep (weights and KV cache released)
while the trainer steps, as TRL's and verl's colocated modes do. `placement: separate` gives it GPUs of its own."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import ray
import torch

from amalia_ray.core.config import ENGINE_MAX_SEQS, RolloutConfig

# beside its weights and KV cache, what a vLLM engine needs (CUDA context, activations, sampler) when sized for you
ENGINE_WORKSPACE_BYTES = 2 << 30
KV_SPARE_TOKENS = 512


class RolloutEngine:
    def __init__(self, model_dir: str, dtype: str, max_model_len: int, enforce_eager: bool, seed: int,
                 gpu_memory_utilization: float, kv_cache_memory_bytes: int | None, sleep: bool,
                 tensor_parallel: int = 1, max_num_seqs: int = ENGINE_MAX_SEQS):
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from amalia_ray.train.weight_sync import BACKEND, register

        register()
        kv = {"kv_cache_memory_bytes": kv_cache_memory_bytes} if kv_cache_memory_bytes else {}
        if not torch.cuda.is_available():
            # a request's seeded generator cannot be rewound on CPU when its prefill is split over two scheduler
            # steps, so prefills are never split there: completions then depend on their seeds only, not on how
            # prompts are batched or spread over engines
            kv |= {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}
        if tensor_parallel > 1:  # the engine's workers: Ray actors vLLM places on GPUs of their own
            kv |= {"tensor_parallel_size": tensor_parallel, "distributed_executor_backend": "ray"}
        # log-probabilities, when asked for, of the distribution sampled from (after the temperature): what an
        # off-policy step weighs its policy against
        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, seed=seed, enable_sleep_mode=sleep,
                       max_num_seqs=max_num_seqs,
                       logprobs_mode="processed_logprobs", weight_transfer_config=WeightTransferConfig(backend=BACKEND),
                       **kv)
        self.sleeps, self.asleep = sleep, False
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="weight-receive")
        self._receiving: Future | None = None

    def join_weight_group(self, info: dict) -> None:
        """Join the trainer's weight group (blocks until every member has joined)."""
        self.llm.init_weight_transfer_engine({"init_info": info})

    def sleep(self) -> None:
        """Release the weights and the KV cache (GPU, colocated): the trainer has the memory until the next push,
        which brings the weights back."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def begin_update(self) -> None:
        """Start receiving a weight stream: the engine's workers load each bucket the trainer broadcasts, on a
        long-lived thread (a fresh thread per update would take a fresh malloc arena each time and leave it
        holding the update's peak), while this actor stays free to be told the stream ended."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        self.llm.start_weight_update()
        self._receiving = self._loader.submit(self.llm.update_weights, {"update_info": {}})

    def receive_error(self) -> str | None:
        """Why the weight stream being received stopped, if it failed (the trainer would otherwise wait in its
        broadcast for a member that left)."""
        receiving = self._receiving
        if receiving is None or not receiving.done() or receiving.exception() is None:
            return None
        return f"{type(receiving.exception()).__name__}: {receiving.exception()}"

    def end_update(self) -> None:
        receiving, self._receiving = self._receiving, None
        if receiving.exception() is not None:
            raise RuntimeError(f"loading weights into the rollout engine failed: {receiving.exception()}") \
                from receiving.exception()
        self.llm.finish_weight_update()
        self.llm.reset_prefix_cache()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float,
                 logprobs: bool = False, seeds: list[int] | None = None
                 ) -> list[list[list[int]]] | list[list[tuple[list[int], list[float]]]]:
        """For each prompt (token ids), `n` sampled completions (token ids, the stop token included), with
        `logprobs` each as (ids, the log-probability of each id under the distribution it was drawn from). With
        `seeds` (one per prompt; its completions draw from seed, seed + 1, …) a prompt's completions depend on its
        seed alone, whichever engine samples it and beside whichever prompts; without, from the engine's seeded
        generator (the same for a fresh engine given the same calls)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("the rollout engine released its weights when it went to sleep: push weights first")
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature,
                                 logprobs=0 if logprobs else None, seed=seed)
                  for seed in (seeds if seeds is not None else [None] * len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        if not logprobs:
            return [[list(c.token_ids) for c in out.outputs] for out in outputs]
        return [[(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
                 for c in out.outputs] for out in outputs]


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


def this_worker(use_gpu: bool) -> tuple[str, str | None]:
    """(node id, the GPU this process uses as its node numbers them, or None): where a colocated engine goes. Ray
    shows a worker every GPU its node gives the stage's workers; torch's current device picks this one's."""
    node = ray.get_runtime_context().get_node_id()
    if not use_gpu:
        return node, None
    visible, index = os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device()
    return node, visible.split(",")[index] if visible else str(index)


# how long the sharded engines of a fleet wait, together, for nodes with their GPUs free: an autoscaler starting a GPU
# node (a p5.48xlarge booting and running its setup) takes ten minutes or more; and well within the training workers'
# collective timeout (Ray Train's 1,800 s), which the other ranks wait in while the first starts the fleet
ENGINE_PLACEMENT_TIMEOUT_S = 1200.0


def sharded_engine_groups(tensor_parallel: int, count: int, timeout_s: float = ENGINE_PLACEMENT_TIMEOUT_S) -> list:
    """The placement groups of `count` sharded engines, each a bundle for the engine's own process, then one per
    GPU, all on one node (STRICT_PACK). vLLM's Ray executor puts its workers in the GPU bundles of the group its
    process runs in, so an engine's GPUs are free ones of one node, and its process is on that node (vLLM picks its
    platform from the devices that process sees: on a CPU-only node it would plan GPU workers as CPU ones). Asked
    for at once and waited for together, so an autoscaler starts their nodes side by side."""
    from ray.util.placement_group import placement_group

    groups = [placement_group([{"CPU": 1}] + [{"GPU": 1}] * tensor_parallel, strategy="STRICT_PACK")
              for _ in range(count)]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=count, timeout=timeout_s)
    if len(ready) < count:
        remove_groups(groups)
        raise RuntimeError(f"rollout.tensor_parallel {tensor_parallel}: {count - len(ready)} of {count} engine(s) "
                           f"found no node with {tensor_parallel} GPUs free within {timeout_s:.0f} s (the training "
                           "workers hold theirs): use fewer or smaller engines, or a cluster with nodes of more GPUs")
    return groups


def remove_groups(groups: list) -> None:
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        remove_placement_group(group)


def start_engine(model_dir: str, cfg: RolloutConfig, seed: int, use_gpu: bool, sizing: dict | None = None,
                 beside: tuple[str, str | None] | None = None, group=None):
    """A rollout engine on `model_dir`. Colocated (the default), it is pinned to the node of the training worker
    `beside` (`this_worker()`; default: the calling one), takes no resource of its own and sees that worker's GPU.
    Separate, it holds `tensor_parallel` GPUs of its own: sharded on GPUs, those of its placement group `group`
    (`sharded_engine_groups`), its process in the group's first bundle. `sizing` (weights, KV per token, sequences
    per step, tokens per sequence, trainer bytes) sizes its memory when the recipe does not."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    colocated = cfg.placement == "colocated"
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if colocated:
        node, gpu = beside or this_worker(use_gpu)
        options = {"num_cpus": 0, "num_gpus": 0,
                   "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        if use_gpu:
            env["CUDA_VISIBLE_DEVICES"] = gpu
    else:  # sharded, vLLM places the engine's workers on GPUs of their own; the actor holds none
        options = {"num_cpus": 1, "num_gpus": int(use_gpu and cfg.tensor_parallel == 1)}
        if use_gpu and cfg.tensor_parallel > 1:
            if group is None:
                raise ValueError("a sharded engine on GPUs starts in a placement group of its GPUs "
                                 "(sharded_engine_groups)")
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    utilization, kv = cfg.gpu_memory_utilization, None
    if sizing is not None and not colocated:  # the trainer is not on the engine's GPU
        sizing = {**sizing, "trainer_bytes": 0}
    if utilization is None:
        if sizing is None:
            raise ValueError("rollout.gpu_memory_utilization is not set and the engine has no sizing to derive it")
        utilization, kv = engine_memory(max_model_len=cfg.max_model_len, **sizing, **device_memory(
            use_gpu and colocated))
    # a step's sequences at once, when known: no sampler or CUDA graphs sized for more than the engine is sent
    seqs = max(1, min(ENGINE_MAX_SEQS, sizing["sequences"])) if sizing is not None else ENGINE_MAX_SEQS
    actor = ray.remote(RolloutEngine).options(runtime_env={"env_vars": env}, **options)
    return actor.remote(model_dir, cfg.resolved_dtype(use_gpu), cfg.max_model_len, cfg.eager(use_gpu), seed,
                        utilization, kv, colocated and use_gpu, cfg.tensor_parallel, seqs)


def device_memory(this_gpu: bool) -> dict:
    """Free and total memory of this process's GPU, or of a GPU of the same kind (a separate engine's), or RAM."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"free": free if this_gpu else total, "total": total}
    import psutil

    mem = psutil.virtual_memory()
    return {"free": mem.available, "total": mem.total}
