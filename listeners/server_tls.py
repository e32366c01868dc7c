"""Server-side TLS for every socket `listenerd` binds (MLLP, TCP, HTTP inbound and the API).

One place decides what "TLS" means here: PEM cert (optionally followed by its chain) and key, TLS 1.2
or newer, and with `require_client_cert` mutual TLS against `tls.ca` — a client without a
certificate, or with one from another CA, is refused during the handshake, before any byte of
application data is read. Files are loaded and checked eagerly so a bad path or a key that does not
match its certificate stops the daemon at start with the file named, not at the first connection.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from OpenSSL import SSL, crypto
from twisted.internet.interfaces import IListeningPort, IProtocolFactory
from twisted.internet.ssl import Certificate, CertificateOptions, TLSVersion, trustRootFromCertificates
from twisted.protocols.tls import TLSMemoryBIOFactory

from listeners.connections_config import ConnectionConfigError, TLSConfig

MINIMUM_TLS_VERSION = TLSVersion.TLSv1_2


class TLSConfigError(ConnectionConfigError):
    """A TLS file is missing, unreadable, not PEM, or the key does not match the certificate."""


def server_tls_options(tls: TLSConfig) -> CertificateOptions:
    """Build the server context for `tls`; raises TLSConfigError naming the offending file.

    `tls.ca` is read only with `require_client_cert`: optional client certificates would be verified
    but identify nobody, so there is no half-way mode.
    """
    chain = _certificates(tls.cert, "cert")
    key = _private_key(tls.key)
    if _spki(key.public_key()) != _spki(chain[0].public_key()):
        raise TLSConfigError(f"tls.key {tls.key} does not match the certificate in tls.cert {tls.cert}")
    trust: dict[str, Any] = {}
    if tls.require_client_cert:
        if not tls.ca:
            raise TLSConfigError("tls.require_client_cert needs tls.ca (the client CA bundle)")
        cas = [Certificate(crypto.X509.from_cryptography(c)) for c in _certificates(tls.ca, "ca")]
        # A trustRoot makes Twisted set VERIFY_PEER | VERIFY_FAIL_IF_NO_PEER_CERT: mTLS.
        trust["trustRoot"] = trustRootFromCertificates(cas)
    options = CertificateOptions(  # pyOpenSSL takes cryptography objects (its own types are deprecated)
        privateKey=key,  # type: ignore[arg-type]
        certificate=chain[0],  # type: ignore[arg-type]
        extraCertChain=chain[1:],  # type: ignore[arg-type]
        raiseMinimumTo=MINIMUM_TLS_VERSION,
        **trust,
    )
    try:
        options.getContext()  # build now: OpenSSL's own objections surface at start, not per connection
    except SSL.Error as exc:
        raise TLSConfigError(f"tls.cert {tls.cert} / tls.key {tls.key}: OpenSSL refused them: {exc}") from exc
    return options


def listen(
    reactor: Any,
    host: str,
    port: int,
    factory: IProtocolFactory,
    tls: TLSConfig | None,
    *,
    backlog: int = 4096,
    guard: Callable[[IProtocolFactory, bool], IProtocolFactory] | None = None,
) -> IListeningPort:
    """Bind `factory` on host:port, with TLS when `tls` is given (`reactor`: IReactorTCP).

    `guard(factory, tls)` wraps the (TLS) factory from outside, so it sees every connection before
    any handshake and can refuse it cheaply (`listeners.guard`). The accept backlog is long (the
    kernel caps it at net.core.somaxconn): under a flood of connects a short one overflows, and an
    honest sender's SYN is dropped and only retried a second later.
    """
    if tls is not None:
        factory = TLSMemoryBIOFactory(server_tls_options(tls), False, factory)
    if guard is not None:
        factory = guard(factory, tls is not None)
    listening: IListeningPort = reactor.listenTCP(port, factory, backlog=backlog, interface=host)
    return listening


def _read(path: str, what: str) -> bytes:
    if not path:
        raise TLSConfigError(f"tls.{what} is not set")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"tls.{what} {path}: cannot read it ({exc.strerror or exc})") from exc


def _certificates(path: str, what: str) -> list[x509.Certificate]:
    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise TLSConfigError(f"tls.{what} {path}: not a PEM certificate file") from exc
    if not certs:
        raise TLSConfigError(f"tls.{what} {path}: holds no certificate")
    return certs


def _private_key(path: str) -> PrivateKeyTypes:
    data = _read(path, "key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as exc:  # encrypted: there is nowhere safe to keep its passphrase
        raise TLSConfigError(
            f"tls.key {path}: the key is encrypted; give an unencrypted key (protect it with file permissions)"
        ) from exc
    except (ValueError, crypto.Error) as exc:
        raise TLSConfigError(f"tls.key {path}: not a PEM private key") from exc
    return key


def _spki(public_key: Any) -> bytes:
    der: bytes = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der
