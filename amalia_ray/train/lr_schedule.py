"""Learning-rate schedules as pure functions of the step, so resuming needs no scheduler state."""

from __future__ import annotations

import math


def lr_at(step: int, *, total: int, peak: float, warmup: int, schedule: str, min_ratio: float,
          decay_fraction: float = 0.2) -> float:
    """Linear warmup, then cosine decay to min_ratio×peak, WSD (stable then linear decay), or constant."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    floor = peak * min_ratio
    if schedule == "constant":
        return peak
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "wsd":
        decay_steps = max(1, round(total * decay_fraction))
        decay_start = total - decay_steps
        if step < decay_start:
            return peak
        return peak - (peak - floor) * min(1.0, (step - decay_start + 1) / decay_steps)
    raise ValueError(f"unknown schedule {schedule!r}")
