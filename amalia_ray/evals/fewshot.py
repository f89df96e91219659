"""Few-shot examples, drawn the way lm-eval draws them so the same task and k give the same prompt: one generator
seeded once per task (`fewshot_seed`, lm-eval's default 1234), and for each item in order k examples sampled from the
pool (`random.sample`); where the pool is the task's own items, k + 1 are sampled and the item itself is left out."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from amalia_ray.core.config import EvalTaskConfig
from amalia_ray.evals.tasks import FEWSHOT_SPLIT, MCItem, TaskError, dataset_splits, load_task


def fewshot_pool(task: EvalTaskConfig, task_path: Path, all_items: list) -> tuple[list[MCItem], bool]:
    """The examples' pool, and whether it is the task's own items: `fewshot_path` (its train split, if it has
    splits), else the task's dataset's train split, else all the task's items (`all_items`, not only the first
    `limit`)."""
    if task.fewshot_path:
        source = Path(task.fewshot_path)
        split = FEWSHOT_SPLIT if FEWSHOT_SPLIT in dataset_splits(source) else "test"
        return load_task(source, task.format, split=split), False
    if FEWSHOT_SPLIT in dataset_splits(task_path):
        return load_task(task_path, task.format, split=FEWSHOT_SPLIT), False
    return all_items, True


def with_shots(task: EvalTaskConfig, task_path: Path, all_items: list) -> list:
    """The task's first `limit` items with their `num_fewshot` examples attached."""
    items = all_items[:task.limit] if task.limit else all_items
    k = task.num_fewshot
    if not k:
        return items
    pool, own = fewshot_pool(task, task_path, all_items)
    if len(pool) < k + own:
        raise TaskError(f"task '{task.name}': {k} few-shot examples per item need a pool of at least {k + own} "
                        f"items; {task.fewshot_path or task_path} has {len(pool)}")
    rnd = random.Random(task.fewshot_seed)
    out = []
    for item in items:
        if own:
            drawn = [s for s in rnd.sample(pool, k + 1) if s.id != item.id][:k]
        else:
            drawn = rnd.sample(pool, k)
        out.append(replace(item, shots=tuple(drawn)))
    return out


def task_items(task: EvalTaskConfig, task_path: Path) -> list:
    """The items a task scores (its first `limit`), each with its few-shot examples."""
    return with_shots(task, task_path, load_task(task_path, task.format))
