"""The schema of `transforms.toml`: one `[[transform]]` per destination, each with its `rules`.

A rule is a table with exactly one operation key (``set``, ``copy``, ``pad``...); each operation
is a strict model here, so a wrong type, a range (``pad`` length 0), an enum (``side = "middle"``)
or an unknown key is a problem keyed ``transform[0].rules[3].with``. What is not a type — HL7
paths, segment ids, Java regexes, Spark date patterns, the condition grammar of ``when`` — is
checked by the parsers that own it (`include.hl7path`, `include.conditions`), called from the
models' validators so their errors carry keys too. `include.transforms_config` builds the rule
dataclasses the Spark jobs use from these models; the grammar itself is documented there and in
docs/rules.md.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from include.conditions import ConditionError, check_java_regex, parse_condition
from include.fhir_options import check_code, check_offset, check_uri
from include.hl7path import FieldPath, FieldPathError, parse_path
from include.schema import Strict, Text

__all__ = [
    "RULE_MODELS",
    "FhirModel",
    "RuleModel",
    "TransformHead",
    "TransformModel",
    "TransformsFile",
    "condition",
    "op_of",
    "rule_path",
]

ENVELOPE_SEGMENTS = ("FHS", "BHS", "BTS", "FTS")
_SEGMENT_ID = re.compile(r"[A-Z][A-Z0-9]{2}")
_EXPLICIT_OCCURRENCE = re.compile(r"[A-Z0-9]{3}\[")
# Spark datetime pattern letters (docs: sql-ref-datetime-pattern); anything else fails mid-job.
_PATTERN_LETTERS = set("GyMdDQqLEuaHhKkmsSVzOXxZ")
# Each `[transform.fhir]` map becomes a map literal in the Spark plan: bounded like lookup tables.
MAX_FHIR_MAP_ENTRIES = 10_000


def condition(value: Any, *, fhir: bool = False) -> Any:
    """A `when` through the condition grammar; its error says where in the tree (``at any[0]: ...``).
    ``fhir``: FHIR leaves allowed (a route's `when`)."""
    try:
        return parse_condition(value, where="when", fhir=fhir)
    except ConditionError as exc:
        text = str(exc)
        if text.startswith("when: "):
            raise ValueError(text.removeprefix("when: ")) from None
        raise ValueError("at " + text.removeprefix("when.")) from None
    except RecursionError:
        raise ValueError("condition nested too deeply") from None


def rule_path(value: str, *, write: bool, each: bool) -> FieldPath:
    """A rule's path, refusing what rules cannot do (envelope, MSH-1/2 writes, each + [n])."""
    try:
        path = parse_path(value)
    except FieldPathError as exc:
        raise ValueError(str(exc)) from None
    if path.segment in ENVELOPE_SEGMENTS:
        raise ValueError(
            f"{value!r}: batch envelope segments ({', '.join(ENVELOPE_SEGMENTS)}) are preserved as "
            "they are; rules apply to the messages inside"
        )
    if write and path.segment == "MSH" and path.field in (1, 2):
        raise ValueError(f"{value!r}: MSH-1 and MSH-2 are the message's separators and cannot be written")
    if each and _EXPLICIT_OCCURRENCE.match(value):
        raise ValueError(f"{value!r}: 'each' applies to every occurrence; drop the [occurrence] index")
    return path


def _each(info: ValidationInfo) -> bool:
    return bool(info.data.get("each", False))


def _read(value: str, info: ValidationInfo) -> str:
    rule_path(value, write=False, each=_each(info))
    return value


def _write(value: str, info: ValidationInfo) -> str:
    rule_path(value, write=True, each=_each(info))
    return value


def _segment(value: str) -> str:
    """A segment id a rule may drop, rename or rename to (not MSH, not the batch envelope)."""
    if not _SEGMENT_ID.fullmatch(value):
        raise ValueError(f"must be a 3-character segment id (a letter, then letters or digits), got {value!r}")
    if value == "MSH" or value in ENVELOPE_SEGMENTS:
        raise ValueError(f"{value} is a message header or batch envelope segment and cannot be dropped or renamed")
    return value


def _anchor(value: str) -> str:
    if not _SEGMENT_ID.fullmatch(value) or value in ENVELOPE_SEGMENTS:
        raise ValueError(f"must be a segment id inside the message (not the batch envelope), got {value!r}")
    return value


def _date_pattern(value: str) -> str:
    """ "hl7" or a Spark datetime pattern whose letters Spark knows (a bad one would fail mid-job)."""
    if value == "hl7":
        return value
    if not value:
        raise ValueError("must be 'hl7' or a Spark datetime pattern")
    unquoted = re.sub(r"'[^']*'", "", value)
    if unquoted.count("'"):
        raise ValueError(f"unbalanced quote in pattern {value!r}")
    bad = sorted({c for c in unquoted if c.isascii() and c.isalpha() and c not in _PATTERN_LETTERS})
    if bad:
        raise ValueError(
            f"pattern {value!r} uses letters Spark does not know: {', '.join(bad)} (quote literal text with '...')"
        )
    return value


def _java_regex(value: str) -> str:
    check_java_regex(value, ValueError)
    return value


Segment = Annotated[str, AfterValidator(_segment)]
Anchor = Annotated[str, AfterValidator(_anchor)]
DatePattern = Annotated[str, AfterValidator(_date_pattern)]
Read = Annotated[str, AfterValidator(_read)]
Write = Annotated[str, AfterValidator(_write)]


class _Rule(Strict):
    """Every rule may have a `when` (the condition grammar of include/conditions.py)."""

    when: Annotated[dict[str, Any], AfterValidator(condition)] | None = None


class _Each(_Rule):
    each: bool = False  # declared first: the path checks depend on it


def _same_segment(to: str | None, source: str, info: ValidationInfo) -> None:
    if to is None or not _each(info):
        return
    if parse_path(to).segment != parse_path(source).segment:
        raise ValueError(
            f"'each' works within one segment occurrence, so the path and 'to' must name the same "
            f"segment (got {parse_path(source).segment} and {parse_path(to).segment})"
        )


class SetRule(_Each):
    path: Write = Field(alias="set")
    generate: Literal["timestamp", "control_id"] | None = None
    value: str | None = None
    format: DatePattern | None = None
    prefix: str | None = None

    @field_validator("generate")
    @classmethod
    def _one_per_message(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and _each(info):
            raise ValueError("'generate' writes one value per message: no 'each'")
        return value

    @field_validator("value")
    @classmethod
    def _not_both(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("generate") is not None:
            raise ValueError("give 'value' or 'generate', not both")
        return value

    @field_validator("format")
    @classmethod
    def _format(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("generate") != "timestamp":
            raise ValueError("goes with generate = 'timestamp'")
        return value

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("generate") != "control_id":
            raise ValueError("goes with generate = 'control_id'")
        if value is not None and not re.fullmatch(r"[A-Za-z0-9]{0,12}", value):
            raise ValueError(f"must be 0-12 letters or digits, got {value!r}")
        return value

    @model_validator(mode="after")
    def _needs_value(self) -> SetRule:
        if self.value is None and self.generate is None:
            raise ValueError("needs 'value' (or 'generate')")
        return self


class CopyRule(_Each):
    source: Read = Field(alias="copy")
    to: Write

    @field_validator("to")
    @classmethod
    def _within(cls, value: str, info: ValidationInfo) -> str:
        if "source" in info.data:
            _same_segment(value, info.data["source"], info)
        return value


class ClearRule(_Each):
    path: Write = Field(alias="clear")


class MapRule(_Each):
    path: Write = Field(alias="map")
    table: Text
    not_found: Literal["keep", "default", "clear", "dead_letter"] | None = None
    default: str | None = None

    @model_validator(mode="after")
    def _default(self) -> MapRule:
        if self.not_found is not None and (self.not_found == "default") != (self.default is not None):
            raise ValueError("'default' goes with not_found = 'default' (and it needs one)")
        return self


class DropSegmentRule(_Rule):
    segment: Segment = Field(alias="drop_segment")


class RenameSegmentRule(_Rule):
    segment: Segment = Field(alias="rename_segment")
    to: Segment


class AddSegmentRule(_Rule):
    text: str = Field(alias="add_segment")
    after: Anchor | None = None
    before: Anchor | None = None

    @field_validator("text")
    @classmethod
    def _one_segment(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Z][A-Z0-9]{2}(\|[^\r\n]*)?", value):
            raise ValueError(
                "must be one segment's text: its id, then '|' and its fields (no line breaks), e.g. "
                f"'ZST|1|A^B'; got {value!r}"
            )
        _segment(value[:3])
        return value

    @field_validator("before")
    @classmethod
    def _not_both(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("after") is not None:
            raise ValueError("give 'after' or 'before', not both")
        return value


class TextPart(Strict):
    """A constant in a `concat`: ``{text = "..."}`` (literal text)."""

    text: str


def _part(value: Any) -> TextPart | str:
    """A field path (raw text) or ``{text = "..."}`` (a constant)."""
    if isinstance(value, dict):
        if set(value) != {"text"} or not isinstance(value["text"], str):
            raise ValueError('a constant is {text = "..."} (one key, a string)')
        return TextPart(text=value["text"])
    if not isinstance(value, str):
        raise ValueError('must be a field path or {text = "..."}')
    rule_path(value, write=False, each=False)
    return value


_PART_SCHEMA = {
    "anyOf": [
        {"type": "string", "description": "an HL7 field path (raw text)"},
        {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    ]
}


class ConcatRule(_Rule):
    parts: list[Annotated[Any, PlainValidator(_part), WithJsonSchema(_PART_SCHEMA)]] = Field(
        alias="concat", min_length=1
    )
    to: Write


class _Function(_Each):
    to: Write | None = None

    @model_validator(mode="after")
    def _target(self) -> _Function:
        source = getattr(self, "source")  # noqa: B009 (each subclass declares it, under its own alias)
        if self.each and self.to is not None and parse_path(self.to).segment != parse_path(source).segment:
            raise ValueError(
                f"'each' works within one segment occurrence, so the path and 'to' must name the "
                f"same segment (got {parse_path(source).segment} and {parse_path(self.to).segment})"
            )
        return self


class UpperRule(_Function):
    source: Read = Field(alias="upper")


class LowerRule(_Function):
    source: Read = Field(alias="lower")


class SubstringRule(_Function):
    source: Read = Field(alias="substring")
    start: int = Field(ge=1)
    length: int | None = Field(default=None, ge=0)


class PadRule(_Function):
    source: Read = Field(alias="pad")
    length: int = Field(ge=1)
    char: str = Field(default=" ", alias="with", min_length=1, max_length=1)
    side: Literal["left", "right"] = "left"


class ReplaceRule(_Function):
    source: Read = Field(alias="replace")
    pattern: Annotated[Text, AfterValidator(_java_regex)]
    replacement: str = Field(default="", alias="with")


class FormatDateRule(_Function):
    source: Read = Field(alias="format_date")
    from_format: DatePattern = Field(default="hl7", alias="from")
    to_format: DatePattern = "hl7"
    on_error: Literal["keep", "clear", "dead_letter"] = "keep"


class DeadLetterRule(_Rule):
    reason: Text = Field(alias="dead_letter")


RULE_MODELS: dict[str, type[_Rule]] = {
    "set": SetRule,
    "copy": CopyRule,
    "clear": ClearRule,
    "map": MapRule,
    "drop_segment": DropSegmentRule,
    "rename_segment": RenameSegmentRule,
    "add_segment": AddSegmentRule,
    "concat": ConcatRule,
    "dead_letter": DeadLetterRule,
    "upper": UpperRule,
    "lower": LowerRule,
    "substring": SubstringRule,
    "pad": PadRule,
    "replace": ReplaceRule,
    "format_date": FormatDateRule,
}


def op_of(rule: Any) -> str | None:
    """The one operation key of a rule table (None when there is none or more than one)."""
    if not isinstance(rule, dict):
        return None
    ops = [key for key in rule if key in RULE_MODELS]
    return ops[0] if len(ops) == 1 else None


if TYPE_CHECKING:  # a union built from RULE_MODELS at import: a type checker cannot read it
    RuleModel = Any
else:
    RuleModel = Annotated[
        Union[tuple(Annotated[model, Tag(op)] for op, model in RULE_MODELS.items())],  # noqa: UP007 (built at run time)
        Discriminator(op_of),
    ]


_Uri = Annotated[str, AfterValidator(check_uri)]
_Code = Annotated[str, AfterValidator(check_code)]
_Codes = Annotated[dict[Text, _Uri], Field(max_length=MAX_FHIR_MAP_ENTRIES)]


class FhirModel(Strict):
    """`[transform.fhir]`: URIs for v2 names and vocabulary overrides (`include.fhir_options`)."""

    identifier_systems: _Codes = {}
    code_systems: _Codes = {}
    gender: Annotated[
        dict[Text, Literal["male", "female", "other", "unknown"]], Field(max_length=MAX_FHIR_MAP_ENTRIES)
    ] = {}
    # PV1-2 is read as a code (trimmed, inner spaces single), so a key or value with more never fits.
    patient_class: Annotated[dict[_Code, _Code], Field(max_length=MAX_FHIR_MAP_ENTRIES)] = {}
    timezone: Annotated[str, AfterValidator(check_offset)] = "Z"


class TransformHead(Strict):
    """A `[[transform]]` table with its rules not yet looked at (each is validated alone)."""

    destination: Text
    output: Literal["hl7", "json", "fhir-r4"] = "hl7"
    rules: list[Any] = []
    fhir: FhirModel | None = None

    @model_validator(mode="after")
    def _fhir_goes_with_its_output(self) -> TransformHead:
        if self.fhir is not None and self.output != "fhir-r4":
            raise ValueError("'fhir' settings go with output = 'fhir-r4'")
        return self


class TransformModel(TransformHead):
    """A `[[transform]]` table, for the published JSON Schema."""

    rules: list[RuleModel] = []


class TransformsFile(Strict):
    """`transforms.toml`: an array of `[[transform]]` tables, one per destination."""

    transform: list[TransformModel] = []
