"""HTTP sender: one POST per message, `Idempotency-Key: <key>` on every one.

2xx is delivered; 408, 429 and 5xx are retryable, any other status is permanent (the same
request would get the same answer). A FHIR server says why in an OperationOutcome: when the
answer is one, its issues (severity, code, diagnostics or details) are the reason the row keeps
(retry or dead letter) instead of the first bytes of the body. Keep-alive connections are reused through
`spark_jobs.senders.pool` when the response was read to its end.
"""

from __future__ import annotations

import http.client
import json
import ssl
from urllib.parse import urlsplit

from include.destinations_config import HttpDestination
from spark_jobs.senders.client_tls import ssl_context
from spark_jobs.senders.common import DEFAULT_CONTENT_TYPE, DeliveryResult, describe_error, payload_codec, printable
from spark_jobs.senders.pool import POOL, close_quietly, pool_key

__all__ = ["send_http"]

MAX_HTTP_BODY_BYTES = 64 << 10  # read at most this much of a response (only an excerpt is kept)


def send_http(dest: HttpDestination, payload: str, content_type: str, idempotency_key: str) -> DeliveryResult:
    """POST `payload` to the destination's URL; a dropped keep-alive connection is retried once."""
    codec = payload_codec(payload, content_type)
    try:
        body = payload.encode(codec)
    except UnicodeEncodeError as exc:
        return DeliveryResult.permanent(f"{dest.name}: payload cannot be encoded as {codec}: position {exc.start}")
    parts = urlsplit(dest.url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = {
        **dict(dest.headers),
        "Content-Type": content_type or DEFAULT_CONTENT_TYPE,
        "Idempotency-Key": idempotency_key,
        "Content-Length": str(len(body)),
    }
    key = pool_key(dest)
    conn = POOL.take(key, dest.idle_timeout_seconds)
    reused = conn is not None
    while True:
        try:
            if conn is None:
                conn = _http_connect(dest)
            conn.request("POST", target, body=body, headers=headers)
            response = conn.getresponse()
            excerpt = response.read(MAX_HTTP_BODY_BYTES)
            drained = response.isclosed()
            break
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
            close_quietly(conn)
            conn = None
            if reused:  # a keep-alive connection the server had dropped: once more on a fresh one
                reused = False
                continue
            return DeliveryResult.retry(f"{dest.name}: connection lost: {describe_error(exc)}")
        except TimeoutError:  # socket.timeout is TimeoutError
            close_quietly(conn)
            return DeliveryResult.retry(f"{dest.name}: no response within {dest.timeout_seconds:g} s")
        except (OSError, http.client.HTTPException) as exc:
            close_quietly(conn)
            return DeliveryResult.retry(f"{dest.name}: {describe_error(exc)}")
    status = response.status
    if drained and not response.will_close and dest.idle_timeout_seconds > 0:
        POOL.give(key, conn)
    else:
        close_quietly(conn)
    said = f"{dest.name}: HTTP {status} {printable(response.reason)}"
    if 200 <= status < 300:
        return DeliveryResult.success(said)
    said += _body_excerpt(excerpt)
    if status in (408, 429) or status >= 500:
        return DeliveryResult.retry(said)
    return DeliveryResult.permanent(said)


def _http_connect(dest: HttpDestination) -> http.client.HTTPConnection:
    parts = urlsplit(dest.url)
    host = parts.hostname
    assert host is not None  # the config refuses a URL without one
    if parts.scheme == "https":
        context = ssl_context(dest.tls) if dest.tls is not None else ssl.create_default_context()
        return http.client.HTTPSConnection(host, parts.port, timeout=dest.timeout_seconds, context=context)
    return http.client.HTTPConnection(host, parts.port, timeout=dest.timeout_seconds)


def _body_excerpt(body: bytes) -> str:
    outcome = operation_outcome(body)
    text = outcome if outcome is not None else printable(body[:200].decode("utf-8", errors="replace"))
    return f": {text}" if text else ""


MAX_OUTCOME_ISSUES = 5


def operation_outcome(body: bytes) -> str | None:
    """A FHIR OperationOutcome's issues as one line (``OperationOutcome: error invalid: <why>; ...``),
    or None when the body is not one. Only the read excerpt is parsed (a body cut short is not an
    OperationOutcome); anything of the wrong shape is skipped, never trusted."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("resourceType") != "OperationOutcome":
        return None
    issues = doc.get("issue")
    said = []
    for issue in issues[:MAX_OUTCOME_ISSUES] if isinstance(issues, list) else []:
        if not isinstance(issue, dict):
            continue
        details = issue.get("details")
        why = issue.get("diagnostics")
        if not isinstance(why, str) and isinstance(details, dict):
            why = details.get("text")
            codings = details.get("coding")
            if not isinstance(why, str) and isinstance(codings, list) and codings and isinstance(codings[0], dict):
                why = codings[0].get("display") or codings[0].get("code")
        head = " ".join(str(issue.get(k)) for k in ("severity", "code") if isinstance(issue.get(k), str))
        said.append(": ".join(x for x in (head, why if isinstance(why, str) else "") if x))
    return printable("OperationOutcome: " + ("; ".join(said) or "no issues given"))
