"""Delivering one message to one destination: `send()` picks the sender for the destination's kind.

Plain Python on purpose — no Twisted, no store, no Spark — so it imports inside Spark's Python
workers. The destination config is `include.destinations_config`; one module per transport
(`mllp`, `file`, `http`), the per-process connection cache in `pool`, client TLS in `client_tls`, and
what they share (`DeliveryResult`, the payload's codec, error text) in `common`.

Every send returns a `DeliveryResult(ok, retryable, detail)` and never raises: an exception
inside a Spark task would fail the task, and Spark's task retry would re-send the whole
partition. `retryable=False` means retrying the same bytes cannot help; the deliver stage then
moves the row straight to `dead` (reason in `last_error` and the audit trail).

Idempotency (a re-delivery can always happen: at-least-once, invariant 5 in docs/invariants.md):

* MLLP has no header for a key. The message goes out unchanged, so its MSH-10 is the same on
  every attempt; receivers de-duplicate on MSH-10 (HL7's own rule), and the idempotency key is
  recorded with the row and its audit events.
* File: the file is named `<idempotency_key><suffix>` and written atomically (temp file in the
  same directory, fsync, `os.replace`, fsync of the directory), so a re-delivery overwrites the
  same file with the same bytes. Pollers must ignore dot-files (`.stageline-*.tmp`).
* HTTP: `Idempotency-Key: <key>` on every POST.
"""

from __future__ import annotations

from include.destinations_config import Destination, FileDestination, HttpDestination, MllpDestination
from spark_jobs.senders.common import DeliveryResult
from spark_jobs.senders.file import send_file
from spark_jobs.senders.http import send_http
from spark_jobs.senders.mllp import send_mllp
from spark_jobs.senders.pool import POOL

__all__ = ["close_connections", "send"]


def send(dest: Destination, *, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    """Deliver one message to `dest`; never raises (an unexpected error is a retryable result)."""
    try:
        if isinstance(dest, MllpDestination):
            return send_mllp(dest, payload)
        if isinstance(dest, FileDestination):
            return send_file(dest, payload, content_type, idempotency_key)
        if isinstance(dest, HttpDestination):
            return send_http(dest, payload, content_type, idempotency_key)
        return DeliveryResult.retry(f"destination {dest.name!r}: no sender for kind {dest.kind!r}")
    except Exception as exc:  # a raise would fail the Spark task and re-send the partition
        return DeliveryResult.retry(f"{dest.name}: internal error: {type(exc).__name__}: {exc}")


def close_connections() -> None:
    """Close every cached connection of this process (tests; orderly worker shutdown)."""
    POOL.close_all()
