"""What a stage cost: device-hours by Ray resource (what the stage held × how long it ran, the way a cluster bills),
the tokens it processed, and the energy and money those device-hours stand for under the recipe's per-device figures.

Held devices are logical Ray resources; on the embedded local cluster, which advertises more logical CPUs than the
machine has cores (Serve needs the slack), the pipeline caps CPUs at the real core count before calling this."""

from __future__ import annotations

from amalia_ray.core.config import AccountingConfig

JOULES_PER_KWH = 3.6e6


def stage_cost(held: dict[str, float], wall_time_s: float, tokens: int | None, cfg: AccountingConfig) -> dict:
    """`held`: devices by resource name (e.g. {"CPU": 2, "GPU": 8}); resources without a watts or price figure count
    device-hours but no energy or money."""
    hours = wall_time_s / 3600
    device_hours = {k: n * hours for k, n in held.items() if n}
    watts = sum(n * cfg.watts.get(k, 0.0) for k, n in held.items()) * cfg.pue
    energy_j = watts * wall_time_s
    cost = {
        "held": {k: n for k, n in held.items() if n},
        "device_hours": device_hours,
        "tokens": tokens,
        "energy_kwh": energy_j / JOULES_PER_KWH,
        "usd": sum(h * cfg.usd_per_hour.get(k, 0.0) for k, h in device_hours.items()),
    }
    if tokens:
        cost["tokens_per_device_hour"] = {k: tokens / h for k, h in device_hours.items() if h}
        cost["tokens_per_gpu_hour"] = cost["tokens_per_device_hour"].get("GPU")
        cost["tokens_per_joule"] = tokens / energy_j if energy_j else None
    return cost


def total_cost(costs: list[dict]) -> dict:
    """The run's sum over its stages (tokens are not summed: a token packed, trained on and scored is one token
    seen three times, so a total would mean nothing)."""
    device_hours: dict[str, float] = {}
    for c in costs:
        for k, h in c.get("device_hours", {}).items():
            device_hours[k] = device_hours.get(k, 0.0) + h
    return {"device_hours": device_hours, "energy_kwh": sum(c.get("energy_kwh", 0.0) for c in costs),
            "usd": sum(c.get("usd", 0.0) for c in costs)}
