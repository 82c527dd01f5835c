"""Joining a mesh with a token, the client's side (`mesh join TOKEN`, programs/cli/join.py):
the servers' CA found in their TLS handshake and checked against the token's fingerprint before
anything is sent (kubeadm's `--discovery-token-ca-cert-hash`), then the token's `join` request
with the machine's own public key, as the token's bearer. The machine's seed never leaves it.
"""

import hashlib
import socket
import ssl
import tempfile
import time
import urllib.parse
from pathlib import Path

import anyio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from mesh import bus, subjects, wire
from mesh.auth import claims, creds
from mesh.errors import MeshError
from mesh.model import JoinReply, JoinRequest
from mesh.tokens import JoinToken

CONNECT_WITHIN = 5.0  # seconds for one server's handshake
JOIN_WITHIN = 60.0  # seconds for the controller's answer (a takeover on its way is waited out)
_INFO_MOST = 64 * 1024  # bytes of a server's INFO line


class JoinError(MeshError):
    """A join that cannot go on; the message says why and what to do, in one line."""


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None  # mesh.tokens checked it
    return parts.hostname, parts.port


def _presented(url: str) -> list[bytes]:
    """The certificates (DER) a nats-server presents, unverified: what its TLS handshake sends
    (its own, and the CA after it: mesh/auth/tls.py issues them so). NATS speaks first: INFO
    in the clear, then the client starts TLS."""
    host, port = _host_port(url)
    with socket.create_connection((host, port), timeout=CONNECT_WITHIN) as raw:
        raw.settimeout(CONNECT_WITHIN)
        line = b""
        while not line.endswith(b"\r\n"):
            chunk = raw.recv(4096)
            if not chunk or len(line) > _INFO_MOST:
                raise OSError("the server did not say INFO")
            line += chunk
        if not line.startswith(b"INFO "):
            raise OSError("not a NATS server")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # looked at, never trusted: compared below
        with context.wrap_socket(raw, server_hostname=host) as tls:
            chain = (
                tls.get_unverified_chain()  # type: ignore[attr-defined]
                if hasattr(tls, "get_unverified_chain")  # Python 3.13+
                else tls._sslobj.get_unverified_chain()  # type: ignore[union-attr]
            )
    return [c if isinstance(c, bytes) else c.public_bytes(ssl._ssl.ENCODING_DER) for c in chain]  # type: ignore[attr-defined]


def mesh_ca(token: JoinToken) -> str:
    """The mesh's CA certificate (PEM), as its servers present it and the token names it;
    JoinError when no server answers, or none presents that CA (another mesh's token, or
    someone between this machine and the servers)."""
    plaintext = [u for u in token.urls if not u.startswith("tls://")]
    if plaintext:
        raise JoinError(
            f"the token names a server without TLS ({plaintext[0]}): a joining machine checks "
            "the servers' CA against the token before it sends anything, which takes TLS"
        )
    unreachable: list[str] = []
    presented = ""
    for url in token.urls:
        try:
            chain = _presented(url)
        except (OSError, ssl.SSLError, ValueError) as e:
            unreachable.append(f"{url} ({getattr(e, 'strerror', None) or e})")
            continue
        for der in chain:
            if hashlib.sha256(der).hexdigest() == token.ca_sha256:
                cert = x509.load_der_x509_certificate(der)
                return cert.public_bytes(serialization.Encoding.PEM).decode()
        presented = presented or url
    if presented:
        raise JoinError(
            f"the server at {presented} does not present the CA the token names (sha256 "
            f"{token.ca_sha256[:16]}…): a token of another mesh, or someone between this "
            "machine and the mesh; nothing was sent"
        )
    raise JoinError(f"no server of the token answered: {'; '.join(unreachable)}")


async def ask_to_join(
    token: JoinToken, *, ca: Path, machine: str, public: str, within: float = JOIN_WITHIN
) -> JoinReply:
    """The token's `join` request, as its bearer, over TLS checked against `ca`; JoinError with
    the controller's one line when it refuses."""
    if not token.extra:
        raise JoinError(
            "the token carries no credentials to join with: its mesh's controllers had no NATS "
            "signing key when it was made (the secret mesh-nats-signer); make another once "
            "they have"
        )
    try:
        claims.decode(token.extra)
    except claims.ClaimsError:
        raise JoinError("the token's credentials are damaged: copy it again, whole") from None
    with tempfile.TemporaryDirectory(prefix="mesh-join-") as held:
        bearer = Path(held) / "bearer.creds"
        # A bearer JWT: the server asks no signature of it, so any seed signs the nonce.
        creds.write(bearer, who=f"join token {token.id}", seed=claims.new_key("user").seed,
                    inbox=subjects.join_inbox(token.id), jwt=token.extra)  # fmt: skip
        try:
            nc = await bus.connect(",".join(token.urls), name=f"mesh join {machine}",
                                   creds=str(bearer), ca=str(ca), reconnect=False)  # fmt: skip
        except bus.Unauthorized:
            raise JoinError(
                f"the mesh refused the token's credentials: join token {token.id} expired, or "
                "its mesh's signing key changed; ask for another"
            ) from None
        except bus.Unreachable as e:
            raise JoinError(str(e)) from None
        try:
            body = wire.encode(JoinRequest(secret=token.secret, machine=machine, public=public))
            data = await bus.request(nc, subjects.join(token.id, "join"), body,
                                     deadline=time.monotonic() + within,
                                     attempt_timeout=within)  # fmt: skip
            return wire.decode_reply(data, JoinReply)
        except bus.NoAnswer:
            raise JoinError(f"no controller answered within {within:g}s") from None
        except wire.RemoteError as e:
            raise JoinError(str(e)) from None
        finally:
            with anyio.CancelScope(shield=True):
                await bus.close(nc, drain=False)
