"""The mesh's own certificate authority and the certificates of its nats-servers.

Every connection to the mesh's NATS is TLS: `mesh dev up` and `mesh init` make a CA once (its key
0600 beside the credentials, never leaving the folder), a certificate per nats-server naming the
addresses clients and the other servers reach it at, and give every client the CA's certificate
(`MESH_CA`, and inside each credentials file). Identities are still nkeys: TLS here is the
encryption and the server's proof of who it is, not the client's.

Server certificates carry both serverAuth and clientAuth, because a server is a TLS client of
the others on its cluster routes, which verify each other against the same CA.
"""

import datetime
import ipaddress
import os
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh.errors import MeshError
from mesh.paths import write_private

CA_DAYS = 3650
SERVER_DAYS = 825  # what browsers accept at most; rotation: `mesh cert rotate` (docs/security.md)


class TlsError(MeshError):
    """A CA or certificate that cannot be read or used; the message names the file."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


_CA_USAGE = x509.KeyUsage(
    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
    key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
    decipher_only=False,
)  # fmt: skip


def ensure_ca(folder: Path, *, name: str = "mesh") -> Path:
    """The CA in `folder` (ca.pem, and ca.key mode 0600), made if missing. Returns ca.pem."""
    cert_path, key_path = folder / "ca.pem", folder / "ca.key"
    if cert_path.exists() and key_path.exists():
        return cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def _load_ca(folder: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
    except OSError as e:
        raise TlsError(f"the mesh's CA in {folder}: {e.strerror or e}") from None
    except ValueError as e:
        raise TlsError(f"the mesh's CA in {folder}: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TlsError(f"the mesh's CA in {folder}: ca.key is not an EC key")
    return cert, key


def issue_server(
    ca_folder: Path, cert_path: Path, key_path: Path, *, name: str, hosts: list[str],
    days: int = SERVER_DAYS,
) -> None:  # fmt: skip
    """A certificate for the server `name`, valid for `hosts` (IP addresses or DNS names),
    signed by the CA in `ca_folder`; a new key each time (rotation is issuing again)."""
    ca_cert, ca_key = _load_ca(ca_folder)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_private(key_path, _key_pem(key))
    # The CA after the server's own: a server presents both, so a machine that has only the CA's
    # fingerprint (a join token's) can find the CA in the handshake and check it by that.
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM)
                  + ca_cert.public_bytes(serialization.Encoding.PEM))  # fmt: skip


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether `ca` signed `cert` (a server certificate left from before the CA changed: no)."""
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def current(cert_path: Path, ca_path: Path, *, hosts: list[str] | None = None) -> bool:
    """The certificate in `cert_path` exists and was signed by the CA in `ca_path` (and, with
    `hosts`, names each of them: a folder made again with other addresses gets new ones)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
    except (OSError, ValueError):
        return False
    return issued_by(cert, ca) and set(hosts or ()) <= set(names(cert))


def names(cert: x509.Certificate) -> list[str]:
    """The IP addresses and DNS names a certificate is valid for (its subjectAltName)."""
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(entry.value) for entry in alt if isinstance(entry, x509.IPAddress | x509.DNSName)]


def serial(cert_path: Path) -> int:
    """The serial number of the certificate in `cert_path` (which one a server presents)."""
    return x509.load_pem_x509_certificate(cert_path.read_bytes()).serial_number


def client_context(*, cafile: str | None = None, cadata: str | None = None) -> ssl.SSLContext:
    """A client's TLS context that trusts the mesh's CA alone (not the system's CAs) and checks
    the server's name or address against its certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cafile=cafile, cadata=cadata)
    except (OSError, ssl.SSLError) as e:
        where = cafile or "the CA in the credentials file"
        raise TlsError(f"CA {where}: {getattr(e, 'strerror', None) or e}") from None
    return context
