"""One-shot GPU check (run where two CUDA GPUs are lent): the training workers' process group on GPUs. Under the
backend training configures (`cpu:gloo,cuda:nccl`) the loop's CPU-side collectives and an FSDP2 step on CUDA both
run; under plain `nccl` (Ray's default on GPUs) the CPU collectives fail. Prints JSON.

    .venv/bin/python bench/gpu/process_group.py         # two CUDA GPUs
    .venv/bin/python bench/gpu/process_group.py --cpu   # the same script here, gloo standing in for NCCL
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, backend: str, port: int, on_cpu: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if on_cpu else torch.device("cuda", rank)
    if not on_cpu:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    from transformers import LlamaConfig

    from amalia_ray.train.loop import _all_reduce_sum
    from amalia_ray.train.model import build
    from amalia_ray.train.parallel import apply_fsdp

    result: dict = {"backend": backend}
    try:
        result["metric_sums"] = _all_reduce_sum(1.0, float(rank))
        nodes: list = [None] * 2
        dist.all_gather_object(nodes, f"rank-{rank}")
        result["gathered"] = nodes
    except RuntimeError as e:
        result["cpu_collectives_error"] = str(e).splitlines()[0]
    if "cpu_collectives_error" not in result:
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = build(config, device, lambda m: apply_fsdp(m, "fp32" if on_cpu else "bf16", False),
                      init_dir=None, seed=0)
        ids = torch.randint(0, 512, (2, 64), device=device)
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
        loss.backward()
        result["fsdp_step_loss"] = _all_reduce_sum(loss.item())[0] / 2
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run(backend: str, on_cpu: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(_rank, args=(backend, _port(), on_cpu, str(out)), nprocs=2)
        return json.loads(out.read_text())


def main() -> int:
    from amalia_ray.train.parallel import process_group_backend

    on_cpu = "--cpu" in sys.argv
    if not on_cpu and torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": f"needs two CUDA GPUs ({torch.cuda.device_count()} found)"}))
        return 0
    configured = process_group_backend(use_gpu=True)
    stand_in = (lambda b: b.replace("nccl", "gloo")) if on_cpu else (lambda b: b)
    plain = run(stand_in("cuda:nccl"), on_cpu)  # what Ray's plain "nccl" registers: a backend for cuda only
    ours = run(stand_in(configured), on_cpu)
    ok = "cpu_collectives_error" in plain and "fsdp_step_loss" in ours
    print(json.dumps({"device": "cpu (gloo for nccl)" if on_cpu else torch.cuda.get_device_name(0),
                      "plain_nccl": plain, "configured": ours, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
