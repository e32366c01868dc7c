"""Synthetic sample messages (no real patients) for `stageline demo send`."""
from __future__ import annotations

import time
from collections.abc import Iterator

import hl7
from hl7.client import MLLPClient

TEMPLATES = {
    "ADT^A01": ("MSH|^~\\&|DEMOADT|DEMOHOSP|STAGELINE|HOSP|{ts}||ADT^A01^ADT_A01|{cid}|P|2.5.1\r"
                "EVN|A01|{ts}\rPID|1||{pid}^^^DEMOHOSP^MR||TEST^PATIENT{n}||19800101|F\r"
                "PV1|1|I|WARD1^101^A\r"),
    "ORU^R01": ("MSH|^~\\&|DEMOLAB|DEMOHOSP|STAGELINE|HOSP|{ts}||ORU^R01^ORU_R01|{cid}|P|2.5.1\r"
                "PID|1||{pid}^^^DEMOHOSP^MR||TEST^PATIENT{n}\rOBR|1|ORD{n}||2345-7^Glucose^LN\r"
                "OBX|1|NM|2345-7^Glucose^LN||{value}|mg/dL|70-99|N|||F\r"),
    "ORM^O01": ("MSH|^~\\&|DEMOCPOE|DEMOHOSP|STAGELINE|HOSP|{ts}||ORM^O01|{cid}|P|2.3\r"
                "PID|1||{pid}^^^DEMOHOSP^MR||TEST^PATIENT{n}\rORC|NW|ORD{n}\rOBR|1|ORD{n}||71020^CHEST XRAY^CPT\r"),
}


def send_samples(host: str, port: int, *, count: int) -> Iterator[tuple[str, str, str]]:
    """Yield (control id, message type, ACK code) for every message sent."""
    ts = time.strftime("%Y%m%d%H%M%S", time.gmtime())
    with MLLPClient(host, port) as client:
        for n in range(count):
            for kind, template in TEMPLATES.items():
                cid = f"DEMO{int(time.time()) % 100000:05d}{n:03d}{kind[:1]}"
                message = template.format(ts=ts, cid=cid, pid=f"DP{n % 3}", n=n, value=80 + n)
                ack = hl7.parse(client.send_message(message).decode().strip("\x0b\x1c\r\n"))
                yield cid, kind, str(ack.segment("MSA")[1])
