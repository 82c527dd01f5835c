"""Join tokens as text: what `mesh token create` prints and `mesh join` is given, one line a
person copies from one machine to another.

    mesh1-<id>.<secret>.<ca>.<servers>[.<extra>]

- `mesh1-`: the format's version; a later format says `mesh2-`, and a reader of this one
  refuses it by name rather than misreading it;
- `id`: 12 lowercase hex digits, the token's name in the store (`mesh token list`, `revoke`);
  not a secret;
- `secret`: 43 characters of base64url (32 random bytes); the store keeps only its SHA-256;
- `ca`: 64 lowercase hex digits, the SHA-256 of the mesh's CA certificate (DER: what `openssl
  x509 -fingerprint -sha256` prints, without colons): a new machine trusts the servers whose
  certificates that CA issued, before it has anything else of the mesh;
- `servers`: the NATS URLs, comma-separated, as unpadded base64url (no character a shell or a
  chat window would take for something else: IPv6's brackets, commas);
- `extra`: optional, an opaque text for `mesh join` (a bearer credential), as unpadded base64url.

Every part is in the alphabet `A-Z a-z 0-9 - _` and parts are split by dots, so the whole is one
word for a shell and a double-click. A malformed token is refused in one line naming what is
wrong with it, never echoing its secret.
"""

import base64
import binascii
import hashlib
import re
import secrets
import urllib.parse
from typing import Any

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from mesh.errors import MeshError

VERSION = "mesh1"
MAX_TOKEN = 4096  # characters: a token with a dozen servers and an extra part fits with room
_ID = re.compile(r"[0-9a-f]{12}")
_SECRET = re.compile(r"[A-Za-z0-9_-]{43}")
_CA = re.compile(r"[0-9a-f]{64}")
_ALPHABET = re.compile(r"[A-Za-z0-9._-]*")
_PREFIX = re.compile(r"mesh(\d+)-")
SCHEMES = ("nats", "tls")


class TokenError(MeshError, ValueError):
    """A join token that cannot be read or made; the message says what is wrong, in one line,
    never with the token's secret."""


class JoinToken(msgspec.Struct, frozen=True):
    urls: list[str]  # the NATS servers a new machine connects to
    ca_sha256: str  # the SHA-256 of the mesh's CA certificate (DER), lowercase hex
    id: str
    secret: str
    extra: str | None = None  # opaque, for `mesh join` (a bearer credential), if it needs one

    def __repr__(self) -> str:  # a token in a log or a traceback keeps its secret
        return f"JoinToken(id={self.id!r}, urls={self.urls!r}, ca_sha256={self.ca_sha256!r}, …)"

    def __rich_repr__(self) -> Any:
        yield "id", self.id
        yield "urls", self.urls

    def encode(self) -> str:
        """The token as one line; TokenError if a field could not be read back."""
        if any("," in url for url in self.urls):  # the servers' separator
            raise TokenError("join token: a server's URL holds a comma")
        parts = [self.id, self.secret, self.ca_sha256, _b64(",".join(self.urls))]
        if self.extra is not None:
            parts.append(_b64(self.extra))
        text = f"{VERSION}-" + ".".join(parts)
        decode(text)  # each field checked as a reader checks it: what is made can be read
        return text


def decode(text: str) -> JoinToken:
    """The token in `text` (spaces around it, as pasted, are ignored); TokenError naming what
    is wrong otherwise."""
    text = text.strip()
    if not text:
        raise TokenError("join token: it is empty (`mesh token create` prints one)")
    if len(text) > MAX_TOKEN:
        raise TokenError(f"join token: {len(text)} characters, more than one has ({MAX_TOKEN})")
    bad = _ALPHABET.match(text)
    if bad is not None and bad.end() < len(text):
        raise TokenError(
            f"join token: character {bad.end() + 1} ({text[bad.end()]!r}) is not one a join "
            "token has (letters, digits, '-', '_', '.'): copy it again, whole"
        )
    prefix = _PREFIX.match(text)
    if prefix is None:
        raise TokenError(f"join token: it does not start with {VERSION}- "
                         "(`mesh token create` prints one)")  # fmt: skip
    if prefix.group(0) != f"{VERSION}-":
        raise TokenError(
            f"join token: it is of version mesh{prefix.group(1)}, and this mesh reads {VERSION} "
            "(a newer mesh made it: upgrade this one)"
        )
    parts = text[prefix.end() :].split(".")
    if len(parts) not in (4, 5):
        raise TokenError(
            f"join token: {len(parts)} parts after {VERSION}-, where a join token has 4 or 5 "
            "(ID.SECRET.CA.SERVERS[.EXTRA]): was it cut when copied?"
        )
    token_id, secret, ca, servers = parts[:4]
    _check(token_id, secret, ca)
    urls = _urls(_unb64(servers, what="its servers are"))
    extra = _unb64(parts[4], what="its extra part is") if len(parts) == 5 else None
    return JoinToken(urls=urls, ca_sha256=ca, id=token_id, secret=secret, extra=extra)


def _check(token_id: str, secret: str, ca: str) -> None:
    if not _ID.fullmatch(token_id):
        raise TokenError(f"join token: its id {token_id[:24]!r} is not 12 lowercase hex digits")
    if not _SECRET.fullmatch(secret):  # its length alone is said: never the secret
        raise TokenError(f"join token: its secret is {len(secret)} characters, not 43 of base64url")
    if not _CA.fullmatch(ca):
        raise TokenError(
            f"join token: its CA fingerprint {ca[:24]!r} is not 64 lowercase hex digits (SHA-256)"
        )


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


def _unb64(part: str, *, what: str) -> str:
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode()
    except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
        raise TokenError(f"join token: {what} not base64url of text") from None


def _urls(text: str) -> list[str]:
    urls = text.split(",")
    if not text or not all(urls):
        raise TokenError("join token: it names no server (or an empty one)")
    for url in urls:
        check_url(url)
    return urls


def check_url(url: str) -> str:
    """A server a token may name: nats:// or tls://, a host and a port, no user or password
    (a token is handed around; a password in it would be too)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is not None and (parts.username is not None or parts.password is not None):
        raise TokenError(
            f"join token: server {parts.scheme}://…@{parts.hostname}: a token names servers "
            "without a user or password"
        )
    if (
        parts is None
        or parts.scheme not in SCHEMES
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise TokenError(
            f"join token: server {url[:80]!r} is not nats://HOST:PORT or tls://HOST:PORT"
        )
    return url


def new_secret() -> str:
    """A token's secret: 32 random bytes, as 43 characters of base64url."""
    return secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    """What the store keeps of a secret: its SHA-256, hex. A plain hash is enough for 256
    random bits (nothing to guess); a slow one would only slow every join."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def ca_sha256(pem: str, *, where: str) -> str:
    """The SHA-256 of the one CA certificate in `pem` (DER), lowercase hex; TokenError naming
    `where` (the file it came from) if it holds none, or several (a token names one CA)."""
    try:
        certs = x509.load_pem_x509_certificates(pem.encode())
    except ValueError:
        raise TokenError(f"the mesh's CA ({where}): not a PEM certificate") from None
    if len(certs) != 1:
        raise TokenError(
            f"the mesh's CA ({where}) holds {len(certs)} certificates: name the one the "
            "servers' certificates are issued from with --ca"
        )
    der = certs[0].public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(der).hexdigest()
