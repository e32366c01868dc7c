"""Destination config: parse_destinations fills defaults and names the destination and setting in
every error; lane_key follows the lane rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from include.destinations_config import (
    DestinationConfigError,
    FileDestination,
    HttpDestination,
    MllpDestination,
    lane_key,
    parse_destinations,
)


def hl7_message(control_id: str, patient: str) -> str:
    """A small synthetic ADT^A08 (no PHI); MSH-10 = control_id, PID-3.1 = patient."""
    return (f"MSH|^~\\&|STAGELINE|SL|EHR|HOSP|20240101120000||ADT^A08^ADT_A01|{control_id}|P|2.5.1\r"
            f"EVN|A08|20240101120000\rPID|1||{patient}^^^HOSP^MR||DOE^JOHN\r")


def test_parse_destinations_fills_defaults_for_each_kind(tmp_path: Path) -> None:
    parsed = parse_destinations([
        {"name": "ehr", "kind": "mllp", "host": "ehr.example", "port": 2575,
         "tls": {"ca_file": "/etc/ca.pem", "cert_file": "/etc/c.pem", "key_file": "/etc/k.pem"}},
        {"name": "archive", "kind": "file", "directory": str(tmp_path), "lane": "PID-3.1", "max_attempts": 3},
        {"name": "api", "kind": "http", "url": "https://api.example/hl7", "headers": {"X-Tenant": "a"},
         "backoff_seconds": 0.5, "max_backoff_seconds": 60},
    ])
    assert list(parsed) == ["ehr", "archive", "api"]
    ehr, archive, api = parsed["ehr"], parsed["archive"], parsed["api"]
    assert isinstance(ehr, MllpDestination) and isinstance(archive, FileDestination)
    assert isinstance(api, HttpDestination)
    assert (ehr.timeout_seconds, ehr.max_attempts, ehr.backoff_seconds, ehr.max_backoff_seconds, ehr.lane,
            ehr.permanent_ack_codes) == (10.0, 10, 5.0, 300.0, "destination", ("AR", "CR"))
    assert ehr.tls is not None and (ehr.tls.ca_file, ehr.tls.verify) == ("/etc/ca.pem", True)
    assert (archive.suffix, archive.lane, archive.max_attempts, archive.mode, archive.batch) == (
        ".hl7", "PID-3.1", 3, 0o600, False)
    assert (api.headers, api.backoff_seconds, api.max_backoff_seconds) == ((("X-Tenant", "a"),), 0.5, 60.0)


def test_parse_destinations_accepts_a_table_keyed_by_name() -> None:
    parsed = parse_destinations({"api": {"kind": "http", "url": "http://127.0.0.1:9/x"}})
    assert list(parsed) == ["api"] and parsed["api"].name == "api"


@pytest.mark.parametrize(("spec", "error"), [
    ({"kind": "mllp", "host": "h", "port": 1}, r"destination #0: 'name'"),
    ({"name": "x", "kind": "ftp"}, r"destination 'x': 'kind' must be one of"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 70000}, r"destination 'ehr': 'port' must be"),
    ({"name": "ehr", "kind": "mllp", "host": "", "port": 1}, r"destination 'ehr': 'host' must be"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "timeout_seconds": 0},
     r"destination 'ehr': 'timeout_seconds' must be a number >= 0.001"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "permanent_ack_codes": ["AA"]},
     r"destination 'ehr': 'permanent_ack_codes'"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "tls": {"ca": "x"}},
     r"destination 'ehr': unknown 'tls' setting\(s\) \['ca'\]"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "tls": {"key_file": "k"}},
     r"destination 'ehr': 'tls.key_file' needs 'tls.cert_file'"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "directory": "/x"},
     r"destination 'ehr': unknown setting\(s\) \['directory'\] for kind 'mllp'"),
    ({"name": "a", "kind": "file", "directory": "relative/dir"}, r"destination 'a': 'directory' must be an absolute path"),
    ({"name": "a", "kind": "file", "directory": "/x", "suffix": "/.hl7"}, r"destination 'a': 'suffix'"),
    ({"name": "a", "kind": "file", "directory": "/x", "batch": "yes"}, r"destination 'a': 'batch' must be true or false"),
    ({"name": "ehr", "kind": "mllp", "host": "h", "port": 1, "batch": True},
     r"destination 'ehr': unknown setting\(s\) \['batch'\] for kind 'mllp'"),
    ({"name": "a", "kind": "file", "directory": "/x", "max_attempts": 0},
     r"destination 'a': 'max_attempts' must be an integer >= 1"),
    ({"name": "a", "kind": "file", "directory": "/x", "max_attempts": True}, r"'max_attempts' must be an integer"),
    ({"name": "a", "kind": "file", "directory": "/x", "backoff_seconds": 10, "max_backoff_seconds": 5},
     r"destination 'a': 'max_backoff_seconds' must be >= 'backoff_seconds'"),
    ({"name": "a", "kind": "file", "directory": "/x", "lane": "pid-3"},
     r"destination 'a': 'lane' must be 'destination' or an HL7 field path"),
    ({"name": "api", "kind": "http", "url": "ftp://x/y"}, r"destination 'api': 'url' must be an http"),
    ({"name": "api", "kind": "http", "url": "http://x/y", "tls": {"verify": False}},
     r"destination 'api': 'tls' needs an https:// url"),
    ({"name": "api", "kind": "http", "url": "http://x/y", "headers": {"Idempotency-Key": "k"}},
     r"destination 'api': 'headers' may not set \['Idempotency-Key'\]"),
])
def test_parse_destinations_errors_name_the_destination_and_the_setting(spec: dict[str, Any], error: str) -> None:
    with pytest.raises(DestinationConfigError, match=error):
        parse_destinations([spec])


def test_duplicate_destination_names_are_refused() -> None:
    spec = {"name": "a", "kind": "file", "directory": "/x"}
    with pytest.raises(DestinationConfigError, match=r"destination 'a': duplicate"):
        parse_destinations([spec, spec])


def test_lane_key_is_per_destination_or_per_field_value_and_always_names_the_destination() -> None:
    parsed = parse_destinations([{"name": "ehr", "kind": "mllp", "host": "h", "port": 1},
                                 {"name": "lab", "kind": "mllp", "host": "h", "port": 1, "lane": "PID-3.1"}])
    assert lane_key(parsed["ehr"], hl7_message("C1", "P7")) == "ehr"
    assert lane_key(parsed["lab"], hl7_message("C1", "P7")) == "lab|P7"
    assert lane_key(parsed["lab"], "MSH|^~\\&|A|B\rEVN|A08\r") == "lab|"
    assert lane_key(parsed["lab"], "not hl7") == "lab|"
