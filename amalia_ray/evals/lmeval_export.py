"""Export our tasks as lm-eval task YAML (plus the items in one normalized JSON-lines file next to it), so the same
items and prompts can be run with `lm_eval --tasks NAME --include_path DIR`. Log-likelihood choice tasks reproduce our
scoring exactly (the parity test runs both); generation tasks carry the same prompt and a first-word / letter
filter. Judge and variety tasks have no lm-eval counterpart."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from amalia_ray.core.config import EvalTaskConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.evals import generate, loglik
from amalia_ray.evals.fewshot import fewshot_pool, with_shots
from amalia_ray.evals.tasks import CHOICE_FORMATS, LETTERS, ClozeItem, MCItem, lettered_options, load_task


def export_lm_eval(task: EvalTaskConfig, task_path: Path, out_dir: Path) -> Path:
    if task.format not in (*CHOICE_FORMATS, "cloze"):
        raise AmaliaError(f"task '{task.name}': lm-eval has no counterpart for '{task.format}' tasks "
                          "(LLM-judged, variety and sampled exact-answer tasks run with `amalia eval` only)")
    all_items = load_task(task_path, task.format)
    items = with_shots(task, task_path, all_items)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = _write_rows(out_dir / f"{task.name}.jsonl", items, task.format)
    spec: dict = {"task": task.name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
                  "test_split": "test"}
    if task.num_fewshot:
        # lm-eval draws the examples itself, from this pool, with the same seed and order as ours
        pool, own = fewshot_pool(task, task_path, all_items)
        if own and task.limit:
            raise AmaliaError(f"task '{task.name}': examples drawn from the task's own items are exported without "
                              "a limit (lm-eval would draw them from the limited items only)")
        if not own:
            shots = _write_rows(out_dir / f"{task.name}.fewshot.jsonl", pool, task.format)
            spec["dataset_kwargs"]["data_files"]["train"] = str(shots.resolve())
        spec |= {"fewshot_split": "test" if own else "train", "num_fewshot": task.num_fewshot,
                 "fewshot_config": {"sampler": "default"}}
    if task.format == "cloze":
        spec |= {"output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{target}}",
                 "generation_kwargs": {"until": ["\n"], "max_gen_toks": task.max_tokens, "temperature": 0.0},
                 "filter_list": [{"name": "first_word", "filter": [
                     {"function": "regex", "regex_pattern": r"^\s*([^\s.,;:!?]+)", "group_select": 0},
                     {"function": "take_first"}]}],
                 "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    elif task.scoring == "loglik":
        spec |= {"output_type": "multiple_choice", "description": "{{description}}", "doc_to_text": "{{query}}",
                 "doc_to_choice": "{{continuations}}", "doc_to_target": "{{answer}}", "target_delimiter": loglik.DELIMITER,
                 "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                                 for m in ("acc", "acc_norm")]}
    else:
        spec |= {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                 "doc_to_target": "{{letter}}",
                 "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": task.max_tokens, "temperature": 0.0},
                 "filter_list": [{"name": "letter", "filter": [
                     {"function": "regex", "regex_pattern": r"\b([A-Za-z])\b", "group_select": 0},
                     {"function": "take_first"}]}],
                 "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                  "ignore_case": True}]}
    spec["metadata"] = {"version": 1, "exported_by": "amalia-ray", "format": task.format, "source": str(task_path)}
    path = out_dir / f"{task.name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


def _write_rows(path: Path, items: list, fmt: str) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(_row(it, fmt), ensure_ascii=False) + "\n")
    return path


def _row(item, fmt: str) -> dict:
    if isinstance(item, ClozeItem):
        return {"id": item.id, "context": item.context, "target": item.target}
    assert isinstance(item, MCItem)
    return {"id": item.id, "question": item.question, "choices": item.choices, "answer": item.answer,
            "letter": (item.labels or LETTERS)[item.answer], "options": lettered_options(item.choices),
            "context": loglik.context_of(item), "description": loglik.description_of(item),
            "query": loglik.query_of(item), "continuations": loglik.continuations_of(item),
            "prompt": generate.mc_prompt(item, fmt)}
