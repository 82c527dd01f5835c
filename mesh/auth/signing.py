"""What the controllers sign, and every host and controller checks: the seat's announcements
(`held`, `standby`, `handover`, `ready`, `released`) and build requests.

nats-server decides who may publish on a subject, but a message can reach a subscription by
routes it does not check (mesh/origin.py). What a host obeys from the controllers should not
depend on every such route being closed, so the controllers sign it with their identity's nkey
(Ed25519, the seed in `controller.creds`) over the subject and the body, in the header
`Mesh-Signature`; a message signed for one subject is no good on another. Hosts know the
controllers' public key from their credentials file (`# mesh-controller: U…`), controllers from
their own seed. A process without that key (a bus without authentication, where anyone may
publish anyway, or a host's credentials issued before the key was written into them) accepts
unsigned announcements, and says so once at its start.

Replaying a genuine announcement changes nothing: hosts act on a `held` only for an epoch above
the one they know, and a build request is for the one builder it names.
"""

import base64
import binascii
import logging

import msgspec
import nkeys
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import origin, wire
from mesh.auth import creds as credentials
from mesh.auth.keys import public_of
from mesh.model import SeatAnnounce

log = logging.getLogger(__name__)

HEADER = "Mesh-Signature"


def _signed(subject: str, body: bytes) -> bytes:
    return subject.encode() + b"\n" + body


def _raw_public(public: str) -> bytes:
    """The 32 bytes of a user's public nkey ("U…": base32 of prefix, key and CRC16)."""
    try:
        data = base64.b32decode(public + "=" * (-len(public) % 8))
    except (binascii.Error, ValueError):
        raise ValueError(f"{public[:12]}…: not a NATS public key") from None
    if (
        len(data) != 35
        or data[0] != nkeys.PREFIX_BYTE_USER
        or int.from_bytes(data[-2:], "little") != nkeys.crc16(bytearray(data[:-2]))
    ):
        raise ValueError(f"{public[:12]}…: not a NATS user public key")
    return data[1:-2]


class Signing(msgspec.Struct, frozen=True):
    """`seed`: the controllers' seed, to sign with (controllers only). `trusted`: the
    controllers' public key, to check with; None checks nothing."""

    seed: str | None = None
    trusted: str | None = None

    @classmethod
    def controller(cls, creds: str | None) -> "Signing":
        """A controller's: it signs with its identity's seed and trusts its own public key."""
        held = credentials.read(creds) if creds else None
        if held is None or held.seed is None:
            log.info("announcements are not signed: no nkey seed in the credentials (%s)",
                     creds or "none")  # fmt: skip
            return cls()
        return cls(seed=held.seed, trusted=public_of(held.seed))

    @classmethod
    def host(cls, creds: str | None) -> "Signing":
        """A host's: it trusts the controllers' key its credentials file names."""
        held = credentials.read(creds) if creds else None
        if held is not None and held.controller is None:
            log.warning(
                "the credentials %s do not name the controllers' key (issued before it was "
                "written into them): announcements and builds are taken unsigned; issue the "
                "machine's credentials again (mesh machine remove/add) to check them", creds,
            )  # fmt: skip
        return cls(trusted=held.controller if held is not None else None)

    def headers(self, subject: str, body: bytes) -> dict[str, str] | None:
        """The headers that sign `body` for `subject` (None without a seed)."""
        if self.seed is None:
            return None
        pair = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            signature = pair.sign(_signed(subject, body))
        finally:
            pair.wipe()
        return {HEADER: base64.urlsafe_b64encode(signature).decode()}

    async def publish(self, nc: Client, subject: str, body: bytes) -> None:
        await nc.publish(subject, body, headers=self.headers(subject, body))

    def genuine(self, msg: Msg) -> bool:
        """Whether the controllers signed `msg` for its subject (always, with no key to check)."""
        if self.trusted is None:
            return True
        sent = (msg.headers or {}).get(HEADER)
        if not sent:
            return False
        try:
            signature = base64.urlsafe_b64decode(sent)
            key = Ed25519PublicKey.from_public_bytes(_raw_public(self.trusted))
            key.verify(signature, _signed(msg.subject, msg.data))
        except (InvalidSignature, ValueError, binascii.Error):
            return False
        return True

    def announcement(self, msg: Msg, *, subscribed: str) -> SeatAnnounce | None:
        """The seat's announcement `msg` carries, if the controllers signed it and it decodes
        (else None). One not signed is refused as a stray of the subscription to `subscribed`
        (mesh/origin.py); one that does not decode is ignored."""
        if not self.genuine(msg):
            origin.STRAYS.refused(subscribed, msg, "not signed by the controllers")
            return None
        try:
            return wire.decode(msg.data, SeatAnnounce)
        except wire.BadRequest:
            return None
