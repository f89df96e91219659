"""Load a YAML recipe into `Recipe`, with errors that name the file, line, YAML path and allowed values."""

from __future__ import annotations

import hashlib
import json
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from amalia_ray.core.config import PretrainStage, Recipe, TrainStageConfig
from amalia_ray.core.errors import RecipeError
from amalia_ray.core.rewards import get_reward
from amalia_ray.core.formats.shards import load_hook

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


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, a list's items, an Optional's or a union's members."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) or () for m in _models_in(arg)]


def _tagged(models: list[type[BaseModel]], tag) -> type[BaseModel] | None:
    """The member of a discriminated union whose literal field (e.g. `objective`) takes the value `tag`."""
    for model in models:
        for field in model.model_fields.values():
            if typing.get_origin(field.annotation) is typing.Literal and tag in typing.get_args(field.annotation):
                return model
    return None


def _resolve(loc: tuple) -> tuple[tuple, type[BaseModel] | None]:
    """A pydantic error location as a YAML path (without the union tags pydantic inserts, e.g. train[1].sft.lr ->
    train[1].lr), and the model that owns the field at its end."""
    path: list = []
    models: list[type[BaseModel]] = [Recipe]
    owner = None
    for key in loc:
        if isinstance(key, int):
            path.append(key)
            continue
        if len(models) > 1 and (member := _tagged(models, key)):
            models = [member]
            continue
        owner = models[0] if len(models) == 1 else None
        path.append(key)
        models = _models_in(owner.model_fields[key].annotation) if owner and key in owner.model_fields else []
    return tuple(path), owner


def format_validation_error(err: ValidationError, source: str, lines: dict[tuple, int]) -> str:
    messages = []
    for e in err.errors():
        loc, owner = _resolve(tuple(e["loc"]))
        dotted = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[") or "<root>"
        line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
        where = f"{source}:{line}" if line else source
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(f.alias or name for name, f in owner.model_fields.items()) if owner else "?"
            kind = f" of a {owner.model_fields['objective'].annotation.__args__[0]} stage" if (
                owner and "objective" in owner.model_fields) else ""
            msg = f"unknown field '{loc[-1]}'{kind} (allowed: {allowed})"
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
    check_named_code(recipe, source, _line_index(text))
    return recipe


def untrusted(spec: str, trusted: list[str]) -> str | None:
    """Why the code `spec` ('package.module:function') may not run, or None: a recipe runs the code it names, so only
    modules of this package and those `run.trusted_modules` lists (a package covers its modules) are imported."""
    module = spec.partition(":")[0]
    if any(module == t or module.startswith(t + ".") for t in ["amalia_ray", *trusted]):
        return None
    return (f"'{spec}' names code in module '{module}', which run.trusted_modules does not list: a recipe runs the "
            "code it names, so list the module (or its package) there to allow it")


def named_code(stage) -> list[str]:
    """The code a training stage names from outside this package ('package.module:function'): its rule rewards
    and its curriculum hook."""
    names = [r.name for r in stage.sampled_rewards if r.name and ":" in r.name]
    if isinstance(stage, PretrainStage) and stage.curriculum and stage.curriculum.hook:
        names.append(stage.curriculum.hook)
    return [n for n in names if not n.startswith("amalia_ray.")]


def check_named_code(recipe: Recipe, source: str, lines: dict[tuple, int]) -> None:
    """Rewards and curriculum hooks named by the recipe come from trusted modules, exist and import here, before
    any stage starts (not in a Ray worker an hour later)."""
    problems = []
    trusted = recipe.run.trusted_modules
    for i, stage in enumerate(recipe.train):
        for j, reward in enumerate(stage.sampled_rewards):
            if (name := reward.name) is None:  # an LLM judge: reached over HTTP when the stage samples
                continue
            where = ("train", i, "rewards", j) + (() if isinstance(stage.rewards[j], str) else ("name",))
            if ":" in name and (why := untrusted(name, trusted)):
                problems.append((where, why))
                continue
            try:
                if not callable(get_reward(name)):
                    raise ValueError(f"reward '{name}' is not a function")
            except ValueError as e:
                problems.append((where, str(e)))
        hook = stage.curriculum.hook if isinstance(stage, PretrainStage) and stage.curriculum else None
        if hook and (why := untrusted(hook, trusted)):
            problems.append((("train", i, "curriculum", "hook"), why))
        elif hook:
            try:
                if not callable(load_hook(hook)):
                    raise ValueError(f"curriculum hook '{hook}' is not a function")
            except (ImportError, AttributeError, ValueError) as e:
                problems.append((("train", i, "curriculum", "hook"), f"curriculum hook '{hook}' cannot be "
                                 f"imported: {e}" if not isinstance(e, ValueError) else str(e)))
    if problems:
        messages = []
        for path, message in problems:
            line = next((lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in lines), None)
            dotted = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[")
            messages.append(f"{source}:{line}: {dotted}: {message}" if line else f"{source}: {dotted}: {message}")
        raise RecipeError("invalid recipe: " + "; ".join(messages))


def load_recipe(path: str | Path) -> LoadedRecipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    return LoadedRecipe(parse_recipe(path.read_text(encoding="utf-8"), str(path)), path.resolve())


def config_hash(*parts: BaseModel | dict | list | str | None) -> str:
    """Stable hash of config sections, used to decide whether a stage must run again (of a training stage, the
    fields that decide what it trains: TrainStageConfig.fingerprinted)."""
    payload = [p.fingerprinted() if isinstance(p, TrainStageConfig) else p.model_dump(mode="json")
               if isinstance(p, BaseModel) else p for p in parts]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
