"""CPU per message of a conformance profile at ingest: `build_inbound` (what every transport runs on
a message before it is submitted) over the synthetic corpus, without a profile and with the shipped
v2.5.1 profiles in ``flag`` mode (every corpus message conforms, so this is the check's cost on good
traffic), and the ``reject`` path: a message with three findings, refused with its ERRs' conditions;
and the worst a message checked on the reactor can be: an ORU of 500 OBX (under the 512 segments
that go to a thread), each with a finding — every one counted, 20 of them listed — beside the same
message conforming.
Process CPU time, the best of `--repeat` runs; no store, no sockets.

    uv run python bench/profile_cost.py [--messages 20000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.hl7_corpus import messages
from listeners.profile_check import read_conformance
from listeners.validation import PayloadRejected, build_inbound

PROFILES = Path(__file__).resolve().parents[1] / "config" / "profiles"
SHIPPED = tuple(str(PROFILES / f"{n}.toml") for n in ("adt_a01", "oru_r01", "orm_o01"))
BAD = (
    "MSH|^~\\&|HIS|HOSP|SL|SL|20240101120000||ADT^A01^ADT_A01|C1|P|2.5.1\r"
    "EVN|A01|20240101120000\rPID|1||P1^^^HOSP^MR||DOE^JANE||19801301|X\rPV1|1|Q\r"
)

ORU = "MSH|^~\\&|LAB|HOSP|SL|SL|20240101120000||ORU^R01|C2|P|2.5.1\rPID|1||P1^^^HOSP^MR||DOE\rOBR|1|O1||GLU\r"
OBX = "OBX|{n}|NM|2345-7^Glucose^LN||95|mg/dL|70-99|{flag}|||F\r"


def per_message_us(payloads: list[bytes], mode: str | None, repeat: int) -> float:
    conformance = read_conformance(SHIPPED, mode, PROFILES) if mode else None
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for data in payloads:
            try:
                build_inbound(data, connection="in", charset="utf-8", conformance=conformance)
            except PayloadRejected:
                pass
        best = min(best, time.process_time() - start)
    return best / len(payloads) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    corpus = [m.encode() for m in messages(args.messages, seed=1)]
    bad = [BAD.encode()] * args.messages
    print(f"CPU µs per message, best of {args.repeat} runs of {args.messages}:")
    plain = per_message_us(corpus, None, args.repeat)
    print(f"  corpus, no profile               {plain:7.2f}")
    flagged = per_message_us(corpus, "flag", args.repeat)
    print(f"  corpus, shipped profiles (flag)  {flagged:7.2f}  (+{flagged - plain:.2f})")
    print(f"  3 findings, reject (refused)     {per_message_us(bad, 'reject', args.repeat):7.2f}")
    print(f"  3 findings, flag (staged)        {per_message_us(bad, 'flag', args.repeat):7.2f}")
    few = max(args.messages // 100, 1)
    oru = [(ORU + "".join(OBX.format(n=n, flag="N") for n in range(1, 501))).encode()] * few
    worst = [(ORU + "".join(OBX.format(n=n, flag="NOPE") for n in range(1, 501))).encode()] * few
    print(f"  500 OBX, conforming (flag)       {per_message_us(oru, 'flag', args.repeat):7.2f}")
    print(f"  500 OBX, 500 findings (reject)   {per_message_us(worst, 'reject', args.repeat):7.2f}")


if __name__ == "__main__":
    main()
