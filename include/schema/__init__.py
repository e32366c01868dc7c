"""One strict mechanism for every config file: typed pydantic models, every problem at once.

Each config file has its models in a module here. A model is `Strict`: unknown keys, wrong types
(``"no"`` where a boolean belongs, ``"2575"`` where a port does) and out-of-range values are
errors, never coerced. `include.schema.rules.validate` turns pydantic's errors into `ConfigProblem`
rows naming the file and the dotted key, so a loader can report all of them at once and a caller
never sees a traceback. The JSON Schema of every file (`stageline config schema`) comes from the same models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

__all__ = ["ConfigProblem", "ConfigProblems", "Strict", "Text", "problems_from"]


class ConfigProblem(NamedTuple):
    """One thing wrong: the file, the dotted key (``inbound[2].tls.cert``) and what is wrong."""

    file: Path | None
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        return f"{where}{self.key}: {self.message}" if self.key else f"{where}{self.message}"


class ConfigProblems(ValueError):
    """A config file (or dir) breaks the schema; `problems` lists every problem found."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class Strict(BaseModel):
    """A config table: no unknown keys, no type coercion, immutable once read."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _dotted(loc: tuple[int | str, ...], prefix: str) -> str:
    key = prefix
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif part.startswith(("function-", "tagged-union[", "union[")) or part in ("list", "dict"):
            continue  # pydantic's internal validator steps, not keys the user wrote
        else:
            key += f".{part}" if key else str(part)
    return key


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty string")
    return value


Text = Annotated[str, AfterValidator(_not_blank)]
"""A string with something in it (not empty, not only white space)."""


def problems_from(exc: ValidationError, *, file: Path | None = None, prefix: str = "") -> list[ConfigProblem]:
    """pydantic's errors as `ConfigProblem` rows; the input value is never echoed (it may be a secret)."""
    out = []
    for err in exc.errors(include_url=False, include_input=False):
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown setting"
        out.append(ConfigProblem(file, _dotted(tuple(err["loc"]), prefix), message))
    return out
