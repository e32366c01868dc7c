"""Synthetic HL7 traffic and a reconnecting sender for listenerd tests (no PHI)."""
from __future__ import annotations

import threading
import time

import hl7
from hl7.client import MLLPClient


def adt(control_id: str, *, patient: str = "P1", charset: str = "", version: str = "2.5.1",
        segment_end: str = "\r", name: str = "DOE^JANE") -> str:
    msh18 = f"||||||{charset}" if charset else ""
    return segment_end.join([
        f"MSH|^~\\&|SENDAPP|SENDFAC|STAGELINE|HOSP|20261122101500||ADT^A01^ADT_A01|{control_id}|P|{version}{msh18}",
        "EVN|A01|20261122101500",
        f"PID|1||{patient}^^^HOSP^MR||{name}||19700101|F",
        "PV1|1|I|W1^101^A",
    ]) + segment_end


def ack_fields(ack: str | bytes) -> tuple[str, str]:
    """(MSA-1, MSA-2) of an ACK, parsed by python-hl7."""
    text = ack.decode("latin-1") if isinstance(ack, bytes) else ack
    text = text.strip("\x0b\x1c\r\n")
    msa = hl7.parse(text).segment("MSA")
    return str(msa[1]), str(msa[2])


class Sender(threading.Thread):
    """Sends numbered messages through python-hl7's MLLPClient, reconnecting on any failure, and
    records which control ids were acknowledged AA. Stops when told."""

    def __init__(self, port: int, *, prefix: str, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.port, self.prefix, self.interval = port, prefix, interval
        self.acked: list[str] = []
        self.nacked: list[str] = []
        self.failures = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        n, client = 0, None
        while not self._stop_event.is_set():
            control_id = f"{self.prefix}{n:06d}"
            try:
                if client is None:
                    client = MLLPClient("127.0.0.1", self.port)
                    client.socket.settimeout(5)
                code, msa2 = ack_fields(client.send_message(adt(control_id)))
                (self.acked if code == "AA" and msa2 == control_id else self.nacked).append(control_id)
                n += 1  # a NAKed message is not retried under the same id; it simply was not accepted
            except OSError:
                self.failures += 1
                if client is not None:
                    try:
                        client.close()
                    except OSError:
                        pass
                client = None
                time.sleep(0.05)
                n += 1  # unknown outcome: never counted as acknowledged
            time.sleep(self.interval)
        if client is not None:
            client.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(15)
