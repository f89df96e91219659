"""Task scores: means with their standard error (lm-eval's `mean_stderr`: sample standard deviation over √n), and
the same per group of items (e.g. per PHEB subject)."""

from __future__ import annotations

import math
from collections import defaultdict


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def summarize(rows: list[dict], metrics: tuple[str, ...]) -> dict:
    """{metric: mean, metric_stderr: stderr} over the rows that have the metric (a row without it is left out)."""
    out = {}
    for m in metrics:
        mean, se = mean_and_stderr([float(r[m]) for r in rows if r.get(m) is not None])
        out[m], out[f"{m}_stderr"] = mean, se
    return out


def rejected_row(item, error: Exception, failed: bool = False) -> dict:
    """An item the server refused (e.g. its prompt is over the model's context), or whose requests `failed`
    (retries spent, a reply over the size limit or not of the shape asked for): kept in the result with the
    message, left out of every score."""
    return {"id": item.id, "rejected": str(error), **({"failed": True} if failed else {}),
            "meta": getattr(item, "meta", {})}


def by_group(rows: list[dict], key: str, metrics: tuple[str, ...]) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("meta", {}).get(key) is not None and "rejected" not in r:
            groups[str(r["meta"][key])].append(r)
    return {g: {**summarize(rs, metrics), "n": len(rs)} for g, rs in sorted(groups.items())}
