"""FSDP2: shard each decoder block, then the root; precision policy chosen per device. Activation checkpointing and
torch.compile are applied per block first (torchtitan's order: AC, compile, FSDP). Sharded over every rank (FSDP), or
within groups of ranks and replicated across them (HSDP, a `replicate × shard` device mesh)."""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("amalia_ray.train")


def process_group_backend(use_gpu: bool) -> str:
    """The workers' torch.distributed backend. On GPUs NCCL is registered for CUDA tensors only, yet the loop also
    reduces metrics, gathers objects and plans checkpoints with CPU tensors: those go through gloo."""
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


# The most the other ranks wait for rank 0's one-off work: starting a rollout fleet (placement, then a 9B engine's
# load), on-policy DPO's sampling and scoring of every task. The workers' process group times out a collective
# after Ray Train's 30 minutes, right for a step's collectives (a hung NCCL call is found in that time); these waits
# go through a gloo group of their own with this limit instead.
RANK0_WAIT_S = 6 * 3600
_rank0_groups: dict = {}


def rank0_group():
    """A gloo group of every rank with RANK0_WAIT_S as its timeout (made once per process group, by every rank
    alike)."""
    from datetime import timedelta

    import torch.distributed as dist

    world = dist.group.WORLD
    if world not in _rank0_groups:
        _rank0_groups.clear()  # an earlier process group's, destroyed
        _rank0_groups[world] = dist.new_group(backend="gloo", timeout=timedelta(seconds=RANK0_WAIT_S))
    return _rank0_groups[world]


def resolve_precision(precision: str, device: torch.device) -> str:
    """bf16 on GPU; fp32 on CPU, where fp32 matmul is faster than bf16 on the machines we measured."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" else "fp32"


def worker_device(gpu_ids: list, cuda_available: bool | None = None) -> torch.device:
    """A training worker's device: its GPU when Ray gave it one, else the CPU. A worker given GPUs that CUDA
    cannot see fails with the reason, instead of training on the CPU at a hundredth of the speed."""
    if not gpu_ids:  # Ray leaves a GPU-less worker's CUDA_VISIBLE_DEVICES alone: a GPU may be visible, not its own
        return torch.device("cpu")
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda_available:
        raise RuntimeError(f"this worker was given GPU(s) {gpu_ids} but CUDA is unavailable to torch "
                           f"{torch.__version__}: {cuda_unavailable_reason()}")
    return torch.device("cuda", torch.cuda.current_device())


def cuda_unavailable_reason() -> str:
    """Why torch cannot use CUDA here, in the words of the driver check (an old driver names its version)."""
    if torch.version.cuda is None:
        return "this torch is a CPU-only build; install the CUDA build (the project's gpu extra)"
    try:
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - the message is the diagnosis
        return f"built for CUDA {torch.version.cuda}; {type(e).__name__}: {e}"
    return f"built for CUDA {torch.version.cuda}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"


def resolve_async_checkpoint(checkpoint_async: bool | str, device: torch.device) -> bool:
    """`checkpoint_async: auto` writes in the background on GPU (the staged copy leaves GPU memory over PCIe while
    the write to storage takes far longer), in place on CPU, where the copy costs about what the write does."""
    return device.type == "cuda" if checkpoint_async == "auto" else bool(checkpoint_async)


def resolve_compile(compile_blocks: bool | str, device: torch.device) -> bool:
    """`compile: auto` compiles on GPU, where the fused kernels pay for the compilation, not on CPU."""
    return device.type == "cuda" if compile_blocks == "auto" else bool(compile_blocks)


def mixed_precision(precision: str, reduce_precision: str = "bf16", sync_once: bool = False):
    """FSDP's policy: in bf16 runs, parameters gathered in bf16 and gradients reduce-scattered in `reduce_precision`
    (bf16 halves the bytes on the network; fp32 sums many ranks more exactly); fp32 runs are fp32 throughout.
    Gradients synced once a step (`sync_once`) are accumulated unsharded in the reduce dtype: in fp32 then."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision != "bf16":
        return MixedPrecisionPolicy()
    reduce = torch.bfloat16 if reduce_precision == "bf16" and not sync_once else torch.float32
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)


def data_parallel_mesh(device_type: str, world: int, shard_size: int | None):
    """The device mesh the weights are sharded on: None for FSDP over all `world` ranks; for HSDP a 2-D mesh of
    `world / shard_size` replicas × `shard_size` shards. Each parameter is then split over the ranks of one group (a
    node's GPUs: the per-layer all-gathers and reduce-scatters stay on the node's own links) and the groups hold
    copies, so only one gradient all-reduce per step crosses nodes. A world size that `shard_size` does not divide
    (an elastic stage after losing part of a node) shards over every rank: less memory per rank, more traffic across
    nodes, said in the log. Collective: every rank calls it, in the same order."""
    if not shard_size or shard_size >= world:
        return None
    if world % shard_size:
        log.warning(f"shard_size {shard_size} does not divide the {world} workers: sharding over all {world} "
                    "(FSDP) instead of HSDP")
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model, precision: str, activation_checkpointing: bool | int, compile_blocks: bool = False,
               reduce_precision: str = "bf16", sync_once: bool = False, mesh=None) -> None:
    """`activation_checkpointing`: true (every block), false, or k: every k-th block (torchtitan's selective
    checkpointing by layer). `mesh`: `data_parallel_mesh`'s (None: FSDP over every rank)."""
    from torch.distributed.fsdp import fully_shard

    from amalia_ray.core.config import checkpoint_interval

    mp = mixed_precision(precision, reduce_precision, sync_once)
    layers = model.model.layers
    if every := checkpoint_interval(activation_checkpointing):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            if i % every == 0:
                layers[i] = checkpoint_wrapper(layer)
    if compile_blocks:  # every block has the same code: one compilation, reused
        for layer in layers:
            layer.compile()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
