"""The schema of `routes.toml`: one `[[route]]` table per route, in the order they are tried.

Strict types and unknown keys here; the `when` condition goes through the condition grammar
(`include.conditions`, a parser, not a schema) from a validator, so its errors are keyed
``route[1].when`` like every other problem. `include.routes_config.Route` is built from it.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator

from include.schema import Strict, Text
from include.schema.transforms import condition

__all__ = ["RouteModel", "RoutesFile"]


class RouteModel(Strict):
    """A `[[route]]`: messages matching `when` (or all; or, `catch_all`, those no route matched)
    go to `destinations`."""

    name: Text
    destinations: list[Text] = Field(min_length=1)
    when: Annotated[dict[str, Any], AfterValidator(partial(condition, fhir=True))] | None = None
    catch_all: bool = False

    @model_validator(mode="after")
    def _catch_all(self) -> RouteModel:
        if self.catch_all and self.when is not None:
            raise ValueError("a catch_all route takes no 'when' (it matches what no other route matched)")
        return self


class RoutesFile(Strict):
    """`routes.toml`: an array of `[[route]]` tables, names unique."""

    route: list[RouteModel] = []
