"""Task files and their formats. A task file is JSON lines (one item per line) or one JSON array of items (a task
may also be a folder of such files); every problem is reported with the file and line it is on, before any request
is sent.

Formats (AMALIA's public benchmark shapes plus our own):
- `mcq`: CulturaVivaPT / ALBA-MCQ style multiple choice — question, choices (a list, or a dict keyed A, B, …), answer
  (an index, a letter, or the text of the right choice);
- `pheb`: Portuguese national exams, PHEB's own files (`all.json` or its per-subject files, or a folder of them) —
  `year`, `phase`, `subject`, `question`, `choices`, `answer` index, and where the file has them `question_group`,
  `question_number` (together they name the item) and `is_completion` (the question is a sentence the right choice
  completes); scores are also broken down by subject;
- `binary`: SAUDADE-style binary ordering — `event_a`, `event_b` and which came first (`answer` 0/1 or A/B), or a
  question with exactly two choices;
- `cloze`: last-word prediction — `text` whose last word is the target, or `context` and `target`;
- `judge`: open generation graded by an LLM judge — `prompt`, optional `reference` and `rubric`;
- `variety`: prompts whose generations are scored pt-PT vs pt-BR — `prompt`;
- `answer`: problems with one exact answer (arithmetic, GSM8K-style) — `prompt` (or `question`) and `answer`; the
  answer is read from the generation (`<answer>`, `\\boxed{}`, else the last number) and numbers compare as numbers;
- `euroeval`: EuroEval's multiple-choice datasets (pt-exams, alba-mcq-pt, cultura-viva-pt, saudade-pt, …) as
  Hugging Face `datasets` keeps them — a Hub snapshot folder (its Parquet files), a `save_to_disk` folder, or one
  Parquet / Arrow / JSON file — read with the `datasets` library, its `test` split: `text` (the question, then
  "Opções:" and "a. …" lines) and `label` (the right option's letter); answered by naming the letter, with
  EuroEval's Portuguese prompts.
"""

from __future__ import annotations

import itertools
import json
import re
import string
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from amalia_ray.core.config import CHOICE_TASKS, EvalTaskConfig, TaskFormat
from amalia_ray.core.errors import AmaliaError

FORMATS = typing.get_args(TaskFormat)
CHOICE_FORMATS = CHOICE_TASKS
EVALUATED_SPLIT = "test"  # of a dataset with splits (EuroEval's: train, val, test)
FEWSHOT_SPLIT = "train"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
PUNCTUATION = string.punctuation + "«»“”‘’…—–"
BINARY_QUESTION = "Qual destes dois acontecimentos aconteceu primeiro?"

# the same field under the names public task files use
QUESTION = ("question", "pergunta", "query")
CHOICES = ("choices", "options", "opcoes", "opções", "alternativas")
ANSWER = ("answer", "label", "gold", "resposta", "correct")
PROMPT = ("prompt", "instruction", "question", "pergunta")


@dataclass(frozen=True)
class MCItem:
    id: str
    question: str
    choices: list[str]
    answer: int
    meta: dict = field(default_factory=dict)
    # the options' labels when the question shows its options and is answered by naming one (EuroEval's "a", "b", …);
    # None: answered by the option's own text
    labels: list[str] | None = None
    shots: tuple[MCItem, ...] = ()  # answered examples shown before it (few-shot)


@dataclass(frozen=True)
class ClozeItem:
    id: str
    context: str
    target: str
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PromptItem:
    id: str
    prompt: str
    reference: str | None = None
    rubric: str | None = None
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AnswerItem:
    id: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


Item = MCItem | ClozeItem | PromptItem | AnswerItem


def lettered_options(choices: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))


class TaskError(AmaliaError):
    pass


def task_files(path: Path) -> list[Path]:
    """A task file, or every JSON / JSON-lines file of a folder in name order; in a folder that also holds other files,
    `all.json` is left out (PHEB's layout: it joins the per-subject files)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TaskError(f"task file not found: {path}")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".jsonl"))
    if len(files) > 1:
        files = [p for p in files if p.name != "all.json"]
    if not files:
        raise TaskError(f"{path}: a task folder needs .json or .jsonl files, found none")
    return files


def read_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(location, record) for every item of a JSON-lines file or a JSON array (or of every such file in a folder),
    location = `file:line`."""
    if path.is_dir() or not path.exists():
        for file in task_files(path):
            yield from read_records(file)
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if text.lstrip().startswith("["):
        yield from _json_array(path, text)
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
        except (ValueError, RecursionError) as e:  # a 5,000-digit number; nesting past the parser's depth
            raise TaskError(f"{where}: not readable JSON ({type(e).__name__})") from None
        yield where, _object(row, where)


def _json_array(path: Path, text: str) -> Iterator[tuple[str, dict]]:
    """Walks the array element by element so that each item keeps its line number."""
    decoder = json.JSONDecoder()
    counted = [0, 1]  # (position, its line): items come in order, so each count starts where the last ended

    def line_of(pos: int) -> int:
        counted[:] = [pos, counted[1] + text.count("\n", counted[0], pos)]
        return counted[1]

    pos = text.index("[") + 1
    for index in itertools.count(1):
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == "]":
            return
        where = f"{path}:{line_of(pos)} (item {index})"  # a minified array has every item on line 1
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise TaskError(f"{where}: not readable JSON ({type(e).__name__})") from None
        yield where, _object(row, where)
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos += 1
        elif pos >= len(text) or text[pos] != "]":
            raise TaskError(f"{path}:{line_of(pos)}: expected ',' or ']' between array items")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _object(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _field(row: dict, names: tuple[str, ...], where: str, required: bool = True):
    for name in names:
        if name in row:
            return row[name]
    if required:
        raise TaskError(f"{where}: missing field '{names[0]}'" + (f" (or {', '.join(names[1:])})" if names[1:] else ""))
    return None


def _text(row: dict, names: tuple[str, ...], where: str, required: bool = True) -> str | None:
    value = _field(row, names, where, required)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise TaskError(f"{where}: field '{names[0]}' must be a non-empty string")
    return value


def _choices(row: dict, where: str) -> list[str]:
    value = _field(row, CHOICES, where)
    if isinstance(value, dict):  # {"A": "...", "B": "..."}, or numbered keys {"1": ..., …, "10": ...}
        value = [value[k] for k in sorted(value, key=lambda k: (0, int(k), "") if _small_number(k) else (1, 0, k))]
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(c, str) and c.strip() for c in value):
        raise TaskError(f"{where}: field 'choices' must be a list (or A/B/… dict) of at least 2 non-empty strings")
    return value


def _small_number(text: str) -> bool:
    """ASCII digits int() takes: "²" and "٣" are digits to str.isdigit, and int() refuses 5,000 of them."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def _answer(value, choices: list[str], where: str) -> int:
    """An index, a letter (`B`, `(b)`, `B)`), or the right choice's text."""
    n = len(choices)
    if isinstance(value, bool):
        pass
    elif isinstance(value, int) and 0 <= value < n:
        return value
    elif isinstance(value, str):
        letter = re.fullmatch(r"\s*\(?([A-Za-z])[).]?\s*", value)
        if letter and LETTERS.index(letter.group(1).upper()) < n:
            return LETTERS.index(letter.group(1).upper())
        if value in choices:
            return choices.index(value)
        if _small_number(value.strip()) and 0 <= int(value) < n:
            return int(value)
    raise TaskError(f"{where}: field 'answer' must be an index 0..{n - 1}, a letter A..{LETTERS[n - 1]} "
                    f"or the text of one choice, got {value!r}")


def _id(row: dict, where: str) -> str:
    """The item's own id, else its position: the item number in a JSON array (PHEB's items have no id), the line
    in a JSON-lines file."""
    if "id" in row:
        return str(row["id"])
    item = re.search(r"\(item (\d+)\)$", where)
    return item.group(1) if item else where.rsplit(":", 1)[-1]


def _mc(row: dict, where: str, meta_fields: tuple[str, ...] = ()) -> MCItem:
    choices = _choices(row, where)
    meta = {k: row[k] for k in meta_fields if k in row}
    return MCItem(_id(row, where), _text(row, QUESTION, where), choices,
                  _answer(_field(row, ANSWER, where), choices, where), meta)


PHEB_FIELDS = ("year", "phase", "subject", "question_group", "question_number", "is_completion")


def _pheb(row: dict, where: str) -> MCItem:
    for name in ("year", "phase", "subject"):
        if name not in row:
            raise TaskError(f"{where}: missing field '{name}' (PHEB items carry year, phase and subject)")
    if not isinstance(row.get("is_completion", False), bool):
        raise TaskError(f"{where}: field 'is_completion' must be true or false, got {row['is_completion']!r}")
    item = _mc(row, where, PHEB_FIELDS)
    if "id" not in row and "question_group" in row and "question_number" in row:
        # PHEB's items have no id: an exam (year, phase, subject) and the question's group and number name one,
        # the same in all.json and in the subject's own file
        name = " ".join(str(row[k]) for k in ("year", "phase", "subject", "question_group", "question_number"))
        item = replace(item, id=name)
    return item


def is_completion(item: MCItem) -> bool:
    """The question is a sentence that the right choice completes (PHEB's `is_completion`)."""
    return bool(item.meta.get("is_completion"))


def _binary(row: dict, where: str) -> MCItem:
    if "event_a" in row or "event_b" in row:
        choices = [_text(row, ("event_a",), where), _text(row, ("event_b",), where)]
        question = _text(row, QUESTION, where, required=False) or BINARY_QUESTION
        return MCItem(_id(row, where), question, choices, _answer(_field(row, ANSWER, where), choices, where))
    item = _mc(row, where)
    if len(item.choices) != 2:
        raise TaskError(f"{where}: a binary item has exactly 2 choices, got {len(item.choices)}")
    return item


def _cloze(row: dict, where: str) -> ClozeItem:
    if "text" in row:
        text = _text(row, ("text",), where).rstrip()
        if " " not in text:
            raise TaskError(f"{where}: field 'text' needs a context before its last word")
        context, target = text.rsplit(" ", 1)
        return ClozeItem(_id(row, where), context, target.strip(PUNCTUATION) or target)
    return ClozeItem(_id(row, where), _text(row, ("context",), where), _text(row, ("target",), where).strip())


def _prompt(row: dict, where: str) -> PromptItem:
    return PromptItem(_id(row, where), _text(row, PROMPT, where), _text(row, ("reference",), where, required=False),
                      _text(row, ("rubric",), where, required=False))


def _answer_item(row: dict, where: str) -> AnswerItem:
    value = _field(row, ANSWER, where)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise TaskError(f"{where}: field 'answer' must be a number or a non-empty string, got {value!r}")
    return AnswerItem(_id(row, where), _text(row, PROMPT, where), str(value))


_OPTION = re.compile(r"([a-z])\. (.*)")


def _euroeval(row: dict, where: str) -> MCItem:
    """EuroEval's multiple-choice row: `text` = the question, a header line ("Opções:") and one "a. …" line per
    option, `label` = the right option's letter; the other scalar columns (subject, year, …) are kept as meta."""
    text = _text(row, ("text",), where)
    lines = text.rstrip().split("\n")
    options: list[tuple[str, str]] = []
    while lines and (m := _OPTION.fullmatch(lines[-1].strip())):
        options.insert(0, (m.group(1), m.group(2).strip()))
        lines.pop()
    labels = [letter for letter, _ in options]
    if len(options) < 2 or labels != list(string.ascii_lowercase[:len(options)]) or len(lines) < 2 \
            or not lines[-1].rstrip().endswith(":"):
        raise TaskError(f"{where}: field 'text' must end with its options as EuroEval writes them: a header line "
                        "such as 'Opções:' and then one line per option, 'a. …', 'b. …', …")
    label = row.get("label")
    if not isinstance(label, str) or label.strip().lower() not in labels:
        raise TaskError(f"{where}: field 'label' must be one of the options' letters {', '.join(labels)}, "
                        f"got {label!r}")
    meta = {k: v for k, v in row.items() if k not in ("text", "label", "id") and isinstance(v, (str, int, float))}
    return MCItem(str(row["id"]) if "id" in row else where.rsplit(" ", 1)[-1], text.strip(),
                  [t for _, t in options], labels.index(label.strip().lower()), meta, labels)


PARSERS = {"mcq": _mc, "pheb": _pheb, "binary": _binary, "cloze": _cloze, "judge": _prompt, "variety": _prompt,
           "answer": _answer_item, "euroeval": _euroeval}


def item_text(item: Item) -> str:
    """What of an item could appear in training text: the question and its choices, the context and its target,
    the prompt and its reference (decontamination looks for these)."""
    if isinstance(item, MCItem):
        return "\n".join([item.question, *item.choices])
    if isinstance(item, ClozeItem):
        return f"{item.context} {item.target}"
    if isinstance(item, AnswerItem):
        return f"{item.prompt}\n{item.answer}"
    return "\n".join([item.prompt, *([item.reference] if item.reference else [])])


def is_dataset(path: Path) -> bool:
    """A Parquet / Arrow file, or a folder of them or a `save_to_disk` one: read with the `datasets` library."""
    if path.is_file():
        return path.suffix in (".parquet", ".arrow")
    return path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()
                              or any(p.suffix in (".parquet", ".arrow") for p in path.rglob("*")))


def _load_dataset(path: Path):
    """A DatasetDict (or one Dataset) as the `datasets` library reads it from local files (nothing is downloaded)."""
    import datasets

    if not path.exists():
        raise TaskError(f"task file not found: {path}")
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            return datasets.load_from_disk(str(path))
        if path.is_dir():
            return datasets.load_dataset(str(path))
        builder = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}.get(path.suffix)
        if builder is None:
            raise TaskError(f"{path}: a dataset file is Parquet, Arrow or JSON (.parquet, .arrow, .json, .jsonl)")
        return datasets.load_dataset(builder, data_files=str(path))
    except TaskError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's many error types, reported as one line
        raise TaskError(f"{path}: the datasets library cannot read it ({type(e).__name__}: {e})") from None


def dataset_records(path: Path, split: str = EVALUATED_SPLIT) -> Iterator[tuple[str, dict]]:
    """(location, row) of a dataset as the `datasets` library reads it: a `save_to_disk` folder, a Hub snapshot
    folder, or one Parquet / Arrow / JSON file; of a dataset with several splits, the one named `split`.
    Location = `path [split] row N`."""
    import datasets

    loaded, name = _load_dataset(path), split
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded and len(loaded) > 1:
            raise TaskError(f"{path}: no '{split}' split (it has {', '.join(loaded)})")
        name = split if split in loaded else next(iter(loaded))
        loaded = loaded[name]
    for n, row in enumerate(loaded):
        yield f"{path} [{name}] row {n}", row


def dataset_splits(path: Path) -> list[str]:
    """The split names of a dataset with several (none for a task file or a dataset of one split)."""
    import datasets

    if not is_dataset(path):
        return []
    loaded = _load_dataset(path)
    return list(loaded) if isinstance(loaded, datasets.DatasetDict) and len(loaded) > 1 else []


def records(path: Path, fmt: str, split: str = EVALUATED_SPLIT) -> Iterator[tuple[str, dict]]:
    return dataset_records(path, split) if fmt == "euroeval" or is_dataset(path) else read_records(path)


def detect_format(path: Path) -> str:
    """The format a task file's first item has the fields of; a prompt-only file (judge or variety) must say which."""
    for where, row in records(path, ""):
        if {"text", "label"} <= row.keys():
            return "euroeval"
        if {"year", "phase", "subject"} <= row.keys():
            return "pheb"
        if "event_a" in row or "event_b" in row:
            return "binary"
        if any(k in row for k in CHOICES):
            return "mcq"
        if "text" in row or {"context", "target"} <= row.keys():
            return "cloze"
        if any(k in row for k in PROMPT) and any(k in row for k in ANSWER):
            return "answer"
        raise TaskError(f"{where}: cannot tell the task's format from its fields ({', '.join(sorted(row))}): "
                        f"give it (one of {', '.join(FORMATS)})")
    raise TaskError(f"{path}: no items")


def task_of_file(path: Path, name: str | None = None, format: str | None = None, **fields) -> EvalTaskConfig:
    """A task given by its file alone, as `amalia eval --task` takes it: named after the file (unless `name`),
    its format told by the first item's fields (unless `format`)."""
    name = name or re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip("-._") or "task"
    return EvalTaskConfig(name=name, path=str(path), format=format or detect_format(path), **fields)


def load_task(path: Path, fmt: str, limit: int | None = None, split: str = EVALUATED_SPLIT) -> list[Item]:
    if fmt not in PARSERS:
        raise TaskError(f"unknown task format '{fmt}': expected one of {', '.join(FORMATS)}")
    items, seen = [], {}
    for where, row in records(path, fmt, split):
        item = PARSERS[fmt](row, where)
        if item.id in seen:
            raise TaskError(f"{where}: duplicate id '{item.id}' (first at {seen[item.id]})")
        seen[item.id] = where
        items.append(item)
    if not items:
        raise TaskError(f"{path}: no items")
    return items[:limit] if limit else items
