"""What the docs name exists: every test docs/reliability.md cites runs in `make reliability`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _marked(node: ast.AST, marker: str) -> bool:
    return f"mark.{marker}" in ast.unparse(node)


def _reliability_tests(path: Path) -> tuple[bool, set[str]]:
    """(the whole file is marked, the names of the test functions marked one by one)."""
    tree = ast.parse(path.read_text(), str(path))
    whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                and _marked(n.value, "reliability") for n in tree.body)
    one_by_one = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and any(_marked(d, "reliability") for d in n.decorator_list)}
    return whole, one_by_one


def test_every_test_the_reliability_table_cites_is_in_make_reliability():
    """A row's test cell names files (`tests/test_x.py`) and tests by the start of their name
    (`tests/test_x.py::test_a_killed_driver…`, then `…::test_other…` in the file named last): each test must be marked
    `reliability` (`make reliability` runs `-m reliability`), and a file named whole must hold marked tests."""
    cells = [line.rstrip(" |").rsplit(" | ", 1)[-1]
             for line in (ROOT / "docs" / "reliability.md").read_text().splitlines()
             if line.startswith("| ") and "tests/" in line]
    assert len(cells) > 20, "the table's test column was not found"
    unmarked, cited, file = [], 0, None
    for cell in cells:  # "…::test_x" is in the file named last, in this row or the one above
        for ref in re.findall(r"`([^`]+)`", cell):
            m = re.fullmatch(r"(?:(tests/\w+\.py)|…)(?:::(\w+)…?)?", ref)
            if not m:
                continue
            file = m.group(1) or file
            whole, one_by_one = _reliability_tests(ROOT / file)
            names = {n.name for n in ast.parse((ROOT / file).read_text()).body
                     if isinstance(n, ast.FunctionDef) and n.name.startswith(m.group(2) or "test_")}
            cited += 1
            if m.group(2):
                assert names, f"{ref}: no such test in {file}"
                unmarked += [f"{file}::{n}" for n in names if not whole and n not in one_by_one]
            elif not whole and not one_by_one:
                unmarked.append(file)
    assert cited > 30 and not unmarked, f"cited in docs/reliability.md, not marked reliability: {unmarked}"
