"""MSH parsing straight from bytes: what is accepted, and every documented rejection."""

from __future__ import annotations

import codecs

import pytest

from listeners.hl7msg import (
    HL7_CHARSETS,
    HeaderErrorReason,
    HL7HeaderError,
    charset_to_codec,
    parse_header,
)

ADT = (
    b"MSH|^~\\&|SENDAPP|SENDFAC|RECVAPP|RECVFAC|20240102030405||ADT^A01^ADT_A01|MSG00001|P|2.5.1"
    b"|||AL|NE||UNICODE UTF-8\r"
    b"EVN|A01|20240102030405\r"
    b"PID|1||12345^^^HOSP^MR||DOE^JANE||19800101|F\r"
)


def reason_of(data: bytes, **kwargs: object) -> HeaderErrorReason:
    with pytest.raises(HL7HeaderError) as info:
        parse_header(data, **kwargs)  # type: ignore[arg-type]
    return info.value.reason


def test_reads_every_header_field_raw() -> None:
    h = parse_header(ADT)
    assert h.field_separator == "|"
    assert h.encoding_characters == "^~\\&"
    assert (h.sending_application, h.sending_facility) == ("SENDAPP", "SENDFAC")
    assert (h.receiving_application, h.receiving_facility) == ("RECVAPP", "RECVFAC")
    assert h.message_type == "ADT^A01^ADT_A01"
    assert (h.message_code, h.trigger_event) == ("ADT", "A01")
    assert h.control_id == "MSG00001"
    assert h.processing_id == "P"
    assert h.version == h.version_id == "2.5.1"
    assert h.charset == "UNICODE UTF-8"
    assert h.encoding == "utf-8"
    assert h.truncation_character is None


def test_header_is_frozen() -> None:
    h = parse_header(ADT)
    with pytest.raises(AttributeError):
        h.control_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize("terminator", [b"\r", b"\n", b"\r\n"])
def test_tolerates_lf_and_crlf_segment_terminators(terminator: bytes) -> None:
    data = ADT.replace(b"\r", terminator)
    h = parse_header(data)
    assert h.control_id == "MSG00001"
    assert h.charset == "UNICODE UTF-8"


def test_tolerates_leading_line_noise_and_utf8_bom() -> None:
    assert parse_header(b"\r\n " + ADT).control_id == "MSG00001"
    assert parse_header(codecs.BOM_UTF8 + ADT).control_id == "MSG00001"


def test_header_without_trailing_terminator_is_read() -> None:
    assert parse_header(b"MSH|^~\\&|A|B|C|D|||ORU^R01|X1|T|2.3").processing_id == "T"


def test_custom_separators_are_honoured() -> None:
    data = b"MSH#$%!*#APP#FAC#RA#RF#20240101##ORU$R01#ID-7#P#2.4\rOBX#1\r"
    h = parse_header(data)
    assert h.field_separator == "#"
    assert h.encoding_characters == "$%!*"
    assert (h.component_separator, h.repetition_separator) == ("$", "%")
    assert (h.escape_character, h.subcomponent_separator) == ("!", "*")
    assert h.trigger_event == "R01"
    assert h.control_id == "ID-7"


def test_five_encoding_characters_carry_the_truncation_character() -> None:
    data = b"MSH|^~\\&#|A|B|C|D|20240101||ADT^A04^ADT_A01|C5|P|2.7\r"
    h = parse_header(data)
    assert h.encoding_characters == "^~\\&#"
    assert h.truncation_character == "#"
    assert h.control_id == "C5"


def test_missing_fields_read_as_empty() -> None:
    h = parse_header(b"MSH|^~\\&|||||||ADT|C1\r")
    assert h.sending_application == h.processing_id == h.version == h.charset == ""
    assert h.trigger_event == ""
    assert h.encoding == "utf-8"  # empty MSH-18 -> connection default


def test_empty_charset_uses_the_connection_default() -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5\rPID|1||||M\xfcller\r"
    assert parse_header(data, default_encoding="latin-1").encoding == "iso8859-1"
    assert reason_of(data) is HeaderErrorReason.UNDECODABLE


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", HeaderErrorReason.NO_MSH),
        (b"\r\n", HeaderErrorReason.NO_MSH),
        (b"hello world", HeaderErrorReason.NO_MSH),
        (b"PID|1||123\rOBX|1\r", HeaderErrorReason.NO_MSH),
        (b"msh|^~\\&|A|B|C|D|||ADT|C1\r", HeaderErrorReason.NO_MSH),
        (b"PID|1\rMSH|^~\\&|A|B|C|D|||ADT|C1\r", HeaderErrorReason.MSH_NOT_FIRST),
        (b"FHS|^~\\&\nMSH|^~\\&|A|B|C|D|||ADT|C1\r", HeaderErrorReason.MSH_NOT_FIRST),
        (b"MSH", HeaderErrorReason.BAD_FIELD_SEPARATOR),
        (b"MSHA^~\\&A", HeaderErrorReason.BAD_FIELD_SEPARATOR),
        (b"MSH1^~\\&1", HeaderErrorReason.BAD_FIELD_SEPARATOR),
        (b"MSH ^~\\& ", HeaderErrorReason.BAD_FIELD_SEPARATOR),
        (b"MSH\t^~\\&\t", HeaderErrorReason.BAD_FIELD_SEPARATOR),
        (b"MSH\xa6^~\\&\xa6", HeaderErrorReason.BAD_FIELD_SEPARATOR),
        (b"MSH|^~\\|A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|||A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|^~\\&#@|A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|^~\\&#@!$%|A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|^~\\A|A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|^~ &|A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|^~\\\xe9|A|B|C|D|||ADT|C1\r", HeaderErrorReason.BAD_ENCODING_CHARACTERS),
        (b"MSH|^^\\&|A|B|C|D|||ADT|C1\r", HeaderErrorReason.DUPLICATE_ENCODING_CHARACTERS),
        (b"MSH|^~\\&^|A|B|C|D|||ADT|C1\r", HeaderErrorReason.DUPLICATE_ENCODING_CHARACTERS),
        (b"MSH|^~\\&|A|B|C|D|||ADT|\r", HeaderErrorReason.MISSING_CONTROL_ID),
        (b"MSH|^~\\&|A|B|C|D|||ADT|   |P\r", HeaderErrorReason.MISSING_CONTROL_ID),
        (b"MSH|^~\\&|A|B|C|D|||ADT\rPID|C1\r", HeaderErrorReason.MISSING_CONTROL_ID),
        (b"MSH|^~\\&\r", HeaderErrorReason.MISSING_CONTROL_ID),
    ],
)
def test_rejects_unusable_headers_with_a_machine_readable_reason(data: bytes, reason: HeaderErrorReason) -> None:
    assert reason_of(data) is reason


def test_duplicate_between_field_separator_and_encoding_characters_is_rejected() -> None:
    # "^" is both MSH-1 and in MSH-2: the first "^" ends MSH-2 early, so it is too short.
    assert reason_of(b"MSH^^~\\&^A^B") in {
        HeaderErrorReason.BAD_ENCODING_CHARACTERS,
        HeaderErrorReason.DUPLICATE_ENCODING_CHARACTERS,
    }


def test_unknown_charset_is_rejected_or_falls_back_to_the_default() -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||KLINGON\r"
    assert reason_of(data) is HeaderErrorReason.UNKNOWN_CHARSET
    assert parse_header(data, strict_charset=False).encoding == "utf-8"
    lenient = parse_header(data, strict_charset=False, default_encoding="ascii")
    assert lenient.encoding == "ascii"
    assert lenient.charset == "KLINGON"


@pytest.mark.parametrize("charset", ["UNICODE UTF-16", "UNICODE UTF-32", "UNICODE"])
def test_charsets_that_cannot_be_framed_by_mllp_are_rejected(charset: str) -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||" + charset.encode() + b"\r"
    assert reason_of(data) is HeaderErrorReason.UNKNOWN_CHARSET


def test_undecodable_bytes_for_the_declared_charset_are_rejected() -> None:
    utf8 = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||UNICODE UTF-8\rPID|1||||M\xfcller\r"
    ascii_ = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||ASCII\rPID|1||||M\xfcller\r"
    assert reason_of(utf8) is HeaderErrorReason.UNDECODABLE
    assert reason_of(ascii_) is HeaderErrorReason.UNDECODABLE


def test_a_rejected_header_still_names_an_ascii_msh10_but_never_a_non_ascii_one() -> None:
    def error(data: bytes) -> HL7HeaderError:
        with pytest.raises(HL7HeaderError) as caught:
            parse_header(data)
        return caught.value

    assert error(b"MSH|^~\\&|A|B|C|D|||ADT^A01|CTRL-7|P|2.5||||||KLINGON\r").control_id == "CTRL-7"
    assert error(b"MSH|^~\\&|A|B|C|D|||ADT^A01|C\xfc1|P|2.5||||||UNICODE UTF-8\r").control_id == ""
    assert error(b"PID|1\r").control_id == ""  # no header at all
    # a malformed MSH-2 (too short, too long, repeated, not punctuation) leaves MSH-10 readable
    for opening in (b"^~\\", b"^~\\&#@", b"^^\\&", b"^~\\A"):
        assert error(b"MSH|" + opening + b"|A|B|C|D|||ADT^A01|CTRL-8|P|2.5\r").control_id == "CTRL-8"
        assert error(
            b"MSH|" + opening + b"|A|B|C|D|||ADT^A01|CTRL-8|P|2.5\r",
        ).reason in (HeaderErrorReason.BAD_ENCODING_CHARACTERS, HeaderErrorReason.DUPLICATE_ENCODING_CHARACTERS)


def test_latin1_message_decodes_with_its_declared_charset() -> None:
    data = "MSH|^~\\&|APP|Zürich|R|F|||ADT^A01|C1|P|2.5|||||CHE|8859/1\rPID|1||||Müller\r"
    h = parse_header(data.encode("latin-1"))
    assert h.encoding == "iso8859-1"
    assert h.sending_facility == "Zürich"


@pytest.mark.parametrize(
    ("codec", "charset", "facility"),
    [
        ("big5", "BIG-5", "咽喉科"),  # Big5 trail bytes include 0x7C ("|")
        ("gb18030", "GB 18030-2000", "億倈"),  # so do GB 18030's
        ("iso2022_jp", "ISO IR87", "東京"),
        ("euc_kr", "KS X 1001", "서울"),
    ],
)
def test_double_byte_charsets_whose_bytes_collide_with_separators(codec: str, charset: str, facility: str) -> None:
    text = f"MSH|^~\\&|APP|{facility}|R|F|||ADT^A01|C9|P|2.5|||||XX|{charset}\rPID|1||{facility}\r"
    h = parse_header(text.encode(codec))
    assert h.sending_facility == facility
    assert h.control_id == "C9"
    assert h.charset == charset
    assert codecs.lookup(h.encoding) == codecs.lookup(codec)


def test_every_mapped_charset_is_a_real_ascii_compatible_codec() -> None:
    for name, codec in HL7_CHARSETS.items():
        info = codecs.lookup(codec)
        assert "MSH|^~\\&\r".encode(info.name) == b"MSH|^~\\&\r", name
        assert charset_to_codec(name.lower()) == codec
    assert charset_to_codec("  unicode   utf-8 ") == "utf-8"
    assert charset_to_codec("EBCDIC") is None


def test_first_repetition_of_msh18_is_the_message_charset() -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5|||||JPN|ASCII~ISO IR87|||ISO 2022-1994\r"
    h = parse_header(data)
    assert h.encoding == "ascii"
    assert h.charset == "ASCII~ISO IR87"


def test_incomplete_prefix_drops_the_field_cut_by_truncation() -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|CTRL42|P|2.5.1|||AL|NE||8859/"
    h = parse_header(data, complete=False)
    assert h.control_id == "CTRL42"
    assert h.charset == ""  # "8859/" was cut off, not read as a value
    with pytest.raises(HL7HeaderError):
        parse_header(b"MSH|^~\\&|A|B|C|D|||ADT^A01|CTRL42", complete=False)


def test_incomplete_prefix_does_not_decode_the_body() -> None:
    data = b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5||||||UNICODE UTF-8\rPID|\xe2\x82"
    assert parse_header(data, complete=False).control_id == "C1"
    assert reason_of(data) is HeaderErrorReason.UNDECODABLE


def test_error_text_never_quotes_message_content() -> None:
    secret = b"SECRET-PATIENT"
    samples = [
        secret,
        b"PID|" + secret + b"\rMSH|^~\\&|A|B|C|D|||ADT|C1\r",
        b"MSH|^~\\&|" + secret + b"||||||ADT|\r",
        b"MSH|^~\\&|A|B|C|D|||ADT^A01|C1|P|2.5\rPID|" + secret + b"\xff\r",
    ]
    for data in samples:
        with pytest.raises(HL7HeaderError) as info:
            parse_header(data)
        assert "SECRET" not in str(info.value)
        assert "SECRET" not in repr(info.value)


def with_msh15_16(msh15: str, msh16: str) -> bytes:
    return ADT.replace(b"|||AL|NE|", b"|||" + msh15.encode() + b"|" + msh16.encode() + b"|", 1)


@pytest.mark.parametrize(
    "msh15, msh16, ack_types, enhanced",
    [
        ("", "", None, False),
        (" ", " ", ("", ""), False),  # blank is empty: original mode, not refused
        ("AL", "NE", ("AL", "NE"), True),
        (" ER ", "", ("ER", ""), True),
        ("", "AL", ("", "AL"), True),
        ("SU", "XX", ("SU", "XX"), True),  # MSH-16 only tells the mode: not checked
    ],
)
def test_msh_15_and_16_tell_the_acknowledgment_mode(
    msh15: str, msh16: str, ack_types: tuple[str, str] | None, enhanced: bool
) -> None:
    h = parse_header(with_msh15_16(msh15, msh16))
    assert (h.ack_types, h.enhanced_mode) == (ack_types, enhanced)


@pytest.mark.parametrize("msh15", ["XX", "al", "ALWAYS", "A^L"])
def test_an_msh_15_outside_table_0155_is_refused_naming_the_message(msh15: str) -> None:
    with pytest.raises(HL7HeaderError) as info:
        parse_header(with_msh15_16(msh15, ""))
    assert info.value.reason is HeaderErrorReason.UNKNOWN_ACCEPT_ACK_TYPE
    assert info.value.control_id == "MSG00001"
    assert (info.value.condition.code, info.value.condition.location.text()) == ("103", "MSH^1^15")


def refusal_of(data: bytes, **kwargs: object) -> HL7HeaderError:
    with pytest.raises(HL7HeaderError) as info:
        parse_header(data, **kwargs)  # type: ignore[arg-type]
    return info.value


def test_a_header_refusal_keeps_what_of_the_header_was_read() -> None:
    """Once MSH-1/MSH-2 are read, a refusal carries the header so its answer can be addressed back
    in the sender's mode: MSH-15/16 included, MSH-10 only when it may be echoed."""
    empty_id = refusal_of(ADT.replace(b"|MSG00001|", b"||"))
    assert empty_id.header is not None
    assert (empty_id.header.sending_application, empty_id.header.receiving_application) == ("SENDAPP", "RECVAPP")
    assert (empty_id.header.version, empty_id.header.ack_types, empty_id.header.encoding) == (
        "2.5.1",
        ("AL", "NE"),
        "utf-8",
    )
    too_long = refusal_of(ADT.replace(b"MSG00001", b"X" * 200))
    assert (
        too_long.header is not None and too_long.header.control_id == "" and too_long.header.ack_types == ("AL", "NE")
    )
    # no MSH-1: nothing of the header can be read
    assert refusal_of(b"PID|1||X\r").header is None
    # a bad MSH-2: the answer's separators are the defaults, and only what needs none of them is
    # kept (not MSH-9 "ADT^A01^ADT_A01"); MSH-15 is not trusted (original mode)
    bad_msh2 = refusal_of(ADT.replace(b"^~\\&", b"^^\\&", 1)).header
    assert bad_msh2 is not None
    assert (bad_msh2.sending_application, bad_msh2.receiving_facility) == ("SENDAPP", "RECVFAC")
    assert (bad_msh2.message_type, bad_msh2.control_id, bad_msh2.version) == ("", "MSG00001", "2.5.1")
    assert (bad_msh2.encoding_characters, bad_msh2.ack_types) == ("^~\\&", None)


def test_a_charset_refusal_keeps_only_the_fields_before_the_first_byte_outside_ascii() -> None:
    """In a double-byte charset a trail byte may equal "|", so a field boundary after the first
    non-ASCII byte cannot be trusted: those fields (MSH-15 among them) are left empty, and the
    answer names no charset."""
    plain = refusal_of(ADT.replace(b"UNICODE UTF-8", b"KLINGON"))
    assert plain.reason is HeaderErrorReason.UNKNOWN_CHARSET and plain.header is not None
    assert (plain.header.control_id, plain.header.ack_types, plain.header.charset) == ("MSG00001", ("AL", "NE"), "")
    assert plain.header.encoding == "ascii"
    wide = refusal_of(ADT.replace(b"UNICODE UTF-8", b"KLINGON").replace(b"SENDFAC", b"S\xa4|FAC"))
    assert wide.header is not None
    assert (wide.header.sending_application, wide.header.sending_facility) == ("SENDAPP", "")
    assert (wide.header.control_id, wide.header.ack_types) == ("", None)  # original mode: AR
    assert wide.control_id == ""  # not MSH-9, which the shifted split puts tenth
