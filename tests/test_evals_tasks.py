"""Task files: every format loads, and every problem names the file and line before a request is sent."""

import json

import pytest

from amalia_ray.core.errors import AmaliaError
from amalia_ray.evals.scores import by_group, mean_and_stderr
from amalia_ray.evals.tasks import FORMATS, ClozeItem, MCItem, PromptItem, detect_format, is_completion, load_task
from tests.conftest import ROOT

SAMPLES = {"mcq": "pt_mc_sample.jsonl", "pheb": "pheb_sample.json", "binary": "saudade_sample.jsonl",
           "cloze": "cloze_sample.jsonl", "judge": "judge_sample.jsonl", "variety": "variety_sample.jsonl",
           "answer": "answer_sample.jsonl", "euroeval": "euroeval_sample.jsonl"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_our_sample_tasks_load(fmt):
    items = load_task(ROOT / "evals" / "tasks" / SAMPLES[fmt], fmt)
    assert len(items) >= 6 and len({it.id for it in items}) == len(items)
    if fmt in ("mcq", "pheb", "binary", "euroeval"):
        assert all(isinstance(it, MCItem) for it in items) and len({it.answer for it in items}) > 1
    if fmt == "euroeval":
        assert all(it.labels == ["a", "b", "c", "d"] and "subject" in it.meta for it in items)
    if fmt == "pheb":
        assert all({"year", "phase", "subject"} <= set(it.meta) for it in items)
    if fmt == "binary":
        assert all(len(it.choices) == 2 for it in items)
    if fmt == "cloze":
        assert all(isinstance(it, ClozeItem) and it.target and it.target[-1].isalnum() for it in items)
    if fmt in ("judge", "variety"):
        assert all(isinstance(it, PromptItem) for it in items)


def test_answer_forms_and_choice_dicts(tmp_path):
    rows = [{"question": "q", "choices": ["x", "y", "z"], "answer": 2},
            {"question": "q", "choices": {"A": "x", "B": "y"}, "answer": "B"},
            {"pergunta": "q", "opcoes": ["x", "y"], "resposta": "(a)"},
            {"question": "q", "options": ["x", "y"], "answer": "y"}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [it.answer for it in load_task(path, "mcq")] == [2, 1, 0, 1]
    numbered = {str(i): f"c{i}" for i in (10, 2, 1, 11, 3, 4, 5, 6, 7, 8, 9)}  # not "1", "10", "11", "2", …
    path.write_text(json.dumps({"question": "q", "choices": numbered, "answer": "c10"}))
    (item,) = load_task(path, "mcq")
    assert item.choices == [f"c{i}" for i in range(1, 12)] and item.answer == 9


def test_json_array_keeps_line_numbers(tmp_path):
    path = tmp_path / "pheb.json"
    path.write_text('[\n {"year": 2020, "phase": 1, "subject": "H", "question": "q", "choices": ["a", "b"],\n'
                    '  "answer": 0},\n {"year": 2020, "phase": 1, "question": "q", "choices": ["a", "b"], "answer": 0}\n]')
    with pytest.raises(AmaliaError, match=rf"{path}:4 \(item 2\): missing field 'subject'"):
        load_task(path, "pheb")


def test_a_minified_json_array_without_ids_numbers_its_items(tmp_path):
    """PHEB's all.json items carry no id: each is numbered by its place in the array, whatever the line breaks."""
    row = {"year": 2020, "phase": "1.ª Fase", "subject": "H", "question": "q", "choices": ["a", "b"], "answer": 0}
    path = tmp_path / "all.json"
    path.write_text(json.dumps([row, row, row]))
    assert [item.id for item in load_task(path, "pheb")] == ["1", "2", "3"]


@pytest.mark.parametrize(
    "fmt, line, message",
    [
        ("mcq", "{not json", "not valid JSON"),
        ("mcq", "[1, 2]", "expected a JSON object, got list"),
        ("mcq", json.dumps({"question": "q", "choices": ["a"], "answer": 0}), "'choices' must be a list"),
        ("mcq", json.dumps({"question": "q", "choices": ["a", "b"], "answer": 2}), "'answer' must be an index 0..1"),
        ("mcq", json.dumps({"question": "q", "choices": ["a", "b"], "answer": True}), "'answer' must be an index"),
        ("mcq", json.dumps({"choices": ["a", "b"], "answer": 0}), "missing field 'question'"),
        ("mcq", json.dumps({"question": 7, "choices": ["a", "b"], "answer": 0}), "'question' must be a non-empty"),
        ("mcq", json.dumps({"id": "a", "question": "q", "choices": ["a", "b"], "answer": 0}), "duplicate id 'a'"),
        ("binary", json.dumps({"question": "q", "choices": ["a", "b", "c"], "answer": 0}), "exactly 2 choices"),
        ("binary", json.dumps({"event_a": "x", "answer": 0}), "missing field 'event_b'"),
        ("cloze", json.dumps({"text": "palavra"}), "needs a context before its last word"),
        ("judge", json.dumps({"reference": "r"}), "missing field 'prompt'"),
        ("variety", json.dumps({"prompt": ""}), "'prompt' must be a non-empty string"),
        # digits str.isdigit takes and int() does not: superscript two, 5,000 of them
        ("mcq", json.dumps({"question": "q", "choices": ["a", "b"], "answer": "²"}), "'answer' must be an index"),
        ("mcq", json.dumps({"question": "q", "choices": ["a", "b"], "answer": "1" * 5000}), "'answer' must be"),
        ("mcq", '{"question": "q", "n": ' + "9" * 5000 + "}", r"not readable JSON \(ValueError\)"),
        ("mcq", "[" * 100_000, r"not readable JSON \(RecursionError\)"),
    ],
)
def test_malformed_task_names_file_and_line(tmp_path, fmt, line, message):
    path = tmp_path / "t.jsonl"
    good = {"mcq": {"id": "a", "question": "q", "choices": ["a", "b"], "answer": 1},
            "binary": {"event_a": "x", "event_b": "y", "answer": "A"}, "cloze": {"text": "a b"},
            "judge": {"prompt": "p"}, "variety": {"prompt": "p"}}[fmt]
    path.write_text(json.dumps(good) + "\n\n" + line + "\n")
    with pytest.raises(AmaliaError, match=f"{path}:3: .*{message}"):
        load_task(path, fmt)


def test_empty_missing_and_unknown_format(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(AmaliaError, match="no items"):
        load_task(tmp_path / "empty.jsonl", "mcq")
    with pytest.raises(AmaliaError, match="task file not found"):
        load_task(tmp_path / "nope.jsonl", "mcq")
    with pytest.raises(AmaliaError, match="unknown task format 'exam'"):
        load_task(tmp_path / "empty.jsonl", "exam")


def test_stderr_and_groups():
    mean, se = mean_and_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx(0.288675, rel=1e-5)
    rows = [{"acc": 1.0, "meta": {"subject": "M"}}, {"acc": 0.0, "meta": {"subject": "M"}},
            {"acc": 1.0, "meta": {"subject": "H"}}]
    groups = by_group(rows, "subject", ("acc",))
    assert groups["M"]["acc"] == 0.5 and groups["M"]["n"] == 2 and groups["H"]["acc"] == 1.0


def pheb_item(subject: str, group: str, number: str, question: str, completion: bool, answer: int = 0) -> dict:
    """An item in the schema of PHEB's own files (all.json and the per-subject files): no id."""
    return {"year": 2019, "phase": "1.ª Fase", "subject": subject, "question_group": group,
            "question_number": number, "question": question, "answer": answer,
            "choices": ["uma", "duas", "três", "quatro"], "is_completion": completion}


def test_pheb_files_as_published_a_folder_of_subjects_and_the_format_told_by_the_fields(tmp_path):
    """PHEB's layout: all.json joins the per-subject files, whose items carry year, phase, subject, group, number
    and is_completion but no id. The folder reads the subject files (not all.json again), each item named by its
    exam and question — the same names as all.json gives them — and the format needs no flag."""
    portuguese = [pheb_item("Portuguese", "GRUPO II", "1", "Texto.\n\nO recurso a interrogativas serve ao autor como",
                            True), pheb_item("Portuguese", "GRUPO II", "2", "Qual é a função do advérbio?", False, 2)]
    maths = [pheb_item("Mathematics A", "I", "1.1", "Quantas soluções tem a equação?", False, 1)]
    folder = tmp_path / "pheb"
    folder.mkdir()
    (folder / "portuguese.json").write_text(json.dumps(portuguese, ensure_ascii=False, indent=2))
    (folder / "mathematics_a.json").write_text(json.dumps(maths, ensure_ascii=False, indent=2))
    (folder / "all.json").write_text(json.dumps(portuguese + maths, ensure_ascii=False, indent=2))
    assert detect_format(folder) == "pheb" == detect_format(folder / "all.json")
    items = load_task(folder, "pheb")
    assert [it.id for it in items] == ["2019 1.ª Fase Mathematics A I 1.1", "2019 1.ª Fase Portuguese GRUPO II 1",
                                       "2019 1.ª Fase Portuguese GRUPO II 2"]
    assert sorted(it.id for it in load_task(folder / "all.json", "pheb")) == [it.id for it in items]
    assert [is_completion(it) for it in items] == [False, True, False] and items[2].answer == 2
    assert items[1].meta["question_group"] == "GRUPO II" and items[1].meta["subject"] == "Portuguese"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{**maths[0], "is_completion": "sim"}]))
    with pytest.raises(AmaliaError, match=rf"{bad}:1 \(item 1\): field 'is_completion' must be true or false"):
        load_task(bad, "pheb")


@pytest.mark.parametrize(("row", "fmt"), [
    ({"question": "q", "choices": ["a", "b"], "answer": 0}, "mcq"),
    ({"event_a": "a", "event_b": "b", "answer": 0}, "binary"),
    ({"text": "O céu é azul"}, "cloze"), ({"context": "O céu é", "target": "azul"}, "cloze")])
def test_the_format_is_told_by_the_first_items_fields(tmp_path, row, fmt):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert detect_format(path) == fmt


def test_a_prompt_only_file_or_an_empty_folder_says_what_is_missing(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "Escreve um poema."}) + "\n")
    with pytest.raises(AmaliaError, match=rf"{path}:1: cannot tell the task's format from its fields \(prompt\)"):
        detect_format(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AmaliaError, match="a task folder needs .json or .jsonl files"):
        load_task(tmp_path / "empty", "mcq")


def test_choices_keyed_by_a_digit_int_refuses_still_load(tmp_path):
    """"²" is a digit to str.isdigit, not to int(): such a key sorts with the letters, it does not crash the load."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "q", "choices": {"B": "b", "²": "a", "A": "c"}, "answer": "A"}) + "\n")
    (item,) = load_task(path, "mcq")
    assert item.choices == ["c", "b", "a"] and item.answer == 0
