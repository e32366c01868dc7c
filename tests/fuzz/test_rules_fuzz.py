"""The rule grammar fuzzed: field paths (include/hl7path.py) and conditions (include/conditions.py),
as a route's or a transform's `when` loads them from TOML. Any value: a parsed rule or the
documented `FieldPathError` / `ConditionError` (with where it is), never another exception;
a parsed path prints back to itself; reading a value out of any message never raises and
returns a piece of that message, in time linear in its size."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from include.conditions import ConditionError, parse_condition
from include.hl7path import FieldPath, FieldPathError, parse_path, value
from tests.fuzz.budget import FUZZ, WORST_BYTES, WORST_SECONDS, linear, seconds

PATH_ALPHABET = "MSHPIDOBXZ0123456789-[].abc "
paths = st.one_of(
    st.text(alphabet=PATH_ALPHABET, max_size=16),
    st.from_regex(
        r"[A-Z][A-Z0-9]{2}(\[[0-9]{1,3}\])?-[0-9]{1,4}(\[[0-9]{1,3}\])?(\.[0-9]{1,3}(\.[0-9]{1,3})?)?", fullmatch=True
    ),
    st.text(max_size=20),
)


@FUZZ
@given(st.one_of(paths, st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2)))
def test_a_field_path_parses_or_is_refused_with_its_error(raw: Any) -> None:
    try:
        parsed = parse_path(raw)
    except FieldPathError as exc:
        assert str(exc)
        return
    assert isinstance(parsed, FieldPath)
    assert parse_path(str(parsed)) == parsed


scalars = st.one_of(
    st.text(max_size=10),
    st.integers(),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.sampled_from(
        [
            "eq",
            "ne",
            "in",
            "regex",
            "exists",
            "any",
            "all",
            "PID-3.1",
            "MSH-9.1",
            "ZPI",
            "a(?P<x>b)",
            "(",
            "[",
            "^lab-",
            "PID[2]-3",
            "PID-3[2]",
        ]
    ),
)
KEYS = ["field", "op", "value", "segments", "repetitions", "segment", "connection", "all", "any", "not", "x"]


def trees(depth: int = 3) -> st.SearchStrategy[Any]:
    leaf = st.dictionaries(st.sampled_from(KEYS), st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=5)
    valid = st.one_of(  # so that well-formed trees (and their deeper mistakes) are reached too
        st.fixed_dictionaries(
            {
                "field": st.sampled_from(["PID-3.1", "MSH-9.1", "OBX-5", "PID-3[2]"]),
                "op": st.sampled_from(["eq", "ne", "regex"]),
                "value": st.text(max_size=6),
            },
            optional={"segments": st.sampled_from(["any", "all", "some"])},
        ),
        st.fixed_dictionaries({"connection": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=4)))}),
        st.builds(lambda s: {"segment": s}, st.sampled_from(["ZPI", "PID", "zpi", "PI"])),
    )
    return st.recursive(
        st.one_of(leaf, valid, valid, scalars),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(KEYS), inner, max_size=3),
            st.builds(lambda k, v: {k: v}, st.sampled_from(["all", "any"]), st.lists(inner, min_size=1, max_size=3)),
            st.builds(lambda v: {"not": v}, inner),
        ),
        max_leaves=12,
    )


@FUZZ
@given(trees())
def test_a_condition_tree_parses_or_is_refused_saying_where(cond: Any) -> None:
    try:
        parse_condition(cond, where="route 'r' when")
    except ConditionError as exc:
        assert str(exc).startswith("route 'r' when"), str(exc)


segments = st.one_of(
    st.sampled_from(
        [
            "MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5",
            "PID|1||123~456^^^MR||DOE^JANE",
            "OBX|1|TX|||a&b&c",
            "MSH#^~\\&#A",
            "MSH",
            "MSH|",
            "MSH|^",
            "",
        ]
    ),
    st.text(alphabet="MSHPIDOBX|^~\\&#0123456789 ", max_size=30),
)


@FUZZ
@given(
    st.lists(st.tuples(segments, st.sampled_from(["\r", "\n", "\r\n"])), max_size=8).map(
        lambda parts: "".join(s + e for s, e in parts)
    ),
    st.sampled_from(
        ["MSH-1", "MSH-2", "MSH-9.1", "MSH-10", "PID-3", "PID-3[2].1", "PID-5.2", "OBX[2]-5.1.3", "PID[3]-1", "ZZZ-1"]
    ),
)
def test_reading_a_value_out_of_any_message_never_raises(message: str, path: str) -> None:
    got = value(message, path)
    assert got is None or (got and (got in message or path in ("MSH-1",)))


def test_reading_a_value_is_linear_in_the_message() -> None:
    def many_segments(n: int) -> object:  # the segment asked for is the last of thousands
        return value("MSH|^~\\&|A\r" + "OBX|1|TX\r" * (n // 9) + "ZZZ|x", "ZZZ-1")

    def many_repetitions(n: int) -> object:
        return value("MSH|^~\\&|A\rPID|1||" + "~" * n, "PID-3[2].1")

    for go in (many_segments, many_repetitions):
        assert seconds(lambda: go(WORST_BYTES)) < WORST_SECONDS
        linear(go)
