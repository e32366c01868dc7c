"""Every key of connections.toml, [api] and stageline.toml fuzzed with values of any TOML type
(issue 23): the loaders answer with problems naming the file and that key, or load — never another
exception. A value whose type the key's JSON Schema does not allow is always a problem at that key
(`"no"` for a boolean, `"2575"` for a port: never coerced, never truthy)."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from include import config as cfgmod
from include.schema import ConfigProblems
from include.schema.json_schema import schema
from listeners.connections_config import load_config_dir

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

CONNECTIONS = {
    "inbound": [
        {
            "name": "adt-in",
            "kind": "mllp",
            "host": "127.0.0.1",
            "port": 2575,
            "tls": {"cert": "pki/server.pem", "key": "pki/server.key", "ca": "pki/ca.pem"},
        },
        {
            "name": "lab-db",
            "kind": "database",
            "database": {
                "backend": "postgres",
                "database": "lis",
                "query": "SELECT id FROM t WHERE id > :watermark LIMIT :limit",
            },
        },
    ],
    "api": {"host": "127.0.0.1", "port": 8470, "tokens": [{"role": "viewer", "token_env": "TOKEN"}]},
}
SERVICE = {"store": {"backend": "sqlite"}, "cluster": {}, "retention": {"connections": {"adt-in": {}}}}


def properties(doc: dict[str, Any], model: str) -> dict[str, Any]:
    return doc["$defs"][model]["properties"]


CONN_DOC, SERVICE_DOC = schema("connections"), schema("stageline")
TARGETS = (  # (which file, path to the table, its properties)
    [("connections", ("inbound", 0), k, v) for k, v in properties(CONN_DOC, "InboundModel").items()]
    + [("connections", ("inbound", 0, "tls"), k, v) for k, v in properties(CONN_DOC, "TLSModel").items()]
    + [
        ("connections", ("inbound", 1, "database"), k, v)
        for k, v in properties(CONN_DOC, "DatabaseSourceModel").items()
    ]
    + [("connections", ("api",), k, v) for k, v in properties(CONN_DOC, "ApiModel").items()]
    + [("connections", ("api", "tokens", 0), k, v) for k, v in properties(CONN_DOC, "ApiTokenModel").items()]
    + [("stageline", ("store",), k, v) for k, v in properties(SERVICE_DOC, "StoreModel").items()]
    + [("stageline", ("cluster",), k, v) for k, v in properties(SERVICE_DOC, "ClusterModel").items()]
    + [("stageline", ("retention",), k, v) for k, v in properties(SERVICE_DOC, "RetentionModel").items()]
    + [
        ("stageline", ("retention", "connections", "adt-in"), k, v)
        for k, v in properties(SERVICE_DOC, "RetentionOverride").items()
    ]
)

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(), text)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(text, scalars, max_size=3))


def json_types(prop: dict[str, Any]) -> set[str]:
    """The JSON types a property allows ('number' takes integers too); empty: any (a reference)."""
    found: set[str] = set()
    for option in prop.get("anyOf", [prop]):
        if "$ref" in option or "allOf" in option:
            found.add("object")
        elif "type" in option:
            found.add(option["type"])
    if "number" in found:
        found.add("integer")
    return found


def json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def toml_string(value: str) -> str:
    """A TOML basic string: controls, quote and backslash escaped, everything else as is."""

    def char(c: str) -> str:
        if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F:
            return f"\\u{ord(c):04x}"
        return c

    return '"' + "".join(char(c) for c in value) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """`data` as TOML: tables and arrays of tables as sections, everything else inline."""
    plain = [
        f"{toml_string(k)} = {toml_value(v)}"
        for k, v in data.items()
        if not isinstance(v, dict) and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))
    ]
    out = ([f"[{prefix}]"] if prefix else []) + plain
    for k, v in data.items():
        key = f"{prefix}.{toml_string(k)}" if prefix else toml_string(k)
        if isinstance(v, dict):
            out.append(to_toml(v, key))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                body = to_toml(item, "")
                out.append(f"[[{key}]]\n{body}".replace("\n[", f"\n[{key}."))
    return "\n".join(out) + "\n"


def same(a: Any, b: Any) -> bool:
    """Equal as data, NaN equal to NaN."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def setting(base: dict[str, Any], path: tuple[Any, ...], key: str, value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(base))
    table = data
    for part in path:
        table = table[part]
    table[key] = value
    return data


def dotted(path: tuple[Any, ...], key: str) -> str:
    out = ""
    for part in (*path, key):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def test_the_base_files_load(tmp_path):
    conf = write_connections(tmp_path, CONNECTIONS)
    assert [c.name for c in load_config_dir(conf).inbound] == ["adt-in", "lab-db"]
    (tmp_path / "stageline.toml").write_text(to_toml(SERVICE))
    assert cfgmod.load(tmp_path / "stageline.toml").store.backend == "sqlite"


def write_connections(tmp_path: Path, data: dict[str, Any]) -> Path:
    conf = tmp_path / "conf"
    (conf / "pki").mkdir(parents=True, exist_ok=True)
    for name in ("server.pem", "server.key", "ca.pem"):
        (conf / "pki" / name).write_text("PEM\n")
    text = to_toml(data)
    assert same(tomllib.loads(text), data), text  # the fuzz writes what it means
    (conf / "connections.toml").write_text(text)
    return conf


def target(path: tuple[Any, ...], key: str) -> tuple[str, tuple[Any, ...], str, dict[str, Any]]:
    return next(t for t in TARGETS if t[1] == path and t[2] == key)


@FUZZ
@given(target=st.sampled_from(TARGETS), value=values)
@example(target=target(("inbound", 0), "allow_insecure_bind"), value="no")  # issue 23: "no" was truthy
@example(target=target(("inbound", 0), "port"), value="2575")  # issue 23: a TypeError traceback
@example(target=target(("store",), "pool_size"), value=True)
def test_any_value_for_any_key_is_a_problem_at_that_key_or_loads(tmp_path, target, value):
    file, path, key, prop = target
    data = setting(CONNECTIONS if file == "connections" else SERVICE, path, key, value)
    try:
        if file == "connections":
            source = write_connections(tmp_path, data) / "connections.toml"
            load_config_dir(source.parent)
        else:
            source = tmp_path / "stageline.toml"
            source.write_text(to_toml(data))
            assert same(tomllib.loads(source.read_text()), data)
            cfgmod.load(source)
    except ConfigProblems as exc:
        assert exc.problems and all(p.file == source for p in exc.problems), exc
        assert "Traceback" not in str(exc)
        problems = exc.problems
    else:
        problems = []
    if json_types(prop) and json_type(value) not in json_types(prop):
        where = dotted(path, key)
        assert any(
            p.key == where or p.key.startswith(where + ".") or p.key.startswith(where + "[") for p in problems
        ), (where, value, [str(p) for p in problems])
