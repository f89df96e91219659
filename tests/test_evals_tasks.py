import json

import pytest

from amalia_ray.core.errors import AmaliaError
from amalia_ray.evals.loglik import mean_and_stderr
from amalia_ray.evals.tasks import load_mc
from tests.conftest import ROOT


def test_sample_task_loads():
    items = load_mc(ROOT / "evals" / "tasks" / "pt_mc_sample.jsonl")
    assert len(items) == 20 and len({it.answer for it in items}) > 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"question": "q", "choices": ["a"], "answer": 0}), "'choices' must be a list of at least 2"),
        (json.dumps({"question": "q", "choices": ["a", "b"], "answer": 2}), "'answer' must be an index"),
        (json.dumps({"choices": ["a", "b"], "answer": 0}), "'question' must be a non-empty string"),
    ],
)
def test_malformed_task_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    good = json.dumps({"question": "q", "choices": ["a", "b"], "answer": 1})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(AmaliaError, match=f"{path}:2: .*{message}"):
        load_mc(path)


def test_stderr():
    mean, se = mean_and_stderr([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx(0.288675, rel=1e-5)
