"""Evaluation harness: ours against lm-eval (`local-completions`) on the same task, items and server, in one run.
Prints JSON.

    .venv/bin/python bench/eval_vs_lmeval.py [--checkpoint runs/demo/sft/hf] [--task evals/tasks/pt_mc_sample.jsonl]
        [--copies 5] [--concurrency 8] [--rounds 2]          # lm-eval: dev extra; needs a checkpoint (make demo)

One checkpoint is served once with Ray Serve + vLLM (the embedded local Ray). The task is exported with
`amalia export-lm-eval` so both harnesses score the same items with the same prompt; `--copies` repeats the items
(new ids) to make the run long enough to time. Each round runs ours then lm-eval, after a warm-up of both; lm-eval
gets the same number of concurrent requests as ours (`num_concurrent`) at its default batch size (1 prompt per
request); it is also timed with as many prompts per request as ours sends (`batch_size`), and at its default
concurrency (1). Reported: wall time per harness (median of rounds), the speed-ups, and whether the scores are
identical (accuracy, acc_norm and the largest difference of any choice's log-likelihood).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def copies_of(task: Path, copies: int, out: Path) -> Path:
    from amalia_ray.evals.tasks import read_records

    with out.open("w", encoding="utf-8") as f:
        for k in range(copies):
            for i, (_, row) in enumerate(read_records(task)):
                f.write(json.dumps({**row, "id": f"{row.get('id', i)}-{k}"}, ensure_ascii=False) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "runs/demo/sft/hf")
    ap.add_argument("--task", type=Path, default=ROOT / "evals/tasks/pt_mc_sample.jsonl")
    ap.add_argument("--format", default="mcq")
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8391)
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").exists():
        sys.exit(f"no HF checkpoint at {args.checkpoint}: run `make demo` first or pass --checkpoint")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.pop("AMALIA_API_KEY", None)

    import lm_eval
    import ray
    from lm_eval.tasks import TaskManager

    from amalia_ray.core.config import EvalConfig, EvalTaskConfig, ServeConfig
    from amalia_ray.evals.lmeval_export import export_lm_eval
    from amalia_ray.evals.runner import run_task
    from amalia_ray.serve import app as serve_app

    tmp = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    items = copies_of(args.task, args.copies, tmp / "items.jsonl")
    task = EvalTaskConfig(name="bench-task", path=str(items), format=args.format)
    export_lm_eval(task, items, tmp / "lm-eval")
    manager = TaskManager(include_path=str(tmp / "lm-eval"))
    settings = EvalConfig(concurrency=args.concurrency)

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    url = serve_app.start({"bench": args.checkpoint}, ServeConfig(port=args.port), use_gpu=False)

    def ours() -> dict:
        return run_task(task, items, base_url=url, model="bench", settings=settings)

    def theirs(concurrent: int, batch: int = 1) -> dict:
        return lm_eval.simple_evaluate(
            model="local-completions", tasks=[task.name], task_manager=manager, log_samples=True,
            model_args=f"model=bench,base_url={url}/completions,tokenizer={args.checkpoint},"
                       f"tokenizer_backend=huggingface,num_concurrent={concurrent},max_retries=3,batch_size={batch}")

    def timed(fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        return time.perf_counter() - t0, out

    try:
        ours(), theirs(args.concurrency)  # warm-up: engine caches, tokenizer loads
        t_ours, t_theirs, t_batched, t_default = [], [], [], []
        for _ in range(args.rounds):
            t, our_result = timed(ours)
            t_ours.append(t)
            t, their_result = timed(theirs, args.concurrency)
            t_theirs.append(t)
            t, batched_result = timed(theirs, args.concurrency, settings.prompts_per_request)
            t_batched.append(t)
        t_default.append(timed(theirs, 1)[0])
    finally:
        serve_app.stop()
        ray.shutdown()
    their_ll = {str(s["doc"]["id"]): [r[0][0] for r in s["resps"]] for s in their_result["samples"][task.name]}
    max_diff = max(abs(a - b) for it in our_result["items"] for a, b in zip(it["logprobs"], their_ll[it["id"]]))
    ours_s, theirs_s = statistics.median(t_ours), statistics.median(t_theirs)
    print(json.dumps({
        "benchmark": "eval_vs_lmeval", "task": str(args.task), "items": our_result["n"],
        "choices": sum(len(it["logprobs"]) for it in our_result["items"]), "concurrency": args.concurrency,
        "ours_s": round(ours_s, 2), "lm_eval_s": round(theirs_s, 2), "speedup": round(theirs_s / ours_s, 2),
        "lm_eval_batched_s": round(statistics.median(t_batched), 2), "lm_eval_batch_size": settings.prompts_per_request,
        "speedup_vs_lm_eval_batched": round(statistics.median(t_batched) / ours_s, 2),
        "lm_eval_default_concurrency_s": round(t_default[0], 2),
        "speedup_vs_lm_eval_default": round(t_default[0] / ours_s, 2),
        "rounds": {"ours_s": [round(t, 2) for t in t_ours], "lm_eval_s": [round(t, 2) for t in t_theirs],
                   "lm_eval_batched_s": [round(t, 2) for t in t_batched]},
        "identical_scores": all(our_result["scores"]["acc"] == r["results"][task.name]["acc,none"]
                                and our_result["scores"]["acc_norm"] == r["results"][task.name]["acc_norm,none"]
                                for r in (their_result, batched_result)),
        "acc": our_result["scores"]["acc"], "acc_norm": our_result["scores"]["acc_norm"],
        "max_loglik_diff": max_diff,
    }, indent=2))


if __name__ == "__main__":
    main()
