"""CPU per message of MLLP's answer path, with no store: frame in, header parsed, handler's decision,
ACK built and written — for original mode (AA), enhanced mode (MSH-15 AL: CA; NE: nothing written)
and a refusal with its ERR (a NUL in PID-5: AR, 102 at PID^1^5). What the ACK codes and MSH-15 add
to listenerd's per-message work, measured the same way on any commit (run it on both and compare).

The handler answers at once (no store), so only the protocol's own work is timed: the fast path
whose cost this bench is about. Process CPU time; the best of `--repeat` runs.

    uv run python bench/ack_path.py [--messages 10000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.testing import MemoryReactorClock, StringTransport

from listeners.connections_config import InboundConfig
from listeners.endpoints import Wiring, mllp_handler
from listeners.hl7ack import AckDecision
from listeners.metrics import Metrics
from listeners.mllp_listener import MLLPFactory, frame

MESSAGE = (
    "MSH|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|20261122101500||ADT^A01^ADT_A01|{cid}|P|2.5.1{ack}\r"
    "EVN|A01|20261122101500\rPID|1||P1^^^HOSP^MR||{name}||19700101|F\rPV1|1|I|W1^101^A\r"
)
PEER = IPv4Address("TCP", "127.0.0.1", 5000)

CASES: dict[str, tuple[str, str, AckDecision]] = {
    # name: (MSH-13.., PID-5, the handler's decision)
    "original AA": ("", "DOE^JANE", AckDecision.accept()),
    "enhanced CA (MSH-15 AL)": ("|||AL|NE", "DOE^JANE", AckDecision.accept()),
    "enhanced, nothing (MSH-15 NE)": ("|||NE|NE", "DOE^JANE", AckDecision.accept()),
    "refusal AR + ERR (a NUL)": ("", "DO\x00E^JANE", AckDecision.accept()),  # refused before any submit
}


def per_message_us(ack: str, name: str, decision: AckDecision, messages: int, repeat: int) -> float:
    def decided(*_: object) -> Deferred[AckDecision]:
        return succeed(decision)

    handler: Callable[..., Deferred[AckDecision]] = decided
    if "\x00" in name:  # the real handover, which validates (and refuses) before it would submit
        wiring = Wiring(ingest=None, metrics=Metrics(), reactor=MemoryReactorClock(), bound_ports={})  # type: ignore[arg-type]
        handler = mllp_handler(InboundConfig("in", "mllp"), wiring, None)
    proto = MLLPFactory(handler, clock=MemoryReactorClock()).buildProtocol(PEER)
    transport = StringTransport(peerAddress=PEER)
    proto.makeConnection(transport)
    frames = [frame(MESSAGE.format(cid=f"C{i}", ack=ack, name=name).encode()) for i in range(messages)]
    best = float("inf")
    for _ in range(repeat):
        transport.clear()
        start = time.process_time()
        for f in frames:
            proto.dataReceived(f)
        best = min(best, (time.process_time() - start) / messages * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print(f"MLLP answer path, no store: CPU µs per message, best of {args.repeat} runs of {args.messages}")
    for case, (ack, name, decision) in CASES.items():
        print(f"  {case:<32} {per_message_us(ack, name, decision, args.messages, args.repeat):6.2f}")


if __name__ == "__main__":
    main()
