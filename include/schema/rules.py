"""Cross-setting rules with their own keys, and the one validation entry point loaders call.

A pydantic model validator can raise one error, keyed by the model as a whole. A rule such as
"error_directory must differ from directory" belongs to a key, and one table may break several
rules at once, so a model validator raises `Rules` (every broken rule, each with the key it is
about, relative to the table) and `validate` turns each into its own `ConfigProblem`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError, model_validator

from include.schema import ConfigProblem, ConfigProblems, _dotted

__all__ = ["Rules", "problems", "refuses", "validate"]

M = TypeVar("M", bound=BaseModel)


class Rules(ValueError):
    """Every rule a table breaks: (key relative to the table, or "" for the table itself, message)."""

    def __init__(self, items: list[tuple[str, str]]) -> None:
        self.items = list(items)
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in self.items))

    @staticmethod
    def raise_if(items: list[tuple[str, str]]) -> None:
        if items:
            raise Rules(items)


def refuses(key: str, message: str) -> Any:
    """A `mode="before"` model validator refusing a table that sets `key` (a secret that must not be
    written into the file), with `message` saying where it belongs instead; assign it in the model's
    body (`_no_password = refuses("password", "...")`)."""

    def refuse(cls: Any, data: Any) -> Any:
        if isinstance(data, dict) and key in data:
            raise Rules([(key, message)])
        return data

    return model_validator(mode="before")(refuse)


def _join(base: str, sub: str) -> str:
    if not sub:
        return base
    if not base or sub.startswith("["):
        return base + sub
    return f"{base}.{sub}"


_TOML_TYPES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    list: "an array",
    dict: "a table",
    type(None): "nothing",
}
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "a table",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "datetime_type": "a date-time",
}


_PATTERNS = {
    r"^[A-Za-z0-9_-]+$": "a non-empty name of letters, digits, - and _",
    r"^[A-Za-z_][A-Za-z0-9_]*$": "an identifier (letters, digits and _, not starting with a digit)",
    r"^[0-9a-fA-F]{64}$": "64 hex digits",
}


def _message(err: Mapping[str, Any], value: Any) -> str:
    """pydantic's message in the words of a TOML file: what the key must be, and what it got."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _EXPECTED:
        got = _TOML_TYPES.get(type(value), type(value).__name__)
        return f"must be {_EXPECTED[kind]}, got {got}"
    bounds = {
        "greater_than": "> {gt}",
        "greater_than_equal": ">= {ge}",
        "less_than": "< {lt}",
        "less_than_equal": "<= {le}",
    }
    if kind in bounds:
        plain = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in ctx.items()}
        return "must be " + bounds[kind].format(**plain)
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '').replace(' or ', ', ')}"
    if kind == "extra_forbidden":
        return "unknown setting"
    if kind == "missing":
        return "required, not set"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern"))
        return "must be " + _PATTERNS.get(pattern.replace("^(", "^").replace(")?$", "$"), f"a match of {pattern}")
    if kind == "finite_number":
        return "must be a finite number"
    return err["msg"].removeprefix("Value error, ")


def problems(exc: ValidationError, *, file: Path | None = None, prefix: str = "") -> list[ConfigProblem]:
    """pydantic's errors as `ConfigProblem` rows, a `Rules` error expanded into one row per rule; the
    input value is never echoed (it may be a secret)."""
    out: list[ConfigProblem] = []
    for err in exc.errors(include_url=False):
        key = _dotted(tuple(err["loc"]), prefix)
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, Rules):
            out += [ConfigProblem(file, _join(key, sub), message) for sub, message in cause.items]
            continue
        out.append(ConfigProblem(file, key, _message(err, err.get("input"))))
    return out


def validate(
    model: type[M], data: Any, *, file: Path | None = None, prefix: str = "", context: dict[str, Any] | None = None
) -> M:
    """`data` validated as `model`; `ConfigProblems` (every problem, with file and key) if it is not."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigProblems(problems(exc, file=file, prefix=prefix)) from None
