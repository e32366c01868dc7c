"""Client TLS contexts for the senders, built once per worker process from `TlsSettings`.

An `SSLContext` does not pickle into Spark, so the config carries plain settings and each worker
builds (and caches) its own context.
"""

from __future__ import annotations

import ssl
import threading

from include.destinations_config import TlsSettings

__all__ = ["ssl_context"]

_TLS_CONTEXTS: dict[TlsSettings, ssl.SSLContext] = {}
_TLS_LOCK = threading.Lock()


def ssl_context(settings: TlsSettings) -> ssl.SSLContext:
    """The cached context for `settings` (CA, client certificate, `verify`)."""
    with _TLS_LOCK:
        context = _TLS_CONTEXTS.get(settings)
        if context is None:
            context = ssl.create_default_context(cafile=settings.ca_file)
            if not settings.verify:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if settings.cert_file:
                context.load_cert_chain(settings.cert_file, settings.key_file)
            _TLS_CONTEXTS[settings] = context
        return context
