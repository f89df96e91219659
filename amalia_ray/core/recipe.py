"""Load a YAML recipe into `Recipe`, with errors that name the file, line, YAML path and allowed values."""

from __future__ import annotations

import hashlib
import json
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from amalia_ray.core.config import Recipe
from amalia_ray.core.errors import RecipeError

@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    path: Path

    @property
    def base_dir(self) -> Path:
        """Relative paths inside a recipe are taken from the recipe file's folder."""
        return self.path.parent

    def resolve(self, p: str) -> Path:
        path = Path(p).expanduser()
        return path if path.is_absolute() else (self.base_dir / path).resolve()


def _line_index(text: str) -> dict[tuple, int]:
    """Map each YAML path (tuple of keys / list indices) to the 1-based line where it starts."""
    index: dict[tuple, int] = {}

    def walk(node, path: tuple) -> None:
        index[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                index[path + (key.value,)] = key.start_mark.line + 1
                walk(value, path + (key.value,))
                index[path + (key.value,)] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return index
    if root is not None:
        walk(root, ())
    return index


def _model_at(path: tuple) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `path` (for listing allowed fields)."""
    model: typing.Any = Recipe
    for key in path:
        if isinstance(key, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or key not in model.model_fields:
            return None
        model = _unwrap(model.model_fields[key].annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation):
    for arg in typing.get_args(annotation) or ():
        inner = _unwrap(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def format_validation_error(err: ValidationError, source: str, lines: dict[tuple, int]) -> str:
    messages = []
    for e in err.errors():
        loc = tuple(e["loc"])
        dotted = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[") or "<root>"
        line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
        where = f"{source}:{line}" if line else source
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc[:-1])
            allowed = ", ".join(f.alias or name for name, f in owner.model_fields.items()) if owner else "?"
            msg = f"unknown field '{loc[-1]}' (allowed: {allowed})"
        elif e["type"] == "missing":
            msg = "required field is missing"
        messages.append(f"{where}: {dotted}: {msg}")
    return "invalid recipe: " + "; ".join(messages)


def parse_recipe(text: str, source: str = "<recipe>") -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise RecipeError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping with sections data, train, ...")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(format_validation_error(e, source, _line_index(text))) from None
    return recipe


def load_recipe(path: str | Path) -> LoadedRecipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    return LoadedRecipe(parse_recipe(path.read_text(encoding="utf-8"), str(path)), path.resolve())


def config_hash(*parts: BaseModel | dict | list | str | None) -> str:
    """Stable hash of config sections, used to decide whether a stage must run again."""
    payload = [p.model_dump(mode="json") if isinstance(p, BaseModel) else p for p in parts]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
