"""Validating an array of tables (`[[route]]`, `[[destination]]`, `[[transform]]`) item by item.

Each table is validated alone, with the model its own keys choose (a destination's `kind`, a
rule's operation), so a problem's key is the one the user wrote (`destination[2].port`, not
pydantic's `destination.2.mllp.port`) and one bad table does not hide the next one's problems.
The loaders' errors subclass `ConfigProblemsError`: they are `ConfigProblems` (every problem, with
its key) that can still be raised from one sentence where a caller has only that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from include.schema import ConfigProblem, ConfigProblems, problems_from

__all__ = ["ConfigProblemsError", "choose", "problem", "type_name", "validate_item", "validate_list"]

M = TypeVar("M", bound=BaseModel)


class ConfigProblemsError(ConfigProblems):
    """`ConfigProblems` that may also be built from one sentence (no key, no file)."""

    def __init__(self, problems: list[ConfigProblem] | str) -> None:
        if isinstance(problems, str):
            problems = [ConfigProblem(None, "", problems)]
        super().__init__(problems)


def problem(key: str, message: str) -> ConfigProblem:
    return ConfigProblem(None, key, message)


def type_name(value: Any) -> str:
    """The TOML word for a value's type, for messages (`a string`, `an array`...)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


def validate_list(value: Any, key: str) -> tuple[list[Any] | None, list[ConfigProblem]]:
    """`value` as a list of items, or a problem saying it must be an array of tables."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        return None, [problem(key, f"must be an array of tables ([[{key}]]), got {type_name(value)}")]
    return list(value), []


def validate_item(
    model: type[M], data: Any, key: str, context: dict[str, Any] | None = None
) -> tuple[M | None, list[ConfigProblem]]:
    """`data` validated as `model`; its problems keyed under `key` instead of raised."""
    try:
        return model.model_validate(data, context=context), []
    except ValidationError as exc:
        return None, problems_from(exc, prefix=key)


def choose(
    value: Any,
    key: str,
    tag: str,
    models: Mapping[str, type[BaseModel]],
    pick: Callable[[Mapping[str, Any]], Any] | None = None,
) -> tuple[type[BaseModel] | None, list[ConfigProblem]]:
    """The model for one table, chosen by its `tag` key (or by `pick`); a problem if none fits."""
    if not isinstance(value, Mapping):
        return None, [problem(key, f"must be a table, got {type_name(value)}")]
    chosen = pick(value) if pick else value.get(tag)
    if not isinstance(chosen, str) or chosen not in models:
        where = f"{key}.{tag}" if not pick else key
        got = "nothing" if chosen is None else repr(chosen) if isinstance(chosen, str) else type_name(chosen)
        return None, [problem(where, f"must be one of {', '.join(models)}, got {got}")]
    return models[chosen], []
