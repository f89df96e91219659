"""EuroEval's Portuguese multiple-choice datasets as a user has them locally: the Hub's snapshot folder (Parquet files
under data/, the README's split config, as `push_to_hub` writes them) and a `save_to_disk` folder, in EuroEval's
schema (`text` = question + "Opções:" + "a. …" lines, `label` = letter; train / val / test splits). Our own items,
EuroEval's layout and prompts; scored against the scripted server of test_evals_scoring.py."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from amalia_ray.core.config import EvalConfig, EvalTaskConfig
from amalia_ray.evals.lmeval_export import export_lm_eval
from amalia_ray.evals.evaluate import requests_of, run_task
from amalia_ray.evals.tasks import TaskError, detect_format, load_task
from tests.test_evals_scoring import FakeModel

PREFIX = "As seguintes são perguntas de escolha múltipla (com respostas)."


def _row(question: str, options: list[str], label: str, subject: str) -> dict:
    text = f"{question}\nOpções:\n" + "\n".join(f"{'abcd'[i]}. {o}" for i, o in enumerate(options))
    return {"text": text, "label": label, "subject": subject, "year": 2023}


TEST = [_row("Qual é a capital de Portugal?", ["Madrid", "Lisboa", "Roma", "Paris"], "b", "Geografia"),
        _row("Que rio passa no Porto?", ["Douro", "Tejo", "Mondego", "Sado"], "a", "Geografia"),
        _row("Quanto é 2 + 2?", ["3", "4"], "b", "Matemática")]
TRAIN = [_row("Qual é a cor do céu?", ["verde", "azul"], "b", "Ciências")]


def _dataset_dict():
    import datasets

    return datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                                 "val": datasets.Dataset.from_list(TRAIN),
                                 "test": datasets.Dataset.from_list(TEST)})


def hub_snapshot(folder):
    """The files of a dataset repository on the Hub: data/SPLIT-00000-of-00001.parquet and the README's configs."""
    for split, ds in _dataset_dict().items():
        ds.to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    card = {"configs": [{"config_name": "default", "data_files": [
        {"split": s, "path": f"data/{s}-*"} for s in ("train", "val", "test")]}]}
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump(card)}---\n# pt-exams\n")
    return folder


def _score(folder, tmp_path, fake, **task):
    cfg = EvalTaskConfig(name="pt-exams", path=str(folder), format=detect_format(folder), **task)
    return run_task(cfg, folder, base_url="http://fake/v1", model="m", settings=EvalConfig(tasks=[cfg]),
                    output=tmp_path / "result.json", transport=httpx.MockTransport(fake))


@pytest.mark.parametrize("layout", ["hub_snapshot", "save_to_disk"])
def test_a_euroeval_dataset_folder_is_scored_on_its_test_split_with_euroevals_prompt(tmp_path, layout):
    folder = tmp_path / "pt-exams"
    if layout == "hub_snapshot":
        hub_snapshot(folder)
    else:
        _dataset_dict().save_to_disk(str(folder))
    assert detect_format(folder) == "euroeval"
    items = load_task(folder, "euroeval")
    assert [it.id for it in items] == ["0", "1", "2"], "the test split only"
    assert items[0].choices == ["Madrid", "Lisboa", "Roma", "Paris"] and items[0].answer == 1
    assert items[0].labels == ["a", "b", "c", "d"] and items[2].labels == ["a", "b"]

    fake = FakeModel(liked={"b"})  # the scripted model likes the letter b
    result = _score(folder, tmp_path, fake)
    flat = "Qual é a capital de Portugal? Opções: a. Madrid b. Lisboa c. Roma d. Paris"
    context = f"{PREFIX}\n\nPergunta: {flat}\nResposta:"
    assert fake.requests[0]["prompt"][:4] == [f"{context} {x}" for x in "abcd"] and context in fake.tokenized
    assert result["scores"]["acc"] == pytest.approx(2 / 3) and result["n"] == 3
    assert result["by_subject"]["Geografia"]["acc"] == 0.5 and result["by_subject"]["Matemática"]["acc"] == 1.0

    shown = requests_of(EvalTaskConfig(name="t", path=str(folder), format="euroeval", method="generate",
                                       chat=True), items[2])
    assert shown["messages"][-1]["content"] == ("Pergunta: Quanto é 2 + 2? Opções: a. 3 b. 4\n\nResponde à pergunta acima usando só "
                               "'a' ou 'b', e nada mais.")

    exported = export_lm_eval(EvalTaskConfig(name="pt-exams", path=str(folder), format="euroeval"), folder,
                              tmp_path / "lm")
    spec = yaml.safe_load(exported.read_text())
    assert spec["doc_to_text"] == "{{query}}" and spec["doc_to_choice"] == "{{continuations}}"
    first = json.loads((tmp_path / "lm" / "pt-exams.jsonl").read_text().splitlines()[0])
    assert first["description"] + first["query"] == context and first["description"] == PREFIX + "\n\n"
    assert first["continuations"] == ["a", "b", "c", "d"] and first["answer"] == 1


def test_a_single_parquet_file_and_a_bad_row_named_by_file_split_and_row(tmp_path):
    import datasets

    good = tmp_path / "test.parquet"
    datasets.Dataset.from_list(TEST).to_parquet(str(good))
    assert detect_format(good) == "euroeval" and len(load_task(good, "euroeval")) == 3

    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([TEST[0], {**TEST[1], "text": "Que rio passa no Porto? Douro ou Tejo"}]).to_parquet(
        str(bad))
    with pytest.raises(TaskError, match=r"bad\.parquet \[\w+\] row 1: field 'text' must end with its options"):
        load_task(bad, "euroeval")
    wrong = tmp_path / "wrong.parquet"
    datasets.Dataset.from_list([{**TEST[2], "label": "c"}]).to_parquet(str(wrong))
    with pytest.raises(TaskError, match=r"row 0: field 'label' must be one of the options' letters a, b, got 'c'"):
        load_task(wrong, "euroeval")
    splits = tmp_path / "no-test"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "val": datasets.Dataset.from_list(TRAIN)}).save_to_disk(str(splits))
    with pytest.raises(TaskError, match=r"no 'test' split \(it has train, val\)"):
        load_task(splits, "euroeval")
