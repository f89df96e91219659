"""The package's dependencies point one way, read from the source itself (every `import`, at module level or inside a
function): entry points (`cli`, `jobs`) → `pipeline` → stages (`data`, `train`, `serve`, `evals`, `cluster`) →
`core`; no stage imports another; the config models import nothing of ours; no two modules import each other,
directly or round a longer circle."""

from __future__ import annotations

import ast
from pathlib import Path

from amalia_ray.architecture import LAYERS as LEVELS, render

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    found = {}
    for folder in ("amalia_ray", "jobs"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of our own modules (a name imported from a package that is itself a module counts as
    that module)."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "jobs" else parts[1] if len(parts) > 1 else ""


def test_dependencies_point_one_way():
    graph = _imports(_modules())
    assert "amalia_ray.train.loop" in graph and "jobs.pipeline" in graph, "the walk found the package"
    wrong = []
    for module, imported in graph.items():
        for target in imported:
            a, b = _layer(module), _layer(target)
            if a != b and a in LEVELS and b in LEVELS and LEVELS[b] >= LEVELS[a]:
                wrong.append(f"{module} imports {target} ({a} → {b})")
    assert not wrong, "\n".join(sorted(wrong))
    config = {m for m in graph if m == "amalia_ray.core.config" or m.startswith("amalia_ray.core.config.")}
    assert len(config) > 1 and all(graph[m] <= config for m in config), \
        f"the config models import {sorted(set().union(*(graph[m] for m in config)) - config)}"


def test_no_import_circle():
    graph = _imports(_modules())
    circles, order, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    assert not circles, "modules importing each other: " + "; ".join(" ⇄ ".join(c) for c in circles)


def test_the_architecture_document_is_what_the_code_says():
    """docs/architecture.md is written from the packages' and modules' docstrings and the layer table above:
    `make docs` rewrites it after a module is added, moved or renamed."""
    assert (ROOT / "docs" / "architecture.md").read_text() == render(), "stale: run `make docs`"
