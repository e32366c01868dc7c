"""The in-memory Python peer of FHIR output: HL7 v2 → FHIR R4 transaction Bundle, one message at a time.

What a converter without Spark does (the way Microsoft's FHIR-Converter and LinuxForHealth's
hl7v2-fhir-converter work: one message in, one Bundle out): ``hl7.parse`` per message, plain dicts
built from python-hl7's tree, ``json.dumps``. It builds the same resources with the same fields as
`spark_jobs.hl7_fhir` under the same `include.fhir_options.FhirOptions`, so `bench/pipeline.py
--fhir` compares equal work (`tests/spark_jobs/test_hl7_fhir.py` checks that both give the same
resources for the benchmark's corpus). Routing is the message-type test of the one FHIR route.

Scope: the benchmark's corpus (default separators; escape sequences decoded in notes only, the one
mapped field where the corpus has them) and messages with several patient groups; it does not
reproduce the Spark mapping's corner cases (custom separators, SN ratios, batches, the per-type
segment bounds; it does apply the 100-PID bound).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote_plus

import hl7

from include.fhir_options import FhirOptions
from spark_jobs import hl7_fhir as spec  # the fixed vocabularies, shared so both map alike

__all__ = ["bundle", "run"]

_DTM = re.compile(spec._DTM)
_NUMBER = re.compile(spec._NUMBER)
_SPACE = spec._SPACE
_ADT = ("A01", "A04", "A08")


def run(payloads: Iterable[str], options: FhirOptions) -> dict[str, int]:
    """Convert every ADT/ORU/ORM of ``payloads``; counts of Bundles and entries (what the JSON holds)."""
    bundles = entries = 0
    for i, payload in enumerate(payloads):
        doc = bundle(payload, f"m{i}|fhir", options)
        if doc is not None:
            text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
            bundles += 1
            entries += text.count('"fullUrl"')
    return {"bundles": bundles, "entries": entries}


def bundle(payload: str, seed: str, options: FhirOptions) -> dict[str, Any] | None:
    """The transaction Bundle of one message, None for one the mapping does not take."""
    text = payload.replace("\r\n", "\r").replace("\n", "\r")
    if any(_misnamed(line) for line in text.split("\r")):
        return None  # a segment id that is a mapped one only once trimmed or upper-cased
    msg = hl7.parse(text)
    segs = [(str(s[0]), s) for s in msg]
    msh = segs[0][1]
    kind, event = _v(msh, 9, 1), _v(msh, 9, 2)
    adt, oru, orm = kind == "ADT" and event in _ADT, kind == "ORU" and event == "R01", kind == "ORM" and event == "O01"
    pids = [(i, s) for i, (n, s) in enumerate(segs) if n == "PID"]
    if not (adt or oru or orm) or not pids or (adt and len(pids) > 1) or len(pids) > spec.MAX_PATIENTS:
        return None
    if len(pids) > 1 and _shared_identity([pid for _, pid in pids]):
        return None  # one patient in two groups, or two groups with the same PID-3
    grouped = [i for i, (n, _) in enumerate(segs) if n in ("OBR", "OBX", "ORC", "NK1")]
    if len(pids) > 1 and any(i < pids[0][0] for i in grouped):
        return None  # before the first of several patients: nobody's for sure

    def owner(pos: int) -> int:
        """The patient group of the segment at ``pos`` (before the first PID: the first's)."""
        return max(1, sum(p < pos for p, _ in pids))

    identity = "|".join(f"{len(x)}:{x}" for x in (_raw(msh, 3), _raw(msh, 4), _raw(msh, 7), _v(msh, 10) or seed))
    urls = {g: _uuid(seed, "Patient" if g == 1 else f"Patient/{g}") for g in range(1, len(pids) + 1)}
    senders = {g: f"{identity}|{len(_raw(pid, 3))}:{_raw(pid, 3)}" for g, (_, pid) in enumerate(pids, 1)}
    subjects = {g: {"reference": url} for g, url in urls.items()}

    def within(rows: list[tuple[int, Any]], k: int) -> int:
        """The number of the ``k``-th of ``rows`` within its patient's group (the first group from 1)."""
        g = owner(rows[k - 1][0])
        return k - (0 if g == 1 else sum(p < pids[g - 1][0] for p, _ in rows))

    out: list[dict[str, Any]] = []
    for g, (_, pid) in enumerate(pids, 1):
        kin = [s for i, (n, s) in enumerate(segs) if n == "NK1" and owner(i) == g]
        out.append(_patient(pid, kin, urls[g], options))
    pv1 = next((s for n, s in segs if n == "PV1"), None)
    if adt and pv1 is not None:
        out.append(_encounter(pv1, seed, senders[1], subjects[1], options))
    obrs = [(i, s) for i, (n, s) in enumerate(segs) if n == "OBR"]
    obxs = [(i, s) for i, (n, s) in enumerate(segs) if n == "OBX"]
    if oru:

        def report(p: int) -> int:
            """The number of the OBR before ``p`` in its patient's group, else 0."""
            k = sum(q < p for q, _ in obrs)
            return k if k and owner(obrs[k - 1][0]) == owner(p) else 0

        for k, (pos, obr) in enumerate(obrs, 1):
            results = [{"reference": _uuid(seed, f"OBX/{j}")} for j, (p, _) in enumerate(obxs, 1) if report(p) == k]
            g = owner(pos)
            out.append(_report(obr, k, within(obrs, k), seed, senders[g], subjects[g], results, options))
        out.extend(
            _observation(
                obx, j, within(obxs, j), seed, senders[owner(pos)], subjects[owner(pos)], _notes(segs, pos), options
            )
            for j, (pos, obx) in enumerate(obxs, 1)
        )
    if orm:
        orcs = [(i, s) for i, (n, s) in enumerate(segs) if n == "ORC"]
        for k, (pos, obr) in enumerate(obrs, 1):
            g = owner(pos)
            before = [s for p, s in orcs if owner(p) == g and p < pos]
            orc = before[-1] if before else None  # none before it in its group: no ORC fields
            out.append(_order(obr, orc, k, within(obrs, k), seed, senders[g], subjects[g], _notes(segs, pos), options))
    puts = [e["request"]["url"] for e in out if e["request"]["method"] == "PUT"]
    if len(set(puts)) < len(puts):
        return None  # two entries on one conditional URL: refused, as a server would fail it
    return {"resourceType": "Bundle", "type": "transaction", "entry": out}


# --- reading python-hl7's tree ------------------------------------------------------------------


def _v(seg: Any, field: int, component: int = 1, sub: int = 1, rep: int = 1) -> str | None:
    """The leaf at SEG-field[rep].component.sub, None when missing or empty (HL7 "" too). python-hl7
    numbers MSH's fields as HL7 does (``msh[3]`` is MSH-3), like every other segment's."""
    try:
        f = seg[field]
        r = f[rep - 1] if isinstance(f, hl7.Field) else f
    except IndexError:
        return None
    return _c(r, component, sub)


_LOOSE_ID = re.compile(r"^[\s\ufeff]*([A-Za-z0-9]{3})(?:[^A-Za-z0-9]|$)")
_USED = spec._USED


def _misnamed(line: str) -> bool:
    m = _LOOSE_ID.match(line)
    return line[:3] not in _USED and m is not None and m.group(1).upper() in _USED


def _shared_identity(pids: list[Any]) -> bool:
    """Two PID-3 alike as sent, or one value from one assigning authority (namespace or universal id) in two."""
    raw = [_raw(pid, 3) for pid in pids]
    keys: list[str] = []
    for pid in pids:
        mine = set()
        for r in _reps(pid, 3):
            value = _trimmed(_c(r, 1))
            mine |= {
                f"{tag}|{auth}|{value}" for tag, auth in (("N", _c(r, 4, 1)), ("U", _c(r, 4, 2))) if value and auth
            }
        keys += mine
    return len(set(raw)) < len(raw) or len(set(keys)) < len(keys)


def _raw(seg: Any, field: int) -> str:
    """The field's text as sent (every repetition and component), "" when missing."""
    try:
        return str(seg[field])
    except IndexError:
        return ""


def _trimmed(x: str | None) -> str | None:
    out = re.sub(f"^{_SPACE}+|{_SPACE}+$", "", x or "")
    return out or None


def _code(x: str | None) -> str | None:
    return re.sub(f"{_SPACE}+", " ", _trimmed(x) or "") or None


def _reps(seg: Any, field: int) -> list[Any]:
    try:
        f = seg[field]
    except IndexError:
        return []
    return list(f) if isinstance(f, hl7.Field) else [f]


def _c(rep: Any, component: int, sub: int = 1) -> str | None:
    try:
        c = rep[component - 1] if isinstance(rep, hl7.Repetition) else (rep if component == 1 else None)
        x = c[sub - 1] if isinstance(c, hl7.Component) else (c if sub == 1 else None)
    except IndexError:
        return None
    text = None if x is None else str(x)
    return text if text not in (None, "", '""') else None


def _drop_none(d: dict[str, Any]) -> dict[str, Any] | None:
    out = {k: v for k, v in d.items() if v not in (None, [], {})}
    return out or None


def _uuid(seed: str, key: str) -> str:
    h = hashlib.sha256(f"{seed}|{key}".encode()).hexdigest()
    return f"urn:uuid:{h[:8]}-{h[8:12]}-5{h[13:16]}-a{h[17:20]}-{h[20:32]}"


# --- data types -----------------------------------------------------------------------------------


def _date(v: str | None) -> str | None:
    digits = _dtm_digits(v)
    if digits is None:
        return None
    n = min(len(digits), 8)
    return digits[:4] + (f"-{digits[4:6]}" if n >= 6 else "") + (f"-{digits[6:8]}" if n >= 8 else "")


def _datetime(v: str | None, options: FhirOptions) -> str | None:
    digits = _dtm_digits(v)
    if digits is None or v is None:
        return None
    n = len(digits)
    out = _date(v) or ""
    if n >= 10:
        m = _DTM.match(v)
        assert m is not None
        offset = m.group(3)
        zone = f"{offset[:3]}:{offset[3:]}" if offset else options.timezone
        frac = (m.group(2) or "") if n == 14 else ""
        out += f"T{digits[8:10]}:{digits[10:12] if n >= 12 else '00'}:{digits[12:14] if n >= 14 else '00'}{frac}{zone}"
    return out


def _dtm_digits(v: str | None) -> str | None:
    m = _DTM.match(v or "")
    if m is None:
        return None
    import datetime

    digits = m.group(1)
    padded = digits + "0101000000"[len(digits) - 4 :]
    try:
        datetime.datetime.strptime(padded, "%Y%m%d%H%M%S")
    except ValueError:
        return None
    return digits


def _codeable(rep: Any, options: FhirOptions, default_system: str | None = None) -> dict[str, Any] | None:
    if rep is None:
        return None
    codings = []
    for at in (1, 4):
        code = _code(_c(rep, at))
        if code is None:
            continue
        name = _c(rep, at + 2)
        system = options.code_systems.get(name) if name else None
        if system is None and default_system is not None and name is None:
            system = default_system
        codings.append(_drop_none({"system": system, "code": code, "display": _c(rep, at + 1)}))
    text = _c(rep, 9) or (_c(rep, 2) if _code(_c(rep, 1)) is None else None)
    return _drop_none({"coding": codings, "text": text})


def _identifier(rep: Any, options: FhirOptions) -> dict[str, Any] | None:
    value = _trimmed(_c(rep, 1))
    if value is None:
        return None
    namespace, universal, universal_type = _c(rep, 4, 1), _c(rep, 4, 2), _c(rep, 4, 3)
    system = (
        (options.identifier_systems.get(universal) if universal else None)
        or (
            f"urn:oid:{universal}"
            if universal_type == "ISO" and universal and re.fullmatch(r"[0-2](\.(0|[1-9]\d*))+", universal)
            else None
        )
        or (options.identifier_systems.get(namespace) if namespace else None)
    )
    code = _code(_c(rep, 5))
    kind = {"coding": [{"system": spec._V2_0203, "code": code}]} if code else None
    return _drop_none({"type": kind, "system": system, "value": value})


def _entry(url: str, resource: dict[str, Any]) -> dict[str, Any]:
    ids = resource.get("identifier") or []
    keyed = next((i for i in ids if i.get("system") and i.get("value")), None)
    kind = resource["resourceType"]
    if keyed is None:
        request = {"method": "POST", "url": kind}
    else:

        def esc(x: str) -> str:
            return quote_plus(re.sub(r"([\\|,$])", r"\\\1", x))

        request = {"method": "PUT", "url": f"{kind}?identifier={esc(keyed['system'])}|{esc(keyed['value'])}"}
    return {"fullUrl": url, "resource": resource, "request": request}


def _stageline_identifier(sender: str, key: str) -> dict[str, str]:
    return {"system": spec._STAGELINE_SYSTEM, "value": _uuid(sender, key)}


# --- resources ------------------------------------------------------------------------------------


def _name(r: Any) -> dict[str, Any] | None:
    family, given = _c(r, 1), [x for x in (_c(r, 2), _c(r, 3)) if x]
    if not (family or given):
        return None
    return _drop_none(
        {
            "use": spec._NAME_USE.get(_c(r, 7) or ""),
            "family": family,
            "given": given,
            "prefix": [x for x in [_c(r, 5)] if x],
            "suffix": [x for x in [_c(r, 4)] if x],
        }
    )


def _address(r: Any) -> dict[str, Any] | None:
    parts = [_c(r, i) for i in range(1, 7)]
    if not any(parts):
        return None
    return _drop_none(
        {
            "use": spec._ADDRESS_USE.get(_c(r, 7) or ""),
            "line": [x for x in parts[:2] if x],
            "city": parts[2],
            "state": parts[3],
            "postalCode": parts[4],
            "country": parts[5],
        }
    )


def _next_of_kin(nk1: Any, options: FhirOptions) -> dict[str, Any] | None:
    names, addresses = _reps(nk1, 2), _reps(nk1, 4)
    name = _name(names[0]) if names else None
    address = _address(addresses[0]) if addresses else None
    telecom = [t for use, n in (("home", 5), ("work", 6)) for r in _reps(nk1, n) if (t := _contact(r, use))]
    if not (name or telecom or address):
        return None
    relationship = _codeable(_first(nk1, 3), options)
    return _drop_none(
        {"relationship": [relationship] if relationship else None, "name": name, "telecom": telecom, "address": address}
    )


def _patient(pid: Any, nk1s: list[Any], url: str, options: FhirOptions) -> dict[str, Any]:
    names = [n for r in _reps(pid, 5) if (n := _name(r))]
    addresses = [a for r in _reps(pid, 11) if (a := _address(r))]
    telecom = [t for use, n in (("home", 13), ("work", 14)) for r in _reps(pid, n) if (t := _contact(r, use))]
    deceased = _datetime(_v(pid, 29), options)
    resource = _drop_none(
        {
            "resourceType": "Patient",
            "identifier": [i for r in _reps(pid, 3) if (i := _identifier(r, options))],
            "name": names,
            "telecom": telecom,
            "gender": options.gender.get(_v(pid, 8) or ""),
            "birthDate": _date(_v(pid, 7)),
            "deceasedDateTime": deceased,
            "deceasedBoolean": {"Y": True, "N": False}.get(_v(pid, 30) or "") if _v(pid, 29) is None else None,
            "address": addresses,
            "contact": [c for nk1 in nk1s if (c := _next_of_kin(nk1, options))],
        }
    )
    assert resource is not None
    return _entry(url, resource)


def _contact(r: Any, use: str) -> dict[str, Any] | None:
    email = _c(r, 2) == "NET" or _c(r, 3) == "Internet"
    number = _c(r, 1) or (" ".join(x for x in (_c(r, 6), _c(r, 7)) if x) if _c(r, 7) else None)
    value = (_c(r, 4) or _c(r, 1)) if email else number
    if value is None:
        return None
    system = "email" if email else "fax" if _c(r, 3) == "FX" else "phone"
    return {"system": system, "value": value, "use": "mobile" if _c(r, 3) == "CP" else use}


def _encounter(pv1: Any, seed: str, sender: str, subject: Any, options: FhirOptions) -> dict[str, Any]:
    klass_code = _code(_v(pv1, 2))
    mapped = options.patient_class.get(klass_code or "")
    klass = (
        {"system": spec._ACT_CODE, "code": mapped}
        if mapped
        else {"system": spec._V2_0004, "code": klass_code}
        if klass_code
        else {"system": spec._NULL_FLAVOR, "code": "UNK"}
    )
    start, end = _datetime(_v(pv1, 44), options), _datetime(_v(pv1, 45), options)
    visit = _reps(pv1, 19)
    ids = [i for i in (_identifier(visit[0], options) if visit else None, _stageline_identifier(sender, "PV1")) if i]
    resource = _drop_none(
        {
            "resourceType": "Encounter",
            "identifier": ids,
            "status": "finished" if end else "in-progress",
            "class": klass,
            "subject": subject,
            "period": _drop_none({"start": start, "end": end}),
        }
    )
    assert resource is not None
    return _entry(_uuid(seed, "Encounter"), resource)


def _order_identifier(seg: Any, n: int, code: str, options: FhirOptions) -> dict[str, Any] | None:
    if seg is None or (value := _trimmed(_v(seg, n))) is None:
        return None
    system = options.identifier_systems.get(_v(seg, n, 2) or "") or options.identifier_systems.get(_v(seg, n, 3) or "")
    return _drop_none({"type": {"coding": [{"system": spec._V2_0203, "code": code}]}, "system": system, "value": value})


def _report(
    obr: Any, k: int, n: int, seed: str, sender: str, subject: Any, results: list[Any], options: FhirOptions
) -> dict[str, Any]:
    ids = [i for i in (_order_identifier(obr, 3, "FILL", options), _stageline_identifier(sender, f"OBR/{n}")) if i]
    code = _codeable(_first(obr, 4), options) or {"text": "unknown"}
    resource = _drop_none(
        {
            "resourceType": "DiagnosticReport",
            "identifier": ids,
            "status": spec._REPORT_STATUS.get(_v(obr, 25) or "", "unknown"),
            "code": code,
            "subject": subject,
            "effectiveDateTime": _datetime(_v(obr, 7), options),
            "result": results,
        }
    )
    assert resource is not None
    return _entry(_uuid(seed, f"OBR/{k}"), resource)


def _first(seg: Any, n: int) -> Any:
    reps = _reps(seg, n)
    return reps[0] if reps and str(reps[0]) else None


def _notes(segs: list[tuple[str, Any]], pos: int) -> list[dict[str, str]]:
    """The NTE right after segment ``pos``: each an Annotation of NTE-3 (repetitions, line by line)."""
    out = []
    for name, seg in segs[pos + 1 :]:
        if name != "NTE":
            break
        if text := "\n".join(_unescaped(str(r)) for r in _reps(seg, 3) if str(r)):
            out.append({"text": text})
    return out


_ESCAPES = {"F": "|", "S": "^", "T": "&", "R": "~", "E": "\\"}


def _unescaped(text: str) -> str:
    """HL7's separator escapes resolved (default separators), others such as ``\\H\\`` kept as sent."""
    return re.sub(r"\\([^\\|^~&]*)\\", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def _observation(
    obx: Any,
    j: int,
    n: int,
    seed: str,
    sender: str,
    subject: Any,
    notes: list[dict[str, str]],
    options: FhirOptions,
) -> dict[str, Any]:
    resource: dict[str, Any] = (
        _drop_none(
            {
                "resourceType": "Observation",
                "identifier": [_stageline_identifier(sender, f"OBX/{n}")],
                "status": spec._OBSERVATION_STATUS.get(_v(obx, 11) or "", "unknown"),
                "code": _codeable(_first(obx, 3), options) or {"text": "unknown"},
                "subject": subject,
                "effectiveDateTime": _datetime(_v(obx, 14), options),
                "interpretation": [x for x in [_codeable(_first(obx, 8), options, spec._V2_0078)] if x],
                "note": notes,
                "referenceRange": [{"text": _v(obx, 7)}] if _v(obx, 7) else None,
            }
        )
        or {}
    )
    kind, value = _v(obx, 2), _v(obx, 5)
    if value is not None:
        if kind == "NM" and _NUMBER.match(value):
            unit = _first(obx, 6)
            system = options.code_systems.get(_c(unit, 3) or "") if unit is not None else None
            quantity = {
                "value": json.loads(_json_number(value)),
                "unit": (_c(unit, 2) or _c(unit, 1)) if unit is not None else None,
            }
            quantity.update({"system": system, "code": _code(_c(unit, 1)) if system else None})
            resource["valueQuantity"] = _drop_none(quantity)
        elif kind in ("CWE", "CE", "CNE", "CF") and (cc := _codeable(_first(obx, 5), options)):
            resource["valueCodeableConcept"] = cc
        elif kind in ("DT", "DTM", "TS") and (dt := _datetime(value, options)):
            resource["valueDateTime"] = dt
        else:
            resource["valueString"] = "\n".join(str(r) for r in _reps(obx, 5) if str(r))
    return _entry(_uuid(seed, f"OBX/{j}"), resource)


def _json_number(text: str) -> str:
    out = re.sub(r"^\+", "", text)
    out = re.sub(r"^(-?)\.", r"\g<1>0.", out)
    out = re.sub(r"\.$", "", out)
    return re.sub(r"^(-?)0+(\d)", r"\1\2", out)


def _order(
    obr: Any,
    orc: Any,
    k: int,
    n: int,
    seed: str,
    sender: str,
    subject: Any,
    notes: list[dict[str, str]],
    options: FhirOptions,
) -> dict[str, Any]:
    placer = _order_identifier(obr, 2, "PLAC", options) or _order_identifier(orc, 2, "PLAC", options)
    filler = _order_identifier(obr, 3, "FILL", options) or _order_identifier(orc, 3, "FILL", options)
    status = (
        (spec._ORDER_STATUS.get(_v(orc, 5) or "") if orc is not None else None)
        or (spec._ORDER_CONTROL.get(_v(orc, 1) or "") if orc is not None else None)
        or "unknown"
    )
    priority = (_v(orc, 7, 6) if orc is not None else None) or _v(obr, 27, 6)
    authored = (_datetime(_v(orc, 9), options) if orc is not None else None) or _datetime(_v(obr, 6), options)
    resource = _drop_none(
        {
            "resourceType": "ServiceRequest",
            "identifier": [i for i in (placer, filler, _stageline_identifier(sender, f"ORD/{n}")) if i],
            "status": status,
            "intent": "order",
            "priority": spec._PRIORITY.get(priority or ""),
            "code": _codeable(_first(obr, 4), options),
            "subject": subject,
            "authoredOn": authored,
            "note": notes,
        }
    )
    assert resource is not None
    return _entry(_uuid(seed, f"ORD/{k}"), resource)
