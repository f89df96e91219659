"""On-policy sampling (GRPO's rollouts, on-policy DPO's candidates) on a fleet of vLLM engines (`rollout.engines`):
each rollout's prompts split into contiguous shares, one per engine, sampled at once and gathered back in prompt
order. Every prompt samples with its own seed, drawn from the stage's seed and the prompt's position in the
stage's stream of prompts (which the checkpoint keeps), so what it samples does not hang on which engine sampled it
or beside which prompts.

The trainer's weights reach every engine in one collective broadcast from the first training worker
(`weight_sync`): each sharded tensor is gathered on every rank, and rank 0 casts it to the engines' dtype (on its
GPU when it has one) and copies it into a bucket, sent (by a thread of its own) while the next fills."""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from amalia_ray.core.config import RolloutConfig
from amalia_ray.train.parallel import rank0_group
from amalia_ray.train.reward_scoring import RewardScorer
from amalia_ray.train.rollout import (kv_bytes_per_token, remove_groups, sharded_engine_groups, start_engine,
                                      this_worker)
from amalia_ray.train.weight_sync import Bucket, WeightSender

log = logging.getLogger("amalia_ray.train")
# how much of the weights rank 0 holds at once while streaming them to the engines (two buckets are in flight)
PUSH_BUCKET_BYTES = 256 << 20
ENGINE_CHECK_S = 10.0  # while a broadcast waits, how often the engines are asked whether they still receive


def prompt_seeds(seed: int, first: int, count: int, n: int) -> list[int]:
    """The sampling seed of each of `count` prompts at positions first, first + 1, … of a stage's prompt stream
    (each prompt's `n` completions draw from seed, seed + 1, …, seed + n - 1)."""
    out = []
    for position in range(first, first + count):
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") % (2**62) // n * n)
    return out


def shares(count: int, parts: int) -> list[range]:
    """`count` items cut into `parts` contiguous runs as equal as can be (the first ones one longer), empty ones
    left out."""
    size, extra = divmod(count, parts)
    out, at = [], 0
    for i in range(parts):
        step = size + (i < extra)
        if step:
            out.append(range(at, at + step))
        at += step
    return out


def weight_transport(config: RolloutConfig, use_gpu: bool) -> str:
    """NCCL to engines on GPUs of their own; gloo otherwise: on CPU, and on GPU for colocated engines, which share a
    training worker's GPU (NCCL refuses two members of a group on one GPU), through the host."""
    return "nccl" if use_gpu and config.placement == "separate" else "gloo"


class RolloutFleet:
    """The engines of one stage, held by its first training worker, and the weight group joining them to it."""

    def __init__(self, engines: list, config: RolloutConfig, use_gpu: bool, weight_sync: bool = True,
                 groups: list | None = None):
        self.engines, self.config, self.groups = engines, config, list(groups or [])  # sharded engines' GPUs
        transport = weight_transport(config, use_gpu)
        self.sender = WeightSender(engines, config.tensor_parallel, transport) if weight_sync else None
        log.info(f"rollout fleet: {len(engines)} engine(s), {config.placement}"
                 + (f", weights broadcast over {transport}" if weight_sync else ""))
        self._sending = ThreadPoolExecutor(1, thread_name_prefix="weight-send")

    def submit(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, logprobs: bool,
               seeds: list[int]) -> list[tuple[range, ray.ObjectRef]]:
        """Ask every engine for its share of the prompts (`seeds`: one per prompt); `collect` gathers them."""
        return [(run, engine.generate.remote([prompts[i] for i in run], n, max_tokens, temperature, logprobs,
                                             [seeds[i] for i in run]))
                for engine, run in zip(self.engines, shares(len(prompts), len(self.engines)))]

    @staticmethod
    def collect(pending: list[tuple[range, ray.ObjectRef]]) -> list:
        """The completions of every prompt, in prompt order."""
        return [per_prompt for part in ray.get([ref for _, ref in pending]) for per_prompt in part]

    def sample(self, prompts, n, max_tokens, temperature, seeds, logprobs: bool = False) -> list:
        return self.collect(self.submit(prompts, n, max_tokens, temperature, logprobs, seeds))

    def sleep(self) -> None:
        ray.get([engine.sleep.remote() for engine in self.engines])

    def begin_update(self) -> None:
        ray.get([engine.begin_update.remote() for engine in self.engines])

    def send(self, bucket: Bucket) -> Future:
        return self._sending.submit(self.sender.send, bucket)

    def wait(self, sending: Future) -> None:
        """Until a broadcast is through, or an engine stopped receiving (then its error, not a broadcast that
        would wait for it until the group's timeout)."""
        while not wait_futures([sending], timeout=ENGINE_CHECK_S).done:
            errors = [e for e in ray.get([engine.receive_error.remote() for engine in self.engines]) if e]
            if errors:
                raise RuntimeError(f"loading weights into a rollout engine failed: {errors[0]}")
        sending.result()

    def end_update(self) -> None:
        self.wait(self._sending.submit(self.sender.end))
        ray.get([engine.end_update.remote() for engine in self.engines])

    def shutdown(self) -> None:
        for engine in self.engines:  # first: a send still waiting on an engine then fails instead of waiting
            ray.kill(engine)
        self._sending.shutdown(wait=False, cancel_futures=True)
        try:
            if self.sender is not None:
                self.sender.close()
        finally:
            remove_groups(self.groups)


def start_fleet(model_dir: str, config: RolloutConfig, seed: int, use_gpu: bool, sizing: dict | None,
                workers: list[tuple[str, str | None]], weight_sync: bool = True) -> RolloutFleet:
    """`config.engines` engines on `model_dir`, from the first training worker, joined to it for weight pushes
    unless `weight_sync` is off (they sample the weights they start with). Colocated, engine i runs beside training
    worker i of `workers` (in turn, when there are more engines than workers: on CPU only), each sized for its share
    of a step's sequences (of the weights and KV heads, its GPU's share under tensor parallelism)."""
    colocated, n = config.placement == "colocated", config.engines
    if colocated and use_gpu and n > len(workers):
        raise ValueError(f"rollout.engines {n} colocated on GPU needs as many training workers, each sharing its GPU "
                         f"with one engine; the stage has {len(workers)}: lower rollout.engines, or set "
                         "rollout.placement: separate")
    if config.tensor_parallel > 1 and not use_gpu:
        raise ValueError(f"rollout.tensor_parallel {config.tensor_parallel} shards engines over GPUs; on CPU each "
                         "engine runs whole: set it to 1")
    if sizing is not None:  # under tensor parallelism a GPU holds its share of the weights and of the KV heads,
        tp, sizing = config.tensor_parallel, dict(sizing)  # which vLLM replicates when there are fewer than GPUs
        kv_heads = sizing.pop("kv_heads", tp)
        # prompts are dealt out whole (`shares`): an engine samples all of a prompt's completions
        per_prompt = sizing.pop("per_prompt", 1)
        prompts = -(-sizing["sequences"] // per_prompt)
        sizing |= {"sequences": -(-prompts // n) * per_prompt, "weight_bytes": sizing["weight_bytes"] // tp,
                   "kv_per_token": sizing["kv_per_token"] * -(-kv_heads // tp) // kv_heads}
    engines = []
    groups = sharded_engine_groups(config.tensor_parallel, n) if use_gpu and config.tensor_parallel > 1 else []
    try:
        for i in range(n):
            engines.append(start_engine(model_dir, config, seed, use_gpu, sizing, beside=workers[i % len(workers)],
                                        group=groups[i] if groups else None))
        return RolloutFleet(engines, config, use_gpu, weight_sync, groups)
    except BaseException:
        for engine in engines:
            ray.kill(engine)
        remove_groups(groups)
        raise


def push_weights(model, fleet: RolloutFleet | None, dtype: torch.dtype, bucket_bytes: int = PUSH_BUCKET_BYTES) -> None:
    """Stream the model's current weights into every engine of the fleet, one tensor at a time in the engines'
    dtype: each sharded tensor is gathered on every rank (a collective: every rank calls this, rank 0 with the
    fleet), rank 0 copies it into a bucket of `bucket_bytes`, broadcast while the next fills. No rank ever holds the
    whole state. A model with LoRA adapters sends its merged weights (the engines serve the plain model), each layer
    merged on rank 0 once its base weight and adapters are in."""
    from torch.distributed.tensor import DTensor

    from amalia_ray.train.lora_merge import Merger, scalings
    from amalia_ray.train.weight_names import plain_name

    first = dist.get_rank() == 0
    if torch.cuda.is_available():  # what the trainer's allocator caches goes back before the engines wake beside it
        torch.cuda.empty_cache()
    began, failed = torch.ones(1), None
    if first:
        try:
            fleet.begin_update()
            device = fleet.sender.device
        except Exception as e:  # noqa: BLE001 - every rank must hear of it before the gathers below
            began[0], failed = 0, e
    if dist.get_world_size() > 1:
        dist.all_reduce(began, op=dist.ReduceOp.MIN)
    if not began.item():
        raise RuntimeError(f"the rollout engines could not start a weight update: {failed or 'see rank 0'}") \
            from failed
    merger = Merger(scalings(model))
    bucket, in_flight = None, None

    def flush():
        nonlocal bucket, in_flight
        if in_flight is not None:
            fleet.wait(in_flight)
        in_flight, bucket = fleet.send(bucket), None

    for name, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if first:
            for out_name, tensor in merger.feed(plain_name(name), full.detach()):
                cast = tensor.to(dtype if tensor.is_floating_point() else tensor.dtype)
                if bucket is not None and not bucket.fits(cast):
                    flush()
                if bucket is None:
                    bucket = Bucket(bucket_bytes, device)
                bucket.add(out_name, cast)  # copied into the bucket, across devices when it is on the host
                del cast
        del full
    if first:
        merger.close()
        if bucket is not None:
            flush()
        if in_flight is not None:
            fleet.wait(in_flight)
        fleet.end_update()


def encode_prompt(tok, prompt) -> list[int]:
    """Messages through the chat template with the generation prompt (as TRL); a string as it is."""
    if isinstance(prompt, list):
        rendered = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    return list(tok(prompt)["input_ids"])


def fleet_on_model(model, tokenizer_dir: Path, work_dir: Path, engine: RolloutConfig, seed: int, use_gpu: bool,
                   sequences: int, tokens_per_sequence: int, step_transient_bytes: int = 0,
                   weight_sync: bool = True, per_prompt: int = 1) -> RolloutFleet | None:
    """Export the model's current weights as a HF folder and start the fleet on it from rank 0 (a collective:
    every rank calls this, and tells rank 0 where it runs), sized for `sequences` of up to `tokens_per_sequence`
    tokens at once (`per_prompt` of them for each prompt), leaving each trainer its gradients, AdamW state and
    `step_transient_bytes` (a step's activations and the like, from `amalia plan`'s arithmetic); None on the other
    ranks."""
    from amalia_ray.train.hf_weights import export_hf

    init_dir = work_dir / "rollout-init"
    export_hf(model, model.config, init_dir, tokenizer_dir)
    # what this worker adds once it trains: gradients and two Adam moments of its shard of the weights
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    workers = [this_worker(use_gpu)]
    if dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, workers[0])
        workers = gathered
    if dist.get_rank() != 0:
        if dist.get_world_size() > 1:  # while rank 0 starts the fleet, past the step collectives' timeout
            dist.barrier(group=rank0_group())
        return None
    fleet = _start_on_rank0(model, init_dir, engine, seed, use_gpu, sequences, tokens_per_sequence,
                            step_transient_bytes, weight_sync, per_prompt, local, workers)
    if dist.get_world_size() > 1:
        dist.barrier(group=rank0_group())
    return fleet


def _start_on_rank0(model, init_dir: Path, engine: RolloutConfig, seed: int, use_gpu: bool, sequences: int,
                    tokens_per_sequence: int, step_transient_bytes: int, weight_sync: bool, per_prompt: int,
                    local: int, workers: list) -> RolloutFleet:
    dtype = getattr(torch, engine.resolved_dtype(use_gpu))
    numel = sum(p.numel() for p in model.parameters())
    text = getattr(model.config, "text_config", None) or model.config
    sizing = {"weight_bytes": numel * torch.finfo(dtype).bits // 8, "sequences": sequences, "per_prompt": per_prompt,
              "kv_per_token": kv_bytes_per_token(model.config, dtype), "tokens_per_sequence": tokens_per_sequence,
              "trainer_bytes": 12 * local + step_transient_bytes,
              "kv_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads}
    if use_gpu:
        torch.cuda.empty_cache()  # what the trainer's allocator caches is free for the engines
    return start_fleet(str(init_dir), engine, seed, use_gpu, sizing, workers, weight_sync)


def sample_and_score(fleet: RolloutFleet, tok, prompts: list[list[int]], tasks: list[dict], scorer: RewardScorer,
                     n: int, max_tokens: int, temperature: float, seed: int) -> tuple[list, torch.Tensor]:
    """`n` completions per prompt from the fleet (the prompts at positions 0, 1, … of the stage's stream), each
    scored by every reward -> ([(prompt, completion)], scores (completions, rewards), NaN where a judge gave no
    grade); completions of one prompt are consecutive."""
    sampled = fleet.sample(prompts, n, max_tokens, temperature, prompt_seeds(seed, 0, len(prompts), n))
    fleet.sleep()  # colocated on GPU: the memory is the trainer's again before it steps
    return score_completions(tok, prompts, tasks, sampled, scorer)


def score_completions(tok, prompts: list[list[int]], tasks: list[dict], sampled: list[list[list[int]]],
                      scorer: RewardScorer) -> tuple[list, torch.Tensor]:
    """The engines' completions of each prompt, each scored by every reward (see `sample_and_score`)."""
    items, texts, scored_tasks = [], [], []
    for prompt, task, completions in zip(prompts, tasks, sampled):
        for completion in completions:
            texts.append(tok.decode(completion, skip_special_tokens=True))
            scored_tasks.append(task)
            items.append((prompt, completion))
    return items, scorer.score([t["prompt"] for t in scored_tasks], texts, scored_tasks)
