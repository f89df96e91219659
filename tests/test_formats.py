"""The post-training file formats: each has one row rule, applied by its writer (a bad row is refused, not written)
and by its reader (the first bad row named by file and line)."""

import json

import pytest

from amalia_ray.core.formats.conversations import read_conversations, write_conversations
from amalia_ray.core.formats.preference_pairs import read_preferences, write_preferences
from amalia_ray.core.formats.rl_tasks import read_tasks, write_tasks

CHAT = [{"role": "user", "content": "Olá?"}, {"role": "assistant", "content": "Olá."}]
FORMATS = {
    "conversations": (write_conversations, read_conversations, {"id": "a", "messages": CHAT},
                      {"messages": [{"role": "user"}]}, CHAT),
    "preference pairs": (write_preferences, read_preferences, {"prompt": CHAT[:1], "chosen": CHAT[1:],
                                                               "rejected": [{"role": "assistant", "content": "Não."}]},
                         {"prompt": "q", "chosen": CHAT[1:], "rejected": "r"}, None),
    "tasks": (write_tasks, read_tasks, {"prompt": "Quanto é 2 + 2?", "answer": "4"}, {"prompt": ""}, None),
}


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_writes_and_reads_only_rows_its_rule_allows(name, tmp_path):
    write, read, good, bad, read_back = FORMATS[name]
    path = tmp_path / "sub" / "rows.jsonl"
    assert write([good, good], path) == 2
    assert read(path) == [read_back or good] * 2
    with pytest.raises(ValueError, match="row 2 for .*rows.jsonl"):
        write(iter([good, bad]), path)
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows.jsonl:3: "):
        read(path)


def test_a_refused_row_leaves_the_file_that_was_there_and_rows_of_a_folder_get_distinct_ids(tmp_path):
    from amalia_ray.core.formats.jsonl import checked_rows, line_id
    from amalia_ray.core.formats.rl_tasks import validate_task

    path = tmp_path / "tasks.jsonl"
    write_tasks([{"prompt": "a"}, {"prompt": "b"}], path)
    with pytest.raises(ValueError, match="row 2"):
        write_tasks([{"prompt": "c"}, {"prompt": ""}], path)
    assert read_tasks(path) == [{"prompt": "a"}, {"prompt": "b"}] and not list(tmp_path.glob("*.tmp"))
    write_tasks([{"prompt": "d"}], tmp_path / "more" / "x.jsonl")
    write_tasks([{"prompt": "e"}], tmp_path / "more" / "y.jsonl")
    folder = tmp_path / "more"
    assert [line_id(folder, f, n) for f, n, _ in checked_rows(folder, "tasks", validate_task)] == ["x.jsonl:1",
                                                                                                "y.jsonl:1"]
    assert [line_id(path, f, n) for f, n, _ in checked_rows(path, "tasks", validate_task)] == ["1", "2"]
