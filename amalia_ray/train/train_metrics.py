"""Per-step metrics beyond the loss: model FLOPs utilization against a stated peak (core/flops.py), memory, and
TensorBoard event files next to metrics.jsonl (which the run manifest and report read)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from amalia_ray.core.flops import datasheet_peak


def stated_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The FLOP/s MFU is measured against on this device, and what it is: the datasheet's dense peak for a GPU we
    know, else a large matmul measured here with this process's threads."""
    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if peak := datasheet_peak(name, kind):
            return peak, f"{name} datasheet {kind} {peak / 1e12:,.0f} TFLOP/s"
    measured = matmul_peak_flops(device, dtype)
    return measured, f"measured {kind} matmul on {device.type} {measured / 1e9:,.1f} GFLOP/s"


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """FLOP/s of a large square matmul on this device with this process's threads: the ceiling MFU is measured
    against (datasheet peaks mean little on a shared CPU)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up
    _sync(device)
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or runs < 3:
        torch.matmul(a, b)
        runs += 1
        if device.type == "cuda" and runs % 10 == 0:
            _sync(device)
    _sync(device)
    return 2 * n**3 * runs / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_gb(device: torch.device) -> float:
    """Peak memory of this worker: allocated accelerator memory on GPU, the process's peak resident set size on CPU
    (Linux reports it in KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class TensorBoard:
    """Scalars of every step record under `folder` (view with `tensorboard --logdir runs`)."""

    def __init__(self, folder: Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        # purge_step: a resumed attempt hides the events an earlier attempt wrote after the checkpoint
        self.writer = SummaryWriter(str(folder), flush_secs=10, purge_step=purge_step)

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None:
                self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()
