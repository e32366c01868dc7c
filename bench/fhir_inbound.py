"""CPU per message of the HTTP inbound's validation: a FHIR Patient, a transaction Bundle of a Patient
and N Observations (validated with fhir.resources' R4B models, `listeners.fhir_inbound`), beside an
HL7 v2 ADT of the same content through the one HL7 validation path (`listeners.validation`). What
FHIR inbound costs listenerd per message, before any commit; figures in docs/performance.md.

Process CPU time; the best of `--repeat` runs.

    uv run python bench/fhir_inbound.py [--messages 2000] [--repeat 5] [--observations 10]

Then the bound (``max_fhir_elements``, default 50,000 JSON values): CPU per value and the peak RSS
of validating bodies at the bound — the red team's costliest shape (a Patient of empty names) and
a transaction Bundle of Observations (about 21 values each) — and what refusing one over it costs.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable

from include.schema.connections import DEFAULT_MAX_FHIR_ELEMENTS
from listeners.fhir_inbound import FhirRejected, build_fhir, load_models
from listeners.validation import build_inbound
from tests.listeners.test_fhir_inbound import PATIENT

ADT = (
    "MSH|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|20261122101500||ADT^A01^ADT_A01|C1|P|2.5.1\r"
    "EVN|A01|20261122101500\rPID|1||MRN1^^^HOSP^MR||DOE^JANE||19700101|F\rPV1|1|I|W1^101^A\r"
)


def bundle(observations: int) -> dict[str, object]:
    entries: list[dict[str, object]] = [{"resource": PATIENT, "request": {"method": "PUT", "url": "Patient/pat-1"}}]
    for i in range(observations):
        observation = {
            "resourceType": "Observation",
            "status": "final",
            "code": {"coding": [{"system": "http://loinc.org", "code": "8867-4"}]},
            "subject": {"reference": "Patient/pat-1"},
            "valueQuantity": {"value": 60 + i, "unit": "/min"},
        }
        entries.append({"resource": observation, "request": {"method": "POST", "url": "Observation"}})
    return {"resourceType": "Bundle", "type": "transaction", "entry": entries}


def per_message_us(build: Callable[[], object], messages: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(messages):
            build()
        best = min(best, (time.process_time() - start) / messages * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--observations", type=int, default=10)
    args = parser.parse_args()
    load_models()
    patient = json.dumps(PATIENT).encode()
    tx = json.dumps(bundle(args.observations)).encode()
    cases: dict[str, tuple[int, Callable[[], object]]] = {
        "HL7 v2 ADT^A01": (len(ADT), lambda: build_inbound(ADT.encode(), connection="in", charset="utf-8")),
        "FHIR Patient": (len(patient), lambda: build_fhir(patient, connection="in")),
        f"FHIR Bundle (Patient + {args.observations} Obs)": (len(tx), lambda: build_fhir(tx, connection="in")),
    }
    print(f"HTTP inbound validation, no store: CPU µs per message, best of {args.repeat} runs of {args.messages}")
    for name, (size, build) in cases.items():
        print(f"  {name:<34} {size:>6} bytes {per_message_us(build, args.messages, args.repeat):9.1f}")
    at_bound(DEFAULT_MAX_FHIR_ELEMENTS)


def empty_names(values: int) -> bytes:
    return ('{"resourceType":"Patient","name":[' + ",".join(["{}"] * (values - 3)) + "]}").encode()


def at_bound(bound: int) -> None:
    """CPU per JSON value and peak RSS at the bound, and the cost of a refusal past it."""
    observations = (bound - 10) // 21
    shapes = {
        f"Patient of {bound - 3:,} empty names": empty_names(bound),
        f"Bundle of {observations:,} Observations": json.dumps(bundle(observations)).encode(),
    }
    print(f"At max_fhir_elements = {bound:,}: CPU s per body, µs per value, peak RSS of this process")
    for name, body in shapes.items():
        start = time.process_time()
        build_fhir(body, connection="in", max_elements=bound)
        took = time.process_time() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"  {name:<38} {len(body):>9} bytes {took:6.2f} s {took / bound * 1e6:6.1f} µs {peak:6.0f} MB")
    huge = empty_names(4 * 1024 * 1024 // 3)
    start = time.process_time()
    try:
        build_fhir(huge, connection="in", max_elements=bound)
    except FhirRejected as exc:
        assert exc.code == "too-costly"
    took = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  refused: 4 MiB of empty names           {len(huge):>9} bytes {took:6.3f} s         {peak:6.0f} MB")


if __name__ == "__main__":
    main()
