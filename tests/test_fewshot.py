"""Few-shot prompts are lm-eval's: our task exported with `num_fewshot`, lm-eval 0.4's own task builder draws its
examples (its sampler, its seed) and lays out its contexts; every context and continuation it would send equals ours,
item by item — for examples drawn from the task's own items (the item itself left out) and from a dataset's train
split. (Scoring them on a served model, against lm-eval's numbers: test_e2e.py's parity test.)"""

from __future__ import annotations

import json

import pytest

from amalia_ray.core.config import EvalTaskConfig
from amalia_ray.core.errors import AmaliaError
from amalia_ray.evals import loglik
from amalia_ray.evals.fewshot import task_items
from amalia_ray.evals.lmeval_export import export_lm_eval
from tests.test_euroeval import _row


def _lm_eval_task(task: EvalTaskConfig, path, out):
    """The task as lm-eval loads it from our export (its own tasks left unindexed: seconds each time)."""
    from lm_eval.tasks import TaskManager

    export_lm_eval(task, path, out)
    lm_task = TaskManager(include_path=str(out), include_defaults=False).load_task_or_group([task.name])[task.name]
    lm_task.set_fewshot_seed(1234)  # simple_evaluate's default fewshot_random_seed
    return lm_task


def _lm_eval_requests(task: EvalTaskConfig, path, out) -> dict[int, list[tuple[str, str]]]:
    """What lm-eval would send for each document: (context, continuation) per choice."""
    lm_task = _lm_eval_task(task, path, out)
    lm_task.build_all_requests(limit=task.limit)
    requests: dict[int, list[tuple[str, str]]] = {}
    for instance in sorted(lm_task.instances, key=lambda i: (i.doc_id, i.idx)):
        requests.setdefault(instance.doc_id, []).append(instance.arguments)
    return requests


def _ours(task: EvalTaskConfig, path) -> dict[int, list[tuple[str, str]]]:
    return {i: [(loglik.context_of(item), loglik.DELIMITER + c) for c in loglik.continuations_of(item)]
            for i, item in enumerate(task_items(task, path))}


def test_examples_from_the_tasks_own_items_give_lm_evals_prompts(tmp_path):
    rows = [{"id": f"q{i}", "question": f"Quanto é {i} mais {i}?", "choices": [str(2 * i), str(2 * i + 1), "zero"],
             "answer": 0} for i in range(12)]
    path = tmp_path / "soma.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
    task = EvalTaskConfig(name="soma", path=str(path), num_fewshot=3)
    ours = _ours(task, path)
    assert ours == _lm_eval_requests(task, path, tmp_path / "lm")
    items = task_items(task, path)
    assert all(len(it.shots) == 3 and it.id not in {s.id for s in it.shots} for it in items), "never the item"
    first = ours[0][0][0]
    assert first.count("Pergunta:") == 4 and first.endswith("Pergunta: Quanto é 0 mais 0?\nResposta:")
    shot = items[0].shots[0]
    assert first.startswith(f"Pergunta: {shot.question}\nResposta: {shot.choices[shot.answer]}\n\n")
    assert [[s.id for s in it.shots] for it in task_items(task, path)] == [[s.id for s in it.shots] for it in items]
    with pytest.raises(AmaliaError, match="without a limit"):
        export_lm_eval(task.model_copy(update={"limit": 5}), path, tmp_path / "lm2")


def test_examples_from_a_datasets_train_split_give_lm_evals_prompts(tmp_path):
    import datasets

    train = [_row(f"Pergunta de treino {i}?", ["sim", "não", "talvez"], "abc"[i % 3], "Treino") for i in range(6)]
    test = [_row(f"Pergunta de teste {i}?", ["um", "dois"], "ab"[i % 2], "Teste") for i in range(5)]
    folder = tmp_path / "pt-exams"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(folder))
    task = EvalTaskConfig(name="pt-exams", path=str(folder), format="euroeval", num_fewshot=3, limit=4)
    ours = _ours(task, folder)
    assert len(ours) == 4 and ours == _lm_eval_requests(task, folder, tmp_path / "lm")
    context = ours[0][0][0]
    assert context.startswith(loglik.EUROEVAL_PREFIX + "\n\nPergunta: Pergunta de treino ")
    assert context.count("Pergunta de treino") == 3 and context.endswith(
        "Pergunta: Pergunta de teste 0? Opções: a. um b. dois\nResposta:")
    assert [c for _, c in ours[0]] == [" a", " b"]


def test_few_shot_is_refused_where_it_is_not_implemented():
    with pytest.raises(ValueError, match="few-shot examples are implemented for log-likelihood choice tasks only"):
        EvalTaskConfig(name="t", path="t.jsonl", format="cloze", num_fewshot=3)


@pytest.mark.parametrize("multiturn", [False, True])
def test_chat_contexts_are_lm_evals_with_a_system_prompt_and_examples(tmp_path, multiturn):
    """lm-eval's apply_chat_template layout (system instruction + description as the system turn; the examples in
    the user turn, or as user/assistant turns with fewshot_as_multiturn): the same messages reach the chat template
    as lm-eval gives it, and scoring sends each rendered context + continuation to the scripted server, without
    special tokens added, split after the rendered context."""
    import datasets
    import httpx

    from amalia_ray.core.config import EvalConfig
    from amalia_ray.evals.evaluate import run_task
    from tests.test_evals_scoring import FakeModel, render_chat

    train = [_row(f"Pergunta de treino {i}?", ["sim", "não"], "ab"[i % 2], "Treino") for i in range(4)]
    test = [_row(f"Pergunta de teste {i}?", ["um", "dois"], "ab"[i % 2], "Teste") for i in range(3)]
    folder = tmp_path / "pt-exams"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(folder))
    task = EvalTaskConfig(name="pt-exams", path=str(folder), format="euroeval", num_fewshot=2, chat=True,
                          system_prompt="És um examinador.", fewshot_as_multiturn=multiturn)
    assert task.model_copy(update={"fewshot_as_multiturn": None}).multiturn, "lm-eval's default with chat"
    lm_task = _lm_eval_task(task, folder, tmp_path / "lm")
    lm_task.build_all_requests(system_instruction=task.system_prompt, apply_chat_template=True,
                               fewshot_as_multiturn=multiturn, chat_template=render_chat)
    theirs = {i.doc_id: i.arguments[0] for i in lm_task.instances}
    assert {i.arguments[1] for i in lm_task.instances} == {"a", "b"}, "no delimiter after the assistant's turn"
    items = task_items(task, folder)
    assert {n: render_chat(loglik.chat_of(it, task.system_prompt, multiturn)) for n, it in enumerate(items)} == theirs
    messages = loglik.chat_of(items[0], task.system_prompt, multiturn)
    assert messages[0] == {"role": "system", "content": "És um examinador.\n\n" + loglik.EUROEVAL_PREFIX + "\n\n"}
    assert len(messages) == (2 + 2 * 2 if multiturn else 2)

    fake = FakeModel(liked={"b"})
    result = run_task(task, folder, base_url="http://fake/v1", model="m", settings=EvalConfig(tasks=[task]),
                      transport=httpx.MockTransport(fake))
    request = fake.requests[0]
    assert request["add_special_tokens"] is False and request["prompt"][:2] == [theirs[0] + "a", theirs[0] + "b"]
    assert [r["pred"] for r in result["items"]] == [1, 1, 1] and result["scores"]["acc"] == pytest.approx(1 / 3)


def test_a_chat_task_on_a_server_that_cannot_render_chat_fails_with_one_clear_message(tmp_path):
    """No item is reported as refused one by one: the task stops and says what the server lacks."""
    import httpx

    from amalia_ray.core.config import EvalConfig
    from amalia_ray.evals.evaluate import run_task
    from tests.test_evals_scoring import MC, FakeModel

    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in MC))
    task = EvalTaskConfig(name="mc", path=str(path), chat=True)
    with pytest.raises(AmaliaError, match="cannot render chat messages with the model's chat template"):
        run_task(task, path, base_url="http://fake/v1", model="m", settings=EvalConfig(tasks=[task]),
                 transport=httpx.MockTransport(FakeModel(tokenize=False)))
