"""Server TLS: clear errors for bad files, TLS >= 1.2, and mTLS refusing foreign or absent client certs.

A throwaway PKI (a CA, a server cert for localhost/127.0.0.1, a client cert from that CA, and a
rogue CA with its own client cert; EC P-256 so it is fast) is written to a temp dir once per
class. Handshake tests serve the real API on loopback and connect with Agent.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from OpenSSL import SSL
from twisted.internet import defer
from twisted.internet.ssl import Certificate, PrivateCertificate, TLSVersion, optionsForClientTLS
from twisted.python.failure import Failure
from twisted.trial import unittest
from twisted.web.client import ResponseFailed, ResponseNeverReceived
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from listeners.api import ApiAuth, ApiSettings, make_api
from listeners.connections_config import ConnectionConfigError, TLSConfig
from listeners.server_tls import TLSConfigError, server_tls_options
from tests.listeners.test_api import ENV, TOKENS_CONFIG, VIEWER_TOKEN, agent, fetch, node_state, serve

# --- a throwaway PKI ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    dir: Path
    ca: Path  # the CA trusted for server and client certs
    server_cert: Path  # CN/SAN localhost + 127.0.0.1, signed by ca
    server_key: Path
    client: Path  # cert + key, signed by ca
    rogue_ca: Path
    rogue_client: Path  # cert + key, signed by rogue_ca
    rogue_key: Path  # a key that does not match server_cert

    def tls(self, *, mtls: bool = False) -> TLSConfig:
        return TLSConfig(
            cert=str(self.server_cert), key=str(self.server_key), ca=str(self.ca), require_client_cert=mtls
        )


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, Any] | None,
    *,
    ca: bool = False,
    san: list[x509.GeneralName] | None = None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    issuer_name, issuer_key = (issuer[0].subject, issuer[1]) if issuer else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - day)
        .not_valid_after(now + day)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(*items: Any) -> bytes:
    out = b""
    for item in items:
        if isinstance(item, x509.Certificate):
            out += item.public_bytes(serialization.Encoding.PEM)
        else:
            out += item.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
    return out


def make_pki(directory: Path) -> PKI:
    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    ca_key, rogue_ca_key, server_key, client_key, rogue_client_key = key(), key(), key(), key(), key()
    ca = _issue("Stageline Test CA", ca_key, None, ca=True)
    rogue_ca = _issue("Rogue CA", rogue_ca_key, None, ca=True)
    server = _issue(
        "localhost",
        server_key,
        (ca, ca_key),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client = _issue("console", client_key, (ca, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = _issue("console", rogue_client_key, (rogue_ca, rogue_ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    files = {
        "ca.pem": _pem(ca),
        "server.pem": _pem(server),
        "server.key": _pem(server_key),
        "client.pem": _pem(client, client_key),
        "rogue-ca.pem": _pem(rogue_ca),
        "rogue-client.pem": _pem(rogue, rogue_client_key),
        "rogue.key": _pem(key()),
    }
    for name, data in files.items():
        (directory / name).write_bytes(data)
    d = directory
    return PKI(
        d,
        d / "ca.pem",
        d / "server.pem",
        d / "server.key",
        d / "client.pem",
        d / "rogue-ca.pem",
        d / "rogue-client.pem",
        d / "rogue.key",
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="class")
def pki_on_class(request: pytest.FixtureRequest, pki: PKI) -> None:
    request.cls.pki = pki


# --- loading: clear errors naming the file --------------------------------------------------------------


def test_options_load_a_valid_cert_and_key(pki: PKI) -> None:
    server_tls_options(pki.tls())
    server_tls_options(pki.tls(mtls=True))


def test_options_refuse_protocols_below_tls_1_2(pki: PKI) -> None:
    options = server_tls_options(pki.tls()).getContext().set_options(0)  # returns the current option mask
    assert options & SSL.OP_NO_TLSv1 and options & SSL.OP_NO_TLSv1_1
    assert not options & SSL.OP_NO_TLSv1_2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: {"cert": str(p.dir / "missing.pem")}, r"tls.cert .*missing.pem: cannot read it \(No such file"),
        (lambda p: {"key": str(p.dir / "missing.key")}, r"tls.key .*missing.key: cannot read it"),
        (lambda p: {"cert": str(p.server_key)}, r"tls.cert .*server.key: not a PEM certificate file"),
        (lambda p: {"key": str(p.server_cert)}, r"tls.key .*server.pem: not a PEM private key"),
        (
            lambda p: {"key": str(p.rogue_key)},
            r"tls.key .*rogue.key does not match the certificate in tls.cert "
            r".*server.pem",
        ),
        (lambda p: {"cert": ""}, r"tls.cert is not set"),
        (lambda p: {"ca": "", "require_client_cert": True}, r"require_client_cert needs tls.ca"),
        (lambda p: {"ca": str(p.server_key), "require_client_cert": True}, r"tls.ca .*server.key: not a PEM cert"),
    ],
)
def test_options_name_the_bad_file(pki: PKI, change: Any, message: str) -> None:
    tls = TLSConfig(**{**pki.tls().__dict__, **change(pki)})
    with pytest.raises(TLSConfigError, match=message):
        server_tls_options(tls)


def test_options_refuse_an_encrypted_key(pki: PKI, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(TLSConfigError, match=r"tls.key .*encrypted.key: the key is encrypted"):
        server_tls_options(TLSConfig(cert=str(pki.server_cert), key=str(encrypted)))


def test_tls_config_errors_are_config_errors() -> None:
    assert issubclass(TLSConfigError, ConnectionConfigError)  # the daemon reports both the same way


def test_api_settings_tls_paths_load_from_the_config_dir(pki: PKI) -> None:
    settings = ApiSettings.from_config(
        {
            "host": "0.0.0.0",
            "tls": {"cert": "server.pem", "key": "server.key", "ca": "ca.pem", "require_client_cert": True},
        },
        pki.dir,
    )
    assert settings.tls is not None
    server_tls_options(settings.tls)


# --- handshakes over loopback ----------------------------------------------------------------------------


@implementer(IPolicyForHTTPS)
class _Client:
    """Connects to 127.0.0.1 but verifies the server as `localhost` against `trust`."""

    def __init__(self, trust: Path, cert: Path | None = None, **extra: Any) -> None:
        self._trust = Certificate.loadPEM(trust.read_bytes())
        self._cert = PrivateCertificate.loadPEM(cert.read_bytes()) if cert else None
        self._extra = extra

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return optionsForClientTLS(
            "localhost",
            trustRoot=self._trust,
            clientCertificate=self._cert,
            extraCertificateOptions=self._extra or None,
        )


def _tls_errors(failure: Failure) -> list[str]:
    """The OpenSSL errors behind a failed request (Agent wraps them in ResponseNeverReceived/Failed)."""
    reasons = failure.value.reasons if failure.check(ResponseNeverReceived, ResponseFailed) else [failure]
    return [str(r.value) for r in reasons if r.check(SSL.Error)]


@pytest.mark.usefixtures("pki_on_class")
# Twisted's client side (optionsForClientTLS with a client certificate) still hands pyOpenSSL its own
# X509/PKey types; the server side (listeners.server_tls) passes cryptography objects and warns about nothing.
@pytest.mark.filterwarnings("ignore:Passing pyOpenSSL (X509|PKey) objects is deprecated:DeprecationWarning")
class TLSHandshakeTests(unittest.TestCase):
    pki: PKI

    def start(self, *, mtls: bool = False) -> str:
        site = make_api(node_state(), ApiAuth.from_config(TOKENS_CONFIG, ENV))
        return f"https://127.0.0.1:{serve(self, site, tls=self.pki.tls(mtls=mtls))}"

    async def refused(self, url: str, policy: _Client | None) -> list[str]:
        client = agent(self, contextFactory=policy) if policy else agent(self)
        try:
            response, _ = await fetch(client, url, token=VIEWER_TOKEN)
        except Exception:
            return _tls_errors(Failure())
        self.fail(f"expected the connection to be refused, got HTTP {response.code}")

    @defer.inlineCallbacks
    def test_https_api_is_reachable_verifying_the_server_against_the_ca(self):
        base = self.start()
        client = agent(self, contextFactory=_Client(self.pki.ca))
        response, body = yield defer.ensureDeferred(fetch(client, f"{base}/cluster/status", token=VIEWER_TOKEN))
        self.assertEqual(response.code, 200)
        self.assertIn(b'"role": "single-node"', body)

    @defer.inlineCallbacks
    def test_a_client_trusting_another_ca_refuses_the_server(self):
        base = self.start()
        errors = yield defer.ensureDeferred(self.refused(f"{base}/health", _Client(self.pki.rogue_ca)))
        self.assertTrue(any("certificate verify failed" in e for e in errors), errors)

    @defer.inlineCallbacks
    def test_a_plaintext_client_gets_no_answer_from_a_tls_port(self):
        base = self.start()
        yield defer.ensureDeferred(self.refused(base.replace("https:", "http:") + "/health", None))

    @defer.inlineCallbacks
    def test_a_tls_1_2_only_client_is_served(self):
        base = self.start()
        client = agent(self, contextFactory=_Client(self.pki.ca, lowerMaximumSecurityTo=TLSVersion.TLSv1_2))
        response, _ = yield defer.ensureDeferred(fetch(client, f"{base}/health"))
        self.assertEqual(response.code, 200)

    @defer.inlineCallbacks
    def test_mtls_serves_a_client_with_a_certificate_from_the_ca(self):
        base = self.start(mtls=True)
        client = agent(self, contextFactory=_Client(self.pki.ca, self.pki.client))
        response, body = yield defer.ensureDeferred(fetch(client, f"{base}/cluster/nodes", token=VIEWER_TOKEN))
        self.assertEqual(response.code, 200)
        self.assertIn(b'"leader_node_id": "host:1234:ab12cd34"', body)

    @defer.inlineCallbacks
    def test_mtls_refuses_a_client_without_a_certificate_at_the_handshake(self):
        base = self.start(mtls=True)
        errors = yield defer.ensureDeferred(self.refused(f"{base}/health", _Client(self.pki.ca)))
        self.assertTrue(any("certificate required" in e or "handshake failure" in e for e in errors), errors)

    @defer.inlineCallbacks
    def test_mtls_refuses_a_client_certificate_from_another_ca_at_the_handshake(self):
        base = self.start(mtls=True)
        rogue = _Client(self.pki.ca, self.pki.rogue_client)
        errors = yield defer.ensureDeferred(self.refused(f"{base}/health", rogue))
        self.assertTrue(any("unknown ca" in e for e in errors), errors)
