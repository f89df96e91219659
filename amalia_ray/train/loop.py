"""The one training loop, run by every Ray Train worker. Objectives decide batches and losses; this file decides
everything else: sharding, precision, accumulation, clipping, schedule, checkpoints, metrics, export.

In the order a worker runs them: `setup` (device, model, optimizer, objective, resume), then per step
`train_step`, `validation_losses` at checkpoint steps and `save_checkpoint`, and `export` at the end; `train_loop`
is that order and nothing else."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from amalia_ray.train import checkpoint, fabric, lora
from amalia_ray.train.hf_weights import export_hf
from amalia_ray.train.lr_schedule import lr_at
from amalia_ray.core.config import TrainStageConfig
from amalia_ray.core.flops import flops_per_token_of
from amalia_ray.core.formats.shards import fillers_per_step, micro_batches_per_rank
from amalia_ray.core.formats.step_metrics import keep_steps_through
from amalia_ray.train.train_metrics import TensorBoard, memory_gb, stated_peak
from amalia_ray.train.model import build, config_from_dict
from amalia_ray.train.objectives.base import Objective, StageInputs
from amalia_ray.train.objectives.registry import build_objective
from amalia_ray.train.parallel import (apply_fsdp, data_parallel_mesh, rank0_group, resolve_async_checkpoint,
                                       resolve_compile, resolve_precision, worker_device)

# Ray Train routes worker logging to the driver once; print() in a worker shows twice (tee + logger)
log = logging.getLogger("amalia_ray.train")


def local_micro_batches(rows: np.ndarray, micro: int, rank: int, world: int) -> list[tuple[np.ndarray, bool]]:
    """This rank's micro-batches of a step's rows, each with whether it is a filler. Every rank runs the same number
    of them (FSDP's all-gathers and reduce-scatters are collectives), of at most `micro` rows: the rows are dealt
    over accum × world slots as evenly as they go, so any number of workers takes any global batch whole. A slot
    left without a row gets a filler (a real row whose loss the loop zeroes), so the collectives still match."""
    accum = micro_batches_per_rank(len(rows), micro, world)
    slots = accum * world
    bounds = np.arange(slots + 1) * len(rows) // slots  # divisible: every slot `micro` rows, in order
    parts = [rows[bounds[a * world + rank]:bounds[a * world + rank + 1]] for a in range(accum)]
    return [(part, False) if len(part) else (rows[:1], True) for part in parts]


def accumulate_gradients(model, objective, passes: list[tuple[np.ndarray, bool]], device: torch.device,
                         sync_once: bool = False) -> tuple[float, int, int, dict]:
    """Forward and backward over this rank's micro-batches of a step: (sum of the losses, items, tokens, the
    objective's metrics as name: (sum, count)). A filler's loss is zeroed and its metrics dropped. `sync_once`:
    FSDP reduce-scatters the gradients after the last micro-batch only, holding them unsharded until then."""
    loss_sum, items, tokens, extra = torch.zeros((), dtype=torch.float64, device=device), 0, 0, {}
    for i, (micro_rows, filler) in enumerate(passes):
        if sync_once:
            model.set_requires_gradient_sync(i == len(passes) - 1)
        on_host = objective.batch(micro_rows)
        tokens += 0 if filler else _tokens_in(on_host)  # counted before the copy: no wait on the device
        batch = {k: v.to(device) for k, v in on_host.items()}
        if filler:  # its loss and metrics are no one's: keep the step's so far apart
            extra = _merged(extra, objective.take_metrics())
        micro_loss, n = objective.loss(model, batch)
        if filler:
            objective.take_metrics()
            micro_loss, n = micro_loss * 0.0, 0
        micro_loss.backward()
        loss_sum, items = loss_sum + micro_loss.detach().double(), items + n  # no host sync per micro-batch
    return loss_sum.item(), items, tokens, _merged(extra, objective.take_metrics())


def _merged(a: dict, b: dict) -> dict:
    """Objective metrics as (sum, count) pairs, added name by name."""
    return {k: tuple(x + y for x, y in zip(a.get(k, (0.0, 0)), b.get(k, (0.0, 0)))) for k in {**a, **b}}


def _all_reduce_sum(*values: float) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.SUM)


def _all_reduce(values, op) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _tokens_in(batch: dict) -> int:
    """Tokens of real text in a batch: padding excluded where the batch says what is padding (the `lengths` of
    packed rows, or an attention mask)."""
    if "lengths" in batch:
        return int(batch["lengths"].sum())
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def _log(path: Path, record: dict, keep_through: int | None = None) -> None:
    """Append a metrics line. On (re)start first drop the lines of steps after the checkpoint being resumed from
    (they are about to be trained again), so the file stays one history with every step once."""
    if keep_through is not None:
        keep_steps_through(path, keep_through)
    if record:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def validation_sample(rows: np.ndarray, limit: int | None, seed: int) -> np.ndarray:
    """At most `limit` of a group's validation rows (None: all): drawn from the run's seed, so every validation of
    the run, and of a resumed or rerun one, scores the same rows; in order, as they are read."""
    if limit is None or len(rows) <= limit:
        return rows
    return np.sort(np.random.default_rng(seed).choice(rows, limit, replace=False))


@torch.no_grad()
def validation_losses(model, objective, micro: int, rank: int, world: int, device: torch.device,
                      limit: int | None = None, seed: int = 0) -> tuple[float | None, dict[str, float]]:
    """Mean loss per item over the validation split, and per source when the objective groups its validation rows
    by source (packed pretraining data does): the data-mix ablations compare trials on these. At most `limit` rows
    of each group (`validation_sample`): a validation split is a share of the corpus, and scored whole at every
    checkpoint it would cost more than the training between two."""
    n = objective.num_validation()
    if n == 0:
        return None, {}
    groups = {name: validation_sample(rows, limit, seed) for name, rows in objective.validation_groups().items()}
    model.eval()
    sums: list[float] = []
    for rows_of_group in groups.values():
        mine = rows_of_group[rank::world]
        total, count = 0.0, 0
        # every rank runs the same number of forward passes: FSDP all-gathers are collectives
        for i in range(0, -(-len(rows_of_group) // world), micro):
            rows = mine[i:i + micro]
            batch = objective.batch(rows if len(rows) else rows_of_group[:micro], split="validation")
            loss_sum, ntok = objective.loss(model, {k: v.to(device) for k, v in batch.items()})
            if len(rows):
                total, count = total + loss_sum.item(), count + ntok
        sums += [total, count]
    model.train()
    sums = _all_reduce_sum(*sums)
    totals, counts = sums[0::2], sums[1::2]
    per_group = {name: t / c for name, t, c in zip(groups, totals, counts) if c and name}
    return sum(totals) / sum(counts), per_group if len(groups) > 1 else {}


@dataclass(frozen=True)
class LoopConfig:
    """What every worker of a training stage is given: the stage's own config, typed, and where this run of it reads
    and writes."""
    stage: TrainStageConfig
    hf_config: dict  # the transformers config of the model trained
    data_dir: Path  # the packed corpus, or the stage's dataset
    tokenizer_dir: Path
    stage_dir: Path  # metrics.jsonl, tensorboard/, the adapter, rollout exports
    export_dir: Path  # the HF checkpoint written at the end
    seed: int
    checkpoint_key: str = field(repr=False)  # signs the checkpoints' checksums; never printed
    trust_remote_code: bool = False
    init_hf_dir: Path | None = None  # the checkpoint the stage starts from; None: random weights
    new_token_ids: tuple[int, ...] = ()  # rows of an extended vocabulary, new in the starting checkpoint
    export_dtype: str | None = None  # the starting checkpoint's dtype, kept by the export
    generation_config: dict | None = None
    stop_file: Path | None = None  # when it appears: checkpoint now and stop (a batch job's time limit is near)
    step_transient: Callable[[int], int] | None = None  # see StageInputs
    reward_apps: dict[str, str] = field(default_factory=dict)  # see StageInputs
    judge_servers: dict[str, dict] = field(default_factory=dict)  # see StageInputs
    run_id: str = ""  # see StageInputs


@dataclass
class Training:
    """One worker's state between steps: what `setup` built and the loop carries."""
    run: LoopConfig
    rank: int
    world: int
    device: torch.device
    precision: str
    hf_config: object  # transformers' PretrainedConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    objective: Objective
    sampler: object  # the objective's MixtureSampler
    start_step: int
    resumed: bool
    peak_flops: float  # every worker's stated peak, summed: the ceiling MFU is against
    peak_basis: str
    flops_token: float
    nodes: list  # the node each worker landed on
    board: TensorBoard | None
    last_save_s: float | None = None  # how long the previous checkpoint took
    nccl_log: Path | None = None  # where NCCL says which network it uses (fabric.py)
    checkpoint_group: object = None  # background checkpoints' own gloo group; None: checkpoints are written in place
    pending: tuple | None = None  # (checkpoint.BackgroundSave, its folder, its step's record) while being written
    shard_size: int | None = None  # HSDP's shard group (None: FSDP over every rank)

    @property
    def stage(self) -> TrainStageConfig:
        return self.run.stage

    @property
    def metrics_path(self) -> Path:
        return self.run.stage_dir / "metrics.jsonl"


def setup(run: LoopConfig) -> Training:
    """Device and threads, the objective, the model (new from the seed, or the starting checkpoint read shard by
    shard into each rank) sharded with FSDP2, the optimizer, the objective's preparation on the initial weights,
    and the latest checkpoint restored with the sampler's read position."""
    import ray.train

    stage = run.stage
    rank, world = dist.get_rank(), dist.get_world_size()
    device = worker_device(ray.get_gpu_ids())
    nccl_log = fabric.capture_nccl_network(rank) if device.type == "cuda" else None  # before NCCL's first use
    torch.set_num_threads(stage.cpus_per_worker)
    precision = resolve_precision(stage.precision, device)
    init_dir = str(run.init_hf_dir) if run.init_hf_dir else None
    hf_config = config_from_dict(run.hf_config, run.trust_remote_code, source=init_dir)
    seq_len = stage.sequence_length or hf_config.max_position_embeddings
    objective = build_objective(stage, StageInputs(run.data_dir, run.tokenizer_dir, seq_len, run.stage_dir, run.seed,
                                                   device.type == "cuda", run.step_transient, run.reward_apps,
                                                   run.judge_servers, run.run_id))
    hf_config = objective.model_config(hf_config)
    # the ceiling MFU is against: every worker's stated peak (datasheet, else measured) in its precision, summed
    worker_peak, peak_basis = stated_peak(device, torch.bfloat16 if precision == "bf16" else torch.float32)
    peak_flops = _all_reduce_sum(worker_peak)[0]
    mesh = data_parallel_mesh(device.type, world, stage.shard_size)
    if world > 1:
        rank0_group()  # made now, with every rank here, for the waits on rank 0 later (a fleet's start)
    model = build(hf_config, device,
                  lambda m: apply_fsdp(m, precision, stage.activation_checkpointing,
                                       resolve_compile(stage.compile, device), stage.reduce_precision,
                                       sync_once=stage.gradient_sync == "last_micro_batch", mesh=mesh),
                  init_dir=run.init_hf_dir, seed=run.seed, trust_remote_code=run.trust_remote_code,
                  new_token_ids=list(run.new_token_ids), lora=stage.lora, head=objective.head)
    # everything but what LoRA freezes: the optimizer's state (and the checkpoints) hold only what trains
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=stage.lr,
                                  betas=stage.betas, weight_decay=stage.weight_decay)

    def frozen_copy(folder: Path):
        """A HF export built and sharded like the policy, without gradients (GRPO's KL reference)."""
        copy = build(hf_config, device, lambda m: apply_fsdp(m, precision, False, mesh=mesh), init_dir=folder,
                     seed=run.seed, trust_remote_code=run.trust_remote_code)
        return copy.requires_grad_(False).eval()

    objective.prepare(model, stage.micro_batch_size, rank, world, device, frozen_copy)  # before a restore
    sampler = objective.sampler(run.seed)
    start_step = 0
    resumed = ray.train.get_checkpoint()
    if resumed:
        reported = ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        train_state = checkpoint.restore(checkpoint.registered(resumed, reported), model, optimizer, device,
                                         run.checkpoint_key)
        start_step = train_state["step"]
        if "objective" in train_state:
            objective.load_state_dict(train_state["objective"])
        if "data" in train_state:
            sampler.load_state_dict(train_state["data"])
        else:  # a checkpoint from before the read position was saved: replay the draws (deterministic)
            for _ in range(start_step):
                sampler.next_rows(stage.global_batch_size)
    nodes: list = [None] * world  # where the workers landed, so the report can state the placement
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    return Training(run, rank, world, device, precision, hf_config, model, optimizer, objective, sampler, start_step,
                    bool(resumed), peak_flops, peak_basis,
                    flops_per_token_of(hf_config, seq_len, None if objective.head == "lm" else hf_config.num_labels),
                    nodes,
                    TensorBoard(run.stage_dir / "tensorboard", purge_step=start_step + 1) if rank == 0 else None,
                    nccl_log=nccl_log, checkpoint_group=dist.new_group(backend="gloo")
                    if resolve_async_checkpoint(stage.checkpoint_async, device) else None,
                    shard_size=mesh.shape[1] if mesh is not None else None)


def _announce(t: Training) -> None:
    """Rank 0, before the first step: the metrics file cut back to the step resumed from, and what the step's
    micro-batches cost in fillers, where a resume starts, and a resume with nothing left to train."""
    stage, gbs, micro = t.stage, t.stage.global_batch_size, t.stage.micro_batch_size
    _log(t.metrics_path, {}, keep_through=t.start_step)
    if fillers := fillers_per_step(gbs, micro, t.world):
        accum = micro_batches_per_rank(gbs, micro, t.world)
        log.info(f"[{stage.name}] {gbs} sequences a step over {t.world} workers: {accum} micro-batches of at "
                 f"most {micro} each, {fillers} of the {accum * t.world} passes fillers "
                 f"({fillers / (accum * t.world):.0%} of the step's compute)")
    if t.resumed:
        log.info(f"[{stage.name}] resumed from step {t.start_step}")
    if t.start_step >= stage.steps:
        log.warning(f"[{stage.name}] WARNING: resuming at step {t.start_step} of {stage.steps}: "
                    "zero steps left to train; raise steps to train further")


def train_step(t: Training, step: int) -> tuple[dict, bool]:
    """One optimizer step at index `step` (0-based): the learning rate, the objective's rows, forward and backward
    over this rank's micro-batches, gradients scaled to the mean over every item of the step, clipping, AdamW.
    Returns the step's record and whether any rank saw a stop requested."""
    stage = t.stage
    t0 = time.perf_counter()
    lr = lr_at(step, total=stage.steps, peak=stage.lr, warmup=stage.warmup_steps, schedule=stage.schedule,
               min_ratio=stage.min_lr_ratio, decay_fraction=stage.decay_fraction)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    rows = t.objective.step_rows(t.model, t.sampler, stage.global_batch_size)
    loss_sum, items, tokens, extra = accumulate_gradients(
        t.model, t.objective, local_micro_batches(rows, stage.micro_batch_size, t.rank, t.world), t.device,
        sync_once=stage.gradient_sync == "last_micro_batch")
    stop_path = t.run.stop_file if t.rank == 0 else None
    stop_seen = float(stop_path is not None and stop_path.exists())
    global_loss, global_items, global_tokens, stop_votes, *extra_sums = _all_reduce_sum(
        loss_sum, items, tokens, stop_seen, *(x for pair in extra.values() for x in pair))
    # FSDP averages gradients over ranks; rescale so they are the mean over every item (token, pair) of the step
    scale = t.world / global_items
    for p in t.model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    grad_norm = torch.nn.utils.clip_grad_norm_(t.model.parameters(), stage.grad_clip or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    memory = _all_reduce([memory_gb(t.device)], dist.ReduceOp.MAX)[0]
    objective_metrics = {k: extra_sums[2 * i] / extra_sums[2 * i + 1]
                         for i, k in enumerate(extra) if extra_sums[2 * i + 1]}
    record = {"step": step + 1, "loss": global_loss / global_items, "lr": lr, "grad_norm": float(grad_norm),
              **objective_metrics, "loss_items": int(global_items), "tokens": int(global_tokens),
              "tokens_per_s": global_tokens / elapsed, "step_time_s": elapsed,
              "mfu": t.flops_token * global_tokens / elapsed / t.peak_flops, "peak_tflops": t.peak_flops / 1e12,
              "peak_basis": t.peak_basis, "memory_gb": memory,
              "world_size": t.world, "worker_nodes": len(set(t.nodes)), "attempt_start_step": t.start_step,
              # how long the previous checkpoint took (a batch job is told to stop that much ahead, and more)
              **({"last_checkpoint_s": t.last_save_s} if t.last_save_s is not None else {})}
    return record, stop_votes > 0


def describe_collectives(t: Training) -> dict:
    """After an attempt's first step (NCCL has made its communicators): how the weights are sharded and the network
    the collectives ran over on each node, logged by rank 0, a fallback to TCP between nodes as a warning. A
    collective."""
    networks: list = [None] * t.world
    network = fabric.network_in(t.nccl_log)
    if t.nccl_log:
        t.nccl_log.unlink(missing_ok=True)  # read once: NCCL writes to it, unlinked, from here on
    dist.all_gather_object(networks, network)  # the nodes were gathered at setup
    transport, warning = fabric.describe(dist.get_backend(), list(zip(t.nodes, networks)))
    k = t.shard_size
    sharding = f"HSDP {t.world // k}×{k}" if k else f"FSDP over {t.world}"
    if t.rank == 0:
        log.info(f"[{t.stage.name}] {sharding}; collectives over {transport}")
        for problem in filter(None, (warning, fabric.shard_groups_across_nodes(t.nodes, k))):
            log.warning(f"[{t.stage.name}] {problem}")
    return {"sharding": sharding, "transport": transport}


def save_checkpoint(t: Training, record: dict, wait: bool) -> None:
    """The sharded checkpoint of the step just taken (DCP: model, optimizer, step, the sampler's read position, the
    objective's own state), reported to Ray Train with the step's record: written in place, or in the background
    when the stage writes checkpoints that way and `wait` is false (then reported by `finish_checkpoint` after the
    next step)."""
    finish_checkpoint(t)  # one still being written goes first: Ray Train registers them in order
    done = record["step"]
    folder = Path(tempfile.mkdtemp(prefix=f"amalia-checkpoint-{done}-"))
    train_state = {"step": done, "params": sum(p.numel() for p in t.model.parameters()),
                   "data": t.sampler.state_dict()}
    objective_state = t.objective.state_dict()  # a collective; text now, as the next step changes what it holds
    objective_state = json.dumps(objective_state, separators=(",", ":")) if objective_state and t.rank == 0 else ""
    with _writing(t, done, folder):
        if t.checkpoint_group is not None and not wait:
            t.pending = (checkpoint.BackgroundSave(folder, t.model, t.optimizer, train_state, t.run.checkpoint_key,
                                                   t.checkpoint_group, objective_state), folder, record)
            return
        saving = time.perf_counter()
        checkpoint.save(folder, t.model, t.optimizer, train_state, t.run.checkpoint_key, objective_state)
        _report_checkpoint(t, folder, record, time.perf_counter() - saving)


def finish_checkpoint(t: Training) -> None:
    """The checkpoint being written in the background, if any: waited for, completed and reported."""
    if t.pending is None:
        return
    save, folder, record = t.pending
    t.pending = None
    with _writing(t, record["step"], folder):
        _report_checkpoint(t, folder, record, save.finish())


def _report_checkpoint(t: Training, folder: Path, record: dict, written_s: float) -> None:
    import ray.train

    reporting = time.perf_counter()
    ray.train.report(record, checkpoint=ray.train.Checkpoint.from_directory(str(folder)))
    t.last_save_s = written_s + time.perf_counter() - reporting


@contextmanager
def _writing(t: Training, step: int, folder: Path):
    """A checkpoint's write: its local folder removed once reported (or failed, unless a background write still
    holds it); a write that fails says which checkpoints are intact."""
    try:
        yield
    except (OSError, CheckpointException) as e:  # DCP reports a failed write as CheckpointException
        raise checkpoint.CheckpointWriteError(
            f"[{t.stage.name}] the checkpoint of step {step} could not be written "
            f"({type(e).__name__}: {e}); the checkpoints before it are intact: free space or fix the "
            f"storage, then run again to resume from the latest of them") from e
    finally:
        if t.pending is None or t.pending[1] != folder:
            shutil.rmtree(folder, ignore_errors=True)


def _write_record(t: Training, record: dict, save_now: bool) -> None:
    """Rank 0: the step's record into metrics.jsonl and TensorBoard, and a log line every `log_every` steps."""
    stage = t.stage
    _log(t.metrics_path, record)
    t.board.write(record)
    if record["step"] % stage.log_every == 0 or save_now:
        val = f" val_loss {record['val_loss']:.4f}" if record.get("val_loss") is not None else ""
        log.info(f"[{stage.name}] step {record['step']}/{stage.steps} loss {record['loss']:.4f}{val} "
                 f"lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s "
                 f"MFU {record['mfu']:.0%}")


def export(t: Training) -> None:
    """The trained model as a HF checkpoint (what the next stage starts from and vLLM serves), or a LoRA stage's
    adapter folder and, with `merge`, the merged checkpoint; a collective, rank 0 writes."""
    run, stage = t.run, t.stage
    init_dir = str(run.init_hf_dir) if run.init_hf_dir else None
    if stage.lora:
        merged = run.export_dir if stage.lora.merge else None
        lora.export(t.model, t.hf_config, stage.lora, run.stage_dir / "adapter", merged, run.tokenizer_dir,
                    run.generation_config, run.export_dtype, init_dir)
    else:
        export_hf(t.model, t.hf_config, run.export_dir, run.tokenizer_dir, run.generation_config, run.export_dtype)
    dist.barrier()


def train_loop(config: dict) -> None:
    """What each Ray Train worker runs: `config["run"]` is the stage's LoopConfig."""
    import ray.train

    t = setup(config["run"])
    stage = t.stage
    if t.rank == 0:
        _announce(t)
    stopping = False
    try:
        for step in range(t.start_step, stage.steps):
            record, stop_requested = train_step(t, step)
            done = record["step"]
            stopping = stop_requested and done < stage.steps
            if stopping and t.pending is not None:
                # the previous step's checkpoint, still being written, is the stop's: finishing it takes less than
                # a whole save, which the time before the limit was sized for; this step is trained again on resume
                finish_checkpoint(t)
                if t.rank == 0:
                    log.info(f"[{stage.name}] stop requested: checkpoint of step {done - 1} saved, stopping here "
                             f"(step {done} is trained again when the stage resumes)")
                break
            finish_checkpoint(t)  # the previous step's, written while this one ran
            if step == t.start_step:
                record.update(describe_collectives(t))
            save_now = done % stage.checkpoint_every == 0 or done == stage.steps or stopping
            if save_now and not stopping:  # a stop has seconds before the time limit: its checkpoint comes first
                record["val_loss"], per_source = validation_losses(
                    t.model, t.objective, stage.micro_batch_size, t.rank, t.world, t.device, stage.validation_rows,
                    t.run.seed)
                record.update({f"val_loss/{source}": loss for source, loss in per_source.items()})
            if t.rank == 0:
                _write_record(t, record, save_now)
            if save_now:  # a stop's and the last step's checkpoints are complete before what follows them
                save_checkpoint(t, record, wait=stopping or done == stage.steps)
            elif done % stage.log_every == 0:
                ray.train.report(record)
            if stopping:
                if t.rank == 0:
                    log.info(f"[{stage.name}] stop requested: checkpoint of step {done} saved, stopping here")
                break
    finally:
        if t.pending:  # a step failed while a checkpoint was being written: its folder goes once it is done
            save, folder, _ = t.pending
            save.future.add_done_callback(lambda _: shutil.rmtree(folder, ignore_errors=True))
    if t.board:
        t.board.close()
    if stopping:
        return  # the stage carries on from the checkpoint in the next run; it exports when it completes
    export(t)
