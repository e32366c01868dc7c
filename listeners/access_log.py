"""Access-log lines that carry no patient identifiers.

Twisted's `Site` writes one line per request to the daemon's log with the whole URI, so
`GET /messages?control_id=MRN-0042` or `GET /messages/MRN-0042` would put an identifier in a log
file that no permission guards. The formatter here writes the request's shape instead: each query
field's name (when it is one the site knows) with its value replaced by `...`, and the path with the
segments that name a message replaced by a placeholder (the caller says which); a path that
matches no route is written as `UNKNOWN_PATH` (a path a client made up may carry anything).

A request refused from its headers alone (401/403/413 before its body) never reaches `Request.finish`,
so Twisted writes no line for it; `log_refused` writes its line, redacted the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from twisted.web.http import Request, _escape

REDACTED = "..."
UNKNOWN_PATH = "/<unknown>"
"""How an access or refusal line shows a path that matches no route."""


def redact_query(query: bytes, known: Collection[str] = ()) -> str:
    """`a=1&b=2` as `a=...&b=...`; a field whose name is not in `known` shows as `...` (a name may be data too)."""
    if not query:
        return ""
    names = []
    for field in query.split(b"&"):
        name = field.partition(b"=")[0].decode("ascii", "replace")
        names.append(f"{name}={REDACTED}" if name in known else REDACTED)
    return "&".join(names)


def redact_uri(uri: bytes, *, path: Callable[[bytes], str] | None = None, known: Collection[str] = ()) -> str:
    """`uri` with its query values (and, through `path`, the path's identifying segments) redacted."""
    raw_path, sep, query = uri.partition(b"?")
    shown = path(raw_path) if path is not None else raw_path.decode("ascii", "replace")
    return shown + ("?" + redact_query(query, known) if sep else "")


def formatter(
    *, path: Callable[[bytes], str] | None = None, known: Collection[str] = ()
) -> Callable[[str, Request], str]:
    """An `IAccessLogFormatter` (Site's `logFormatter`): Twisted's combined format, with the URI
    redacted and no referrer (it may quote a URI of ours)."""

    def line(timestamp: str, request: Request) -> str:
        address: Any = request.getClientAddress()
        ip = getattr(address, "host", "-")
        agent = _escape(request.getHeader(b"user-agent") or b"-")
        uri = redact_uri(request.uri or b"", path=path, known=known)
        return (
            f'"{_escape(ip)}" - - {timestamp} "{_escape(request.method)} {_escape(uri)} '
            f'{_escape(request.clientproto)}" {request.code} {request.sentLength or "-"} "-" "{agent}"'
        )

    return line


def log_refused(request: Request, status: int, sent: int) -> None:
    """The access line of a request answered before Twisted parsed it whole (its body refused from
    its headers): the method, path and protocol come from the channel, which has read them."""
    channel = request.channel
    request.method = getattr(channel, "_command", None) or b"-"
    request.uri = getattr(channel, "_path", None) or b"-"
    request.clientproto = getattr(channel, "_version", None) or b"-"
    request.code = status
    request.sentLength = sent
    site = getattr(channel, "site", None)
    if site is not None:
        site.log(request)
