"""Evaluation harness: `amalia eval` against lm-eval (`local-completions`) on the same items, prompts and server, in
one run. Prints JSON.

    .venv/bin/python bench/eval_vs_lmeval.py [--checkpoint runs/demo/sft/hf] [--items 200] [--concurrency 8]
        [--rounds 2] [--fewshot 0,3]                         # lm-eval: dev extra; needs a checkpoint (make demo)

The items are real and distinct: a HellaSwag-style multiple choice built from the Debian reference manual in
European Portuguese (a paragraph's opening as the context; its true continuation and three continuations of other
paragraphs as the choices), exported with `amalia export-lm-eval` so both harnesses score the same prompts. One
checkpoint is served once with Ray Serve + vLLM. Each harness runs as a whole command from process start to its
result file on disk (`amalia eval …` and `lm_eval run …`), so start-up and imports count on both sides. After a
warm-up of the server, each round runs ours and then lm-eval given the same work shape as ours — the same number of
requests in flight (`num_concurrent`) and of prompts per request (`batch_size`): the headline. lm-eval at its
defaults (one prompt per request, one request at a time) runs once, beside it, zero-shot. Each number of
few-shot examples (`--fewshot`: zero-shot and 3-shot by default) is its own comparison: ours draws the examples,
lm-eval draws its own from the exported pool (the same ones). Scores are checked to be identical (accuracy,
acc_norm, and the largest difference of any choice's log-likelihood).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MANUAL = Path("/usr/share/debian-reference/debian-reference.pt.txt.gz")


def continuation_items(n: int, seed: int = 0) -> list[dict]:
    """Multiple-choice items from real paragraphs: which of four continuations follows the opening."""
    text = gzip.open(MANUAL, "rt", encoding="utf-8").read()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    def prose(p: str) -> bool:  # sentences, not tables, listings or command lines
        letters = sum(ch.isalpha() for ch in p) / max(1, len(p.replace(" ", "")))
        return 200 <= len(p) <= 1200 and p.count(" ") > 30 and letters > 0.85 and not re.search(r"[|<>{}$#]", p)

    from amalia_ray.data.steps.language import detect_language

    paragraphs = [p for p in paragraphs if prose(p) and detect_language(p)[0] == "pt"]
    rng = random.Random(seed)
    rng.shuffle(paragraphs)
    split = [(p[:len(p) // 2].rsplit(" ", 1)[0], p[len(p) // 2:].split(" ", 1)[-1][:160]) for p in paragraphs]
    items = []
    for i, (context, ending) in enumerate(split[:n]):
        others = rng.sample([e for j, (_, e) in enumerate(split) if j != i], 3)
        choices = [ending, *others]
        rng.shuffle(choices)
        items.append({"id": f"cont-{i}", "question": context, "choices": choices, "answer": choices.index(ending)})
    return items


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:3])} … failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "runs/demo/sft/hf")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompts-per-request", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--fewshot", default="0,3", help="numbers of few-shot examples, each compared apart")
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").exists():
        sys.exit(f"no HF checkpoint at {args.checkpoint}: run `make demo` first or pass --checkpoint")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.pop("AMALIA_API_KEY", None)

    import ray

    from amalia_ray.core.config import EvalTaskConfig, ServeConfig
    from amalia_ray.evals.lmeval_export import export_lm_eval
    from amalia_ray.serve import app as serve_app

    tmp = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    items = tmp / "items.jsonl"
    rows = continuation_items(args.items)
    items.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    shots = [int(k) for k in args.fewshot.split(",")]
    tasks = {k: EvalTaskConfig(name=f"bench-task-{k}shot", path=str(items), format="mcq", num_fewshot=k)
             for k in shots}
    for task in tasks.values():
        export_lm_eval(task, items, tmp / "lm-eval")

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    url = serve_app.start({"bench": args.checkpoint}, ServeConfig(port=args.port), use_gpu=False,
                          name="amalia-bench").base_url
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    bin_dir = Path(sys.executable).parent

    def ours(k: int) -> list[str]:
        return [str(bin_dir / "amalia"), "eval", "--base-url", url, "--model", "bench", "--task", str(items),
                "--format", "mcq", "--num-fewshot", str(k), "--concurrency", str(args.concurrency),
                "--prompts-per-request", str(args.prompts_per_request), "--output", str(tmp / f"ours-{k}.json")]

    def theirs(k: int, name: str, concurrent: int, batch: int) -> list[str]:
        return [str(bin_dir / "lm_eval"), "run", "--model", "local-completions", "--tasks", tasks[k].name,
                "--include_path", str(tmp / "lm-eval"), "--log_samples", "--output_path", str(tmp / f"{name}-{k}"),
                "--batch_size", str(batch),
                "--model_args", f"model=bench,base_url={url}/completions,tokenizer={args.checkpoint},"
                                f"tokenizer_backend=huggingface,num_concurrent={concurrent},max_retries=3"]

    times: dict[int, dict[str, list[float]]] = {}
    try:
        timed(ours(shots[0]), env)  # warm-up: the engine's first requests, page caches
        for k in shots:
            configs = {"ours": ours(k), "lm_eval_same_shape": theirs(k, "same", args.concurrency,
                                                                     args.prompts_per_request)}
            times[k] = {name: [] for name in configs}
            for _ in range(args.rounds):
                for name, cmd in configs.items():
                    times[k][name].append(timed(cmd, env))
        if 0 in shots:
            times[0]["lm_eval_defaults"] = [timed(theirs(0, "defaults", 1, 1), env)]  # one request at a time: once
    finally:
        serve_app.stop("amalia-bench")
        ray.shutdown()
    print(json.dumps({
        "benchmark": "eval_vs_lmeval", "timing": "whole commands, process start to result file",
        "concurrency": args.concurrency, "prompts_per_request": args.prompts_per_request,
        **{f"{k}_shot": _compare(tmp, k, tasks[k].name, times[k]) for k in shots},
    }, indent=2))


def _compare(tmp: Path, k: int, name: str, times: dict[str, list[float]]) -> dict:
    ours_result = json.loads((tmp / f"ours-{k}.json").read_text())
    samples = sorted((tmp / f"same-{k}").rglob(f"samples_{name}_*.jsonl"))[-1]  # one per round: the last
    results = sorted((tmp / f"same-{k}").rglob("results_*.json"))[-1]
    theirs_scores = json.loads(results.read_text())["results"][name]

    def loglik(resp) -> float:  # lm-eval's samples file keeps each (loglik, is_greedy) as its repr
        value = resp[0]
        return float((ast.literal_eval(value) if isinstance(value, str) else value)[0])

    their_ll = {str(s["doc"]["id"]): [loglik(r) for r in s["resps"]]
                for s in map(json.loads, samples.read_text().splitlines())}
    max_diff = max(abs(a - b) for it in ours_result["items"] for a, b in zip(it["logprobs"], their_ll[it["id"]]))
    median = {key: statistics.median(v) for key, v in times.items()}
    out = {"items": ours_result["n"], "choices": sum(len(it["logprobs"]) for it in ours_result["items"]),
           "ours_s": round(median["ours"], 2), "lm_eval_same_shape_s": round(median["lm_eval_same_shape"], 2),
           "speedup_same_shape": round(median["lm_eval_same_shape"] / median["ours"], 2)}
    if "lm_eval_defaults" in median:
        out |= {"lm_eval_defaults_s": round(median["lm_eval_defaults"], 2),
                "speedup_vs_lm_eval_defaults": round(median["lm_eval_defaults"] / median["ours"], 2)}
    return out | {
        "rounds": {key: [round(t, 2) for t in v] for key, v in times.items()},
        "identical_scores": ours_result["scores"]["acc"] == theirs_scores["acc,none"]
        and ours_result["scores"]["acc_norm"] == theirs_scores["acc_norm,none"],
        "acc": ours_result["scores"]["acc"], "acc_norm": ours_result["scores"]["acc_norm"],
        "max_loglik_diff": max_diff,
    }


if __name__ == "__main__":
    main()
