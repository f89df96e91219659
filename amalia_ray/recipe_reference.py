"""The recipe reference (docs/recipe.md), written from the pydantic models' fields and descriptions so it cannot
drift from what the loader accepts. `python -m amalia_ray.recipe_reference > docs/recipe.md` rewrites it; a test
fails when the file and the models disagree."""

from __future__ import annotations

import json
import re
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from amalia_ray.core.config import STAGE_TYPES, Recipe, TrainStageConfig

HEADER = """# Recipe reference

A recipe is one YAML file; every section below is optional except `data` and `train`. Unknown fields are errors
naming the file, line and the allowed fields. Relative paths are taken from the recipe file's folder. Written from
the models in `amalia_ray/core/config/` (`make docs`); `recipes/demo.yaml` shows every section in use.
"""


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        if all(isinstance(a, type) and issubclass(a, TrainStageConfig) for a in args):
            return "[stage](#training-stages)"
        return " \\| ".join(_type(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join(_type(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{_section_name(annotation)}](#{_anchor(_section_name(annotation))})"
    return getattr(annotation, "__name__", str(annotation))


def _section_name(model: type[BaseModel]) -> str:
    return model.__name__.removesuffix("Config")


def _anchor(title: str) -> str:
    return title.lower().replace(" ", "-")


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section defaults)"
    if value is PydanticUndefined:
        return ""
    return f"`{json.dumps(value, default=str)}`"


def _table(model: type[BaseModel], fields: dict | None = None) -> list[str]:
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, field in (fields or model.model_fields).items():
        text = field.description or next((m.__doc__ for m in _models_in(field.annotation) if m.__doc__), "")
        description = " ".join(text.split()).replace("|", "\\|")
        rows.append(f"| `{field.alias or name}` | {_type(field.annotation)} | {_default(field)} | {description} |")
    return rows


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def render() -> str:
    out = [HEADER, "## Sections", "", *_table(Recipe), ""]
    seen: set[type[BaseModel]] = {Recipe}
    queue: list[type[BaseModel]] = [m for f in Recipe.model_fields.values() for m in _models_in(f.annotation)]
    while queue:
        model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        if issubclass(model, TrainStageConfig):
            continue  # the training stages get a section of their own below
        out += [f"## {_section_name(model)}", "", " ".join((model.__doc__ or "").split()), "", *_table(model), ""]
        queue += [m for f in model.model_fields.values() for m in _models_in(f.annotation)]
    common = TrainStageConfig.model_fields
    shared = {k: f for k, f in common.items() if k not in ("objective", "lr")}
    out += ["## Training stages", "", " ".join(TrainStageConfig.__doc__.split()), "",
            f"`train` is a list of stages; `objective` is one of {', '.join(f'`{o}`' for o in STAGE_TYPES)}. "
            "Fields every stage has:", "", *_table(TrainStageConfig, shared), ""]
    queue += [m for f in shared.values() for m in _models_in(f.annotation) if m not in seen]
    for objective, model in STAGE_TYPES.items():
        own = {k: f for k, f in model.model_fields.items() if k not in common or k == "lr"}
        out += [f"### `objective: {objective}`", "", " ".join((model.__doc__ or "").split()), "",
                *_table(model, own), ""]
        nested = [m for f in own.values() for m in _models_in(f.annotation) if m not in seen]
        queue += nested
    while queue:
        model = queue.pop(0)
        if model in seen:
            continue
        seen.add(model)
        out += [f"## {_section_name(model)}", "", " ".join((model.__doc__ or "").split()), "", *_table(model), ""]
        queue += [m for f in model.model_fields.values() for m in _models_in(f.annotation)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
