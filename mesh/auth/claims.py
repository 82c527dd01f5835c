"""NATS JWTs (decentralized authentication, JWT v2): the operator's, each account's and each
user's claims, signed with nkeys, as nats-server reads them (github.com/nats-io/jwt, v2).

Why JWTs: a user's JWT is signed by its account (or a signing key the account names), and
nats-server trusts every signature of a key it knows. Admitting a machine is then signing its
public key, on whatever machine holds the signing key, with no server's configuration changed;
revoking one is a new account JWT with the user in its revocations, which the servers'
built-in `full` resolver spreads across the cluster (docs/security.md, identities).

A JWT is `header.payload.signature`, each base64url without padding: the header says
`{"typ":"JWT","alg":"ed25519-nkey"}`, the payload is the claims (JSON), the signature the
issuer's Ed25519 signature over `header.payload`. The claims' `jti` is the base32 of the
SHA-512/256 of the claims without it, as nats-io/jwt computes it.
"""

import base64
import hashlib
import json
import os
import time
from typing import Any, Literal

import msgspec
import nkeys
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
VERSION = 2
NO_LIMIT = -1

KeyKind = Literal["operator", "account", "user"]
_PREFIX = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}


class ClaimsError(ValueError):
    """A JWT that is not one, or not signed by whom it says."""


class Key(msgspec.Struct, frozen=True):
    """An nkey: its seed (`SO…`, `SA…`, `SU…`: whoever has it signs as it) and public key."""

    seed: str
    public: str

    def sign(self, data: bytes) -> bytes:
        pair = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            return pair.sign(data)
        finally:
            pair.wipe()


def new_key(kind: KeyKind) -> Key:
    seed = nkeys.encode_seed(os.urandom(32), _PREFIX[kind]).decode()
    return key_of(seed)


def key_of(seed: str) -> Key:
    """The key of a seed; ValueError for anything that is not one."""
    try:
        pair = nkeys.from_seed(bytearray(seed.strip().encode()))
    except Exception as e:  # nkeys raises its own errors, and binascii's, for a bad seed
        raise ValueError(f"not an nkey seed ({type(e).__name__})") from None
    try:
        return Key(seed=seed.strip(), public=pair.public_key.decode())
    finally:
        pair.wipe()


def _verifier(public: str) -> Ed25519PublicKey:
    """A public nkey (`O…`, `A…`, `U…`: a prefix byte, the Ed25519 key, a CRC-16) as a key that
    verifies; ValueError for anything that is not one."""
    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35 or raw[0] not in _PREFIX.values():
        raise ValueError(f"{public[:8]}…: not a public nkey")
    return Ed25519PublicKey.from_public_bytes(raw[1:33])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _jti(claims: dict[str, Any]) -> str:
    body = json.dumps(claims, separators=(",", ":")).encode()
    digest = hashlib.new("sha512_256", body).digest()
    return base64.b32encode(digest).decode().rstrip("=")


def encode(
    *, issuer: Key, subject: str, name: str, nats: dict[str, Any], expires: int | None = None
) -> str:
    """A JWT of `nats` claims about `subject`, signed by `issuer`."""
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public, "name": name,
                              "sub": subject}  # fmt: skip
    if expires is not None:
        claims["exp"] = int(expires)
    claims["jti"] = _jti(claims)
    claims["nats"] = {**nats, "version": VERSION}
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signed = f"{head}.{body}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def decode(token: str) -> dict[str, Any]:
    """The claims of a JWT whose signature is its issuer's; ClaimsError otherwise."""
    try:
        head, body, signature = token.strip().split(".")
        claims = json.loads(_unb64(body))
        _verifier(claims["iss"]).verify(_unb64(signature), f"{head}.{body}".encode())
    except (ValueError, KeyError, TypeError, InvalidSignature) as e:
        raise ClaimsError(f"not a JWT signed by its issuer ({type(e).__name__})") from None
    if not isinstance(claims, dict):
        raise ClaimsError("not a JWT: its claims are not an object")
    return claims


# --- the three kinds of claims ---------------------------------------------------------------


def operator(key: Key, *, name: str, system_account: str, signing_keys: list[str]) -> str:
    """The operator: self-signed; every account JWT a server trusts is signed by it."""
    nats = {"type": "operator", "system_account": system_account,
            "signing_keys": signing_keys}  # fmt: skip
    return encode(issuer=key, subject=key.public, name=name, nats=nats)


def account(
    operator_key: Key, *, subject: str, name: str, signing_keys: list[str],
    jetstream: bool, revocations: dict[str, int] | None = None,
) -> str:  # fmt: skip
    """An account: its users are those signed by its own key or one of `signing_keys`;
    `revocations` (user public key -> a time) refuses their JWTs issued at or before it."""
    limits: dict[str, Any] = {
        "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
        "imports": NO_LIMIT, "exports": NO_LIMIT, "wildcards": True,
        "conn": NO_LIMIT, "leaf": NO_LIMIT,
    }  # fmt: skip
    if jetstream:  # without these, the account has no JetStream at all
        limits |= {"mem_storage": NO_LIMIT, "disk_storage": NO_LIMIT, "streams": NO_LIMIT,
                   "consumer": NO_LIMIT}  # fmt: skip
    nats: dict[str, Any] = {"type": "account", "limits": limits, "signing_keys": signing_keys,
                            "default_permissions": {"pub": {}, "sub": {}}}  # fmt: skip
    if revocations:
        nats["revocations"] = dict(sorted(revocations.items()))
    return encode(issuer=operator_key, subject=subject, name=name, nats=nats)


def user(
    signer: Key, *, account_public: str, subject: str, name: str, publish: list[str],
    subscribe: list[str], responses: bool = False, bearer: bool = False,
    expires: int | None = None,
) -> str:  # fmt: skip
    """A user of the account `account_public`, signed by `signer` (the account's key or one of
    its signing keys), allowed to publish and subscribe to those subjects alone; `responses`:
    may answer a request it received (one reply, as `allow_responses: true`)."""
    nats: dict[str, Any] = {
        "type": "user",
        "pub": {"allow": publish} if publish else {},
        "sub": {"allow": subscribe} if subscribe else {},
        "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
    }  # fmt: skip
    if not publish:  # nothing allowed: an empty allow list would allow everything
        nats["pub"] = {"deny": [">"]}
    if not subscribe:
        nats["sub"] = {"deny": [">"]}
    if responses:
        nats["resp"] = {"max": 1, "ttl": 0}
    if bearer:
        nats["bearer_token"] = True
    if signer.public != account_public:
        nats["issuer_account"] = account_public
    return encode(issuer=signer, subject=subject, name=name, nats=nats, expires=expires)
