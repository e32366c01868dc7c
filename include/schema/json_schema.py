"""The JSON Schema of every config file, from the same models that check it (`stageline config schema`).

An editor validates a TOML file as it is typed when it knows the file's schema: with taplo (the
"Even Better TOML" VS Code extension, Helix, Zed...) put ``#:schema ./schema/connections.json`` as the
file's first line, or map file names to schemas in ``.taplo.toml``; docs/config-reference.md shows
both. The published copies are `docs/schema/<file>.json`, kept equal to these by a test. A schema
says types, ranges, enums and unknown keys; rules that span keys or read files (a TLS cert that must
exist, a bind that needs TLS) are checked by `stageline config check` only.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

__all__ = ["FILES", "schema", "schema_text"]

#: file stem -> (module, model) of the whole file
FILES: dict[str, tuple[str, str]] = {
    "connections": ("include.schema.connections", "ConnectionsFile"),
    "stageline": ("include.schema.service", "ServiceFile"),
    "routes": ("include.schema.routes", "RoutesFile"),
    "destinations": ("include.schema.destinations", "DestinationsFile"),
    "transforms": ("include.schema.transforms", "TransformsFile"),
}


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `<name>.toml`."""
    module, model = FILES[name]
    doc = getattr(importlib.import_module(module), model).model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"stageline/{name}.json",
        "title": f"Stageline {name}.toml",
        **{k: v for k, v in doc.items() if k != "title"},
    }


def schema_text(name: str) -> str:
    return json.dumps(schema(name), indent=2, sort_keys=True) + "\n"
