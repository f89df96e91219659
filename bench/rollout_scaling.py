"""GRPO's step time with the rollout on the trainer's path (sync) and one step off-policy (`async_rollout: true`), at
equal work: the same base model, tasks, steps, prompts per step, completions per prompt and completion length, in
one process with one local Ray. Prints JSON.

    .venv/bin/python bench/rollout_scaling.py [--steps 8] [--prompts 4] [--generations 4] [--max-new 48]

Per mode: the whole stage's wall time (engine start and export included), the mean step time after the first step
(the first samples on the spot in both modes), completion tokens sampled per second of step time, and the ratio
async / sync. A rollout fleet (several engines) is not available, so there is no engines axis."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(mode: str, base: Path, tasks: Path, work: Path, args) -> dict:
    from amalia_ray.core.config import GRPOStage, ModelConfig
    from amalia_ray.train.train_stage import run_train_stage

    stage = GRPOStage(name=f"grpo-{mode}", objective="grpo", dataset=str(tasks), steps=args.steps, seq_len=256,
                      global_batch_size=args.prompts * args.generations, micro_batch_size=args.prompts,
                      num_workers=args.workers, warmup_steps=0, lr=1e-5, checkpoint_every=10**6, log_every=1,
                      num_generations=args.generations, max_completion_length=args.max_new,
                      rewards=["format", "exact_answer", "has_number"], async_rollout=mode == "async")
    start = time.perf_counter()
    run_train_stage(stage, ModelConfig.model_validate({"from": str(base)}), data_dir=tasks, tokenizer_dir=base,
                    init_hf_dir=base, base_dir=base, stage_dir=work / mode, ray_run_name=f"rollout-{mode}", seed=0,
                    use_gpu=False, progress=False)
    wall = time.perf_counter() - start
    history = [json.loads(ln) for ln in (work / mode / "metrics.jsonl").read_text().splitlines()]
    later = history[1:]
    step_s = sum(h["step_time_s"] for h in later) / len(later)
    sampled = sum(h["completion_length"] * args.prompts * args.generations for h in later)
    return {"stage_wall_s": round(wall, 2), "mean_step_s_after_first": round(step_s, 3),
            "completion_tokens_per_step_s": round(sampled / sum(h["step_time_s"] for h in later), 1),
            "steps": len(history), "mean_reward": round(sum(h["reward"] for h in history) / len(history), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new", type=int, default=48, help="most tokens sampled per completion")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray

    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from tests.base_models import make_base_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = make_base_model(work / "base", "qwen3", hidden=args.hidden, layers=args.layers, dtype="float32")
        tasks = work / "tasks.jsonl"
        write_tasks(arithmetic_tasks(args.steps * args.prompts * 2, seed=0), tasks)
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            modes = {mode: run(mode, base, tasks, work, args) for mode in ("sync", "async")}
        finally:
            ray.shutdown()
    print(json.dumps({
        "benchmark": "rollout_scaling", "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, fp32",
        "cores": os.cpu_count(), "workers": args.workers, "steps": args.steps, "prompts_per_step": args.prompts,
        "generations": args.generations, "max_completion_length": args.max_new, "engines": 1, "modes": modes,
        "async_over_sync": {
            "mean_step_s": round(modes["async"]["mean_step_s_after_first"] / modes["sync"]["mean_step_s_after_first"],
                                 3),
            "stage_wall_s": round(modes["async"]["stage_wall_s"] / modes["sync"]["stage_wall_s"], 3)},
    }, indent=2))


if __name__ == "__main__":
    main()
