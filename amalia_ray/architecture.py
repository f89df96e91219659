"""The architecture document (docs/architecture.md), written from the code so it cannot drift from it: the layers
(`LAYERS`, which tests/test_layers.py also holds every import to) and one section per package, its `__init__`
docstring as the paragraph and each module's first docstring sentence. `python -m amalia_ray.architecture >
docs/architecture.md` rewrites it; a test fails when the file and the code disagree. Reads the source with `ast`:
nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the layers, top down: a module may import its own layer and those below it, and a stage no other stage
LAYERS = {"cli": 3, "jobs": 3, "pipeline": 2, "data": 1, "train": 1, "serve": 1, "evals": 1, "cluster": 1, "core": 0}
PACKAGES = ("amalia_ray", "jobs")

HEADER = """# Architecture

Written from the code by `python -m amalia_ray.architecture` (`make docs`): each section is a package's own
docstring and the first sentence of each of its modules'. A test fails when this file and the code disagree.

## Layers

Dependencies point one way, from the entry points down:

| Layer | Packages | May import |
|---|---|---|
| entry points | {entry} | the pipeline, or a stage's public API directly (`amalia serve`, `amalia eval`), and core |
| pipeline | {pipeline} | the stages and core |
| stages | {stages} | core only: no stage imports another |
| base | {base} | nothing of the stages |

Evaluation reaches models only over HTTP; the recipe's models (`core/config/`) import nothing else of ours; no two
modules import each other, directly or round a longer circle, at module level or inside a function.
`tests/test_layers.py` reads every import and holds the code to this.

To follow a recipe from `amalia run` to an objective's loss: `cli/run_commands.py` → `pipeline/runner.py` (the
stages in order) → `pipeline/stages.py` (a recipe section wired to its stage) → `train/train_stage.py` (the Ray
Train trainer) → `train/loop.py` (`setup`, `train_step`) → `train/objectives/registry.py` → the objective's module
and its `loss`.
"""

OUTSIDE = """## Beside the package

```
recipes/             YAML recipes: demo.yaml (the demo run), finetune.yaml (post-training an export as a base model),
                     amalia-9b.yaml (EuroLLM-9B continued-pretrained and post-trained; models/ holds the base's
                     config.json for `amalia plan` offline); sweeps/ holds search spaces for `amalia sweep`
evals/tasks/         our own small task files in every format the evaluation reads
tests/               pytest; `-m e2e` marks the slow end-to-end tests (one Ray cluster per session)
bench/               benchmarks that print JSON (results in bench/results/); bench/gpu/ one-shot checks for a GPU
cluster.yaml         the Ray cluster launcher's config
deploy/              KubeRay RayCluster and RayJob manifests (kuberay/), the GPU image (Dockerfile)
docs/                this file, the recipe reference (written from the recipe's models), guides per stage
```
"""


def _docstring(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no docstring: say in one sentence what it is for")
    return doc


def _paragraph(text: str) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join(text.split("\n\n")[0].split())


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (followed by a capital, a quote or backtick, or the end)."""
    para = _paragraph(text)
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\d)\.(?=\s+[A-Z`\"(]|$)", para)
    sentence = para[:match.end()] if match else para
    return sentence[:-1] + "." if sentence.endswith(":") else sentence  # one that introduces an example


def _layer_of(package: str) -> str:
    parts = package.split("/")
    return parts[0] if parts[0] == "jobs" else parts[1] if len(parts) > 1 else ""


def render() -> str:
    levels = {n: [p for p, lvl in LAYERS.items() if lvl == n] for n in set(LAYERS.values())}
    names = {n: ", ".join(f"`{p}`" for p in ps) for n, ps in levels.items()}
    out = [HEADER.format(entry=names[3], pipeline=names[2], stages=names[1], base=names[0]), "## Packages", ""]
    packages = sorted({p.parent for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")},
                      key=lambda d: (LAYERS.get(_layer_of(str(d.relative_to(ROOT))), 4) * -1, str(d)))
    for folder in packages:
        rel = folder.relative_to(ROOT)
        out += [f"### `{rel}/`", "", _paragraph(_docstring(folder / "__init__.py")), ""]
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py":
                out.append(f"- `{module.name}`: {first_sentence(_docstring(module))}")
        subpackages = sorted(d.name for d in folder.iterdir() if (d / "__init__.py").is_file())
        out += [f"- `{name}/`: below" for name in subpackages]
        out.append("")
    out.append(OUTSIDE)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
