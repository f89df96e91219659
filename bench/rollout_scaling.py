"""The rollout fleet's throughput with 1 and 2 engines, and GRPO's step time with the rollout on the trainer's path
(sync, 1 and 2 engines) and one step off-policy (`async_rollout: true`), at equal work: the same base model, tasks,
steps, prompts per step, completions per prompt and completion length, in one process with one local Ray. Prints
JSON.

    .venv/bin/python bench/rollout_scaling.py [--steps 8] [--prompts 4] [--generations 4] [--max-new 48]
    .venv/bin/python bench/rollout_scaling.py --gpu   # one GPU: a larger model in bf16, one engine, sync only
                                                      # (part of bench/gpu/one_gpu.py)

Rollout: completion tokens per second of one sampling call over `--rollout-prompts` prompts × generations,
split over the fleet's engines (after a warm-up call). Per GRPO mode: the whole stage's wall time (engine start and
export included), the mean step time after the first step (the first samples on the spot in every mode),
completion tokens sampled per second of step time, and the ratios 2 engines / 1 and async / sync. With one GPU
there is no second engine (colocated engines share the training workers' GPUs, one each) and no async (its
engine needs a GPU of its own), so `--gpu` measures one engine, sync."""

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


def rollout_rate(base: Path, tasks: Path, engines: int, args) -> dict:
    """Completion tokens per second of one sampling call on a fleet of `engines` engines (after a warm-up)."""
    from transformers import AutoTokenizer

    from amalia_ray.core.config import RolloutConfig
    from amalia_ray.core.formats.rl_tasks import read_tasks
    from amalia_ray.train.rollout import this_worker
    from amalia_ray.train.rollout_fleet import encode_prompt, prompt_seeds, start_fleet

    tok = AutoTokenizer.from_pretrained(str(base))
    prompts = [encode_prompt(tok, t["prompt"]) for t in read_tasks(tasks)][:args.rollout_prompts]
    # the device's (on CPU, RAM's) share each engine takes: the same for every fleet size
    share = 0.3 if args.gpu else 0.04
    start = time.perf_counter()
    fleet = start_fleet(str(base), RolloutConfig(engines=engines, max_model_len=256, gpu_memory_utilization=share),
                        0, args.gpu, None, [this_worker(args.gpu)])
    started = time.perf_counter() - start
    try:
        fleet.sample(prompts[:4], args.generations, args.max_new, 1.0, prompt_seeds(0, 10**6, 4, args.generations))
        start = time.perf_counter()
        sampled = fleet.sample(prompts, args.generations, args.max_new, 1.0,
                               prompt_seeds(0, 0, len(prompts), args.generations))
        took = time.perf_counter() - start
    finally:
        fleet.shutdown()
    tokens = sum(len(c) for per_prompt in sampled for c in per_prompt)
    return {"engines": engines, "start_s": round(started, 2), "sample_s": round(took, 3),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / took, 1)}


def run(mode: str, engines: int, base: Path, tasks: Path, work: Path, args) -> dict:
    from amalia_ray.core.config import GRPOStage, ModelConfig
    from amalia_ray.train.train_stage import run_train_stage

    name = f"{mode}-{engines}"
    stage = GRPOStage(name=f"grpo-{name}", objective="grpo", dataset=str(tasks), steps=args.steps, seq_len=256,
                      global_batch_size=args.prompts * args.generations, micro_batch_size=args.prompts,
                      num_workers=args.workers, warmup_steps=0, lr=1e-5, checkpoint_every=10**6, log_every=1,
                      num_generations=args.generations, max_completion_length=args.max_new,
                      rewards=["format", "exact_answer", "has_number"], async_rollout=mode == "async",
                      rollout={"engines": engines})
    start = time.perf_counter()
    run_train_stage(stage, ModelConfig.model_validate({"from": str(base)}), data_dir=tasks, tokenizer_dir=base,
                    init_hf_dir=base, base_dir=base, stage_dir=work / name, ray_run_name=f"rollout-{name}", seed=0,
                    use_gpu=args.gpu, progress=False)
    wall = time.perf_counter() - start
    history = [json.loads(ln) for ln in (work / name / "metrics.jsonl").read_text().splitlines()]
    later = history[1:]
    step_s = sum(h["step_time_s"] for h in later) / len(later)
    sampled = sum(h["completion_length"] * args.prompts * args.generations for h in later)
    return {"stage_wall_s": round(wall, 2), "mean_step_s_after_first": round(step_s, 3),
            "completion_tokens_per_step_s": round(sampled / sum(h["step_time_s"] for h in later), 1),
            "steps": len(history), "mean_reward": round(sum(h["reward"] for h in history) / len(history), 4)}


def phase(what: str) -> None:
    """On stderr as each phase starts: where a run that is stopped got to."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new", type=int, default=48, help="most tokens sampled per completion")
    parser.add_argument("--rollout-prompts", type=int, default=32, help="prompts of the timed sampling call")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpu", action="store_true", help="one GPU: 1 worker, one engine, sync; a hidden-1024, "
                        "16-layer model (heads 256 wide) unless --hidden/--layers say otherwise")
    args = parser.parse_args()
    if args.gpu:
        args.workers = 1
        if (args.hidden, args.layers) == (256, 4):
            args.hidden, args.layers = 1024, 16
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import ray

    from amalia_ray.core.formats.rl_tasks import write_tasks
    from amalia_ray.data.posttrain.arithmetic_tasks import arithmetic_tasks
    from tests.base_models import make_base_model

    fleets = [1] if args.gpu else [1, 2]
    grpo = [("sync", 1)] if args.gpu else [("sync", 1), ("sync", 2), ("async", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = make_base_model(work / "base", "qwen3", hidden=args.hidden, layers=args.layers, dtype="float32",
                               shard_size="2GB")
        tasks = work / "tasks.jsonl"
        write_tasks(arithmetic_tasks(max(args.steps * args.prompts * 2, args.rollout_prompts), seed=0), tasks)
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            rollout, modes = {}, {}
            for n in fleets:
                phase(f"sampling on {n} engine(s)")
                rollout[f"{n}_engines"] = rollout_rate(base, tasks, n, args)
            for mode, n in grpo:
                phase(f"GRPO, {mode}, {n} engine(s)")
                modes[f"{mode}_{n}_engines"] = run(mode, n, base, tasks, work, args)
        finally:
            ray.shutdown()
    ratio = lambda a, b, key: round(a[key] / b[key], 3)  # noqa: E731
    out = {"benchmark": "rollout_scaling", "device": "gpu" if args.gpu else "cpu",
           "model": f"qwen3 hidden {args.hidden}, {args.layers} layers, {'bf16' if args.gpu else 'fp32'} engines",
           "cores": os.cpu_count(), "workers": args.workers, "steps": args.steps, "prompts_per_step": args.prompts,
           "generations": args.generations, "max_completion_length": args.max_new,
           "rollout_prompts": args.rollout_prompts, "rollout": rollout, "grpo": modes}
    if not args.gpu:
        out["two_engines_over_one"] = {
            "rollout_tokens_per_s": ratio(rollout["2_engines"], rollout["1_engines"], "tokens_per_s"),
            "grpo_mean_step_s": ratio(modes["sync_2_engines"], modes["sync_1_engines"], "mean_step_s_after_first")}
        out["async_over_sync"] = {
            "mean_step_s": ratio(modes["async_1_engines"], modes["sync_1_engines"], "mean_step_s_after_first"),
            "stage_wall_s": ratio(modes["async_1_engines"], modes["sync_1_engines"], "stage_wall_s")}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
