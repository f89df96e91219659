"""Published-number check: each task format scored by `amalia eval` and by lm-eval (`local-completions`, the task
exported with `amalia export-lm-eval`) on the same served checkpoint, zero-shot and 3-shot (lm-eval drawing its own
examples) and 3-shot through the model's chat template with a system prompt. Prints JSON: one row per format and
setting, both scores and whether they are identical.

    .venv/bin/python bench/lmeval_parity.py [--checkpoint runs/demo/sft/hf]   # lm-eval: dev extra; make demo first

The tasks are our samples under evals/tasks/ (multiple choice, PHEB exam, SAUDADE ordering, cloze) and the multiple
choice sample written as a EuroEval dataset (EuroEval's schema and train/test splits, read with `datasets`). Cloze is
a generation task: zero-shot only (few-shot is implemented for log-likelihood tasks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TASKS = ROOT / "evals" / "tasks"
SYSTEM = "És um examinador de português europeu."


def euroeval_folder(out: Path) -> Path:
    """The multiple-choice sample in EuroEval's schema: text with "Opções:" and "a. …" lines, label letter; its
    first 8 items as the train split, the rest as test."""
    import datasets

    rows = []
    for line in (TASKS / "pt_mc_sample.jsonl").read_text().splitlines():
        item = json.loads(line)
        choices = item["choices"]
        options = "\n".join(f"{'abcdefgh'[i]}. {c}" for i, c in enumerate(choices))
        answer = item["answer"] if isinstance(item["answer"], int) else "ABCDEFGH".index(item["answer"])
        rows.append({"text": f"{item['question']}\nOpções:\n{options}", "label": "abcdefgh"[answer]})
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                          "test": datasets.Dataset.from_list(rows[8:])}).save_to_disk(str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "runs/demo/sft/hf")
    ap.add_argument("--port", type=int, default=8392)
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
    from amalia_ray.evals.evaluate import metrics_of, run_task
    from amalia_ray.serve import app as serve_app

    tmp = Path(tempfile.mkdtemp(prefix="lmeval-parity-"))
    sources = {"mcq": TASKS / "pt_mc_sample.jsonl", "pheb": TASKS / "pheb_sample.json",
               "binary": TASKS / "saudade_sample.jsonl", "euroeval": euroeval_folder(tmp / "euroeval"),
               "cloze": TASKS / "cloze_sample.jsonl"}
    settings = [("0-shot", {}), ("3-shot", {"num_fewshot": 3}),
                ("3-shot chat + system prompt", {"num_fewshot": 3, "chat": True, "system_prompt": SYSTEM})]
    runs = []
    for fmt, path in sources.items():
        for label, extra in settings if fmt != "cloze" else settings[:1]:
            name = f"{fmt}-{label.split()[0]}{'-chat' if extra.get('chat') else ''}"
            runs.append((label, EvalTaskConfig(name=name, path=str(path), format=fmt, max_tokens=6, **extra)))

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    url = serve_app.start({"m": args.checkpoint}, ServeConfig(port=args.port), use_gpu=False,
                          name="amalia-parity").base_url
    rows = []
    try:
        for label, task in runs:
            ours = run_task(task, Path(task.path), base_url=url, model="m", settings=EvalConfig())
            folder = tmp / "lm-eval" / task.name
            export_lm_eval(task, Path(task.path), folder)
            theirs = lm_eval.simple_evaluate(
                model="local-completions", tasks=[task.name], task_manager=TaskManager(include_path=str(folder)),
                model_args=f"model=m,base_url={url}/completions,tokenizer={args.checkpoint},"
                           "tokenizer_backend=huggingface,num_concurrent=4,max_retries=3",
                apply_chat_template=task.chat, system_instruction=task.system_prompt)["results"][task.name]
            for metric in metrics_of(task):
                theirs_value = theirs.get(f"{metric},none", theirs.get(f"{metric},first_word"))
                theirs_value = None if theirs_value is None else float(theirs_value)  # numpy's, from lm-eval
                rows.append({"format": task.format, "setting": label, "items": ours["n"], "metric": metric,
                             "ours": round(ours["scores"][metric], 4),
                             "lm_eval": None if theirs_value is None else round(theirs_value, 4),
                             "identical": bool(theirs_value is not None and ours["scores"][metric] == theirs_value)})
    finally:
        serve_app.stop("amalia-parity")
        ray.shutdown()
    print(json.dumps({"benchmark": "lmeval_parity", "checkpoint": str(args.checkpoint), "lm_eval":
                      lm_eval.__version__, "rows": rows, "all_identical": all(r["identical"] for r in rows)},
                     indent=2))


if __name__ == "__main__":
    main()
