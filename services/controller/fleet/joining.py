"""A machine joining the mesh with a token (`mesh join TOKEN`, docs/operations.md): asked on
mesh.join.<token id>.join with the token's bearer credentials, which only that token's holder
has (services/controller/fleet/admission.py), so the token is the one nats-server let it use.

In one fenced transaction: the token redeemed (its secret checked, a use taken, the use
audited: services/controller/fleet/tokens.py), the name checked free, the machine placed (its tier
and labels, before it first registers, as `mesh tier` and `mesh label` place one) and its key
recorded (`mesh machine remove` revokes it: `Joins.forget`). Then its credentials' JWT is
signed for the key it made. A machine that asks again with the same name, key and token (its
answer was lost) is answered again without another use; any other asking for a name taken is
refused, saying what to do. A refusal is audited on its own, after the transaction rolled back.
"""

import hmac
import logging
from dataclasses import dataclass

import asyncpg
import msgspec

from mesh import subjects, wire
from mesh.model import Grant, JoinedKeyReply, JoinedKeyRequest, JoinReply, JoinRequest
from mesh.serving import Parts
from mesh.store import joined, machines, seats
from mesh.store import tokens as stored_tokens
from mesh.tokens import secret_hash
from services.controller.fleet import tokens
from services.controller.fleet.admission import Admission
from services.controller.fleet.fleet import Fleet
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


@dataclass
class Joins:
    """The machines that join with a token, and the keys they joined with; `admission` signs
    their credentials (None where the controllers cannot sign: nobody may join)."""

    pool: asyncpg.Pool
    epoch: int
    fleet: Fleet
    admission: Admission | None

    async def join(self, token_id: str, req: JoinRequest) -> JoinReply:
        admission = self.admission
        if admission is None:
            raise wire.BadRequest(
                "this mesh's controllers have no NATS signing key (the secret mesh-nats-signer, "
                "or MESH_NATS_SIGNER_FILE): no machine can join until an admin gives it "
                "(docs/operations.md, Join tokens)",
                code="unavailable",
            )
        who = f"join:{req.machine}"
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self.epoch)
                grant, again = await _admit(conn, token_id, req, fleet=self.fleet, who=who,
                                            epoch=self.epoch)  # fmt: skip
        except wire.BadRequest as e:
            await tokens.refused(self.pool, token_id=token_id, by=who, error=e, epoch=self.epoch)
            raise
        log.info("machine %s %s with token %s: tier %d, labels %s", req.machine,
                 "asked again for its credentials" if again else "joined", token_id, grant.tier,
                 grant.labels)  # fmt: skip
        return JoinReply(
            machine=req.machine, jwt=admission.machine_jwt(req.machine, req.public),
            controller=admission.controller, tier=grant.tier, labels=grant.labels,
            control=grant.control, site=grant.site, again=again,
        )  # fmt: skip

    async def forget(self, req: JoinedKeyRequest, audit: Audit) -> JoinedKeyReply:
        """`mesh machine remove` of a machine that joined: its key, forgotten here, for the
        command to revoke where the mesh's folder is (an admin's)."""
        async with self.pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self.epoch)
            public = await joined.forget(conn, req.machine)
            if public is None:
                raise wire.BadRequest(f"machine {req.machine} did not join with a token",
                                      code="not_found")  # fmt: skip
            await audit.write(conn, subject=req.machine, detail="its key forgotten, to revoke")
        return JoinedKeyReply(machine=req.machine, public=public)


class Joining(msgspec.Struct, frozen=True):
    """A join request's caller: the joins, and the token its subject names."""

    joins: Joins
    token_id: str


def joining(parts: Parts, subject: str) -> Joining:
    token_id = subjects.join_token(subject)
    if not tokens.is_id(token_id):
        raise wire.BadRequest(f"token: {token_id[:24]!r} is not a join token's id")
    return Joining(joins=parts.of(Joins), token_id=token_id)


async def join(j: Joining, req: JoinRequest) -> JoinReply:
    """The `join` endpoint's handler: the token is the subject's, the rest the body's."""
    return await j.joins.join(j.token_id, req)


async def _admit(
    conn: asyncpg.Connection, token_id: str, req: JoinRequest, *, fleet: Fleet, who: str,
    epoch: int,
) -> tuple[Grant, bool]:  # fmt: skip
    """The grant, and whether this is the same machine asking again."""
    prior = await joined.get(conn, req.machine)
    if prior is not None:
        if prior.public == req.public and prior.token_id == token_id:
            row = await stored_tokens.locked(conn, token_id)
            if row is not None and hmac.compare_digest(
                row.secret_sha256, bytes.fromhex(secret_hash(req.secret))
            ):
                return prior.grant, True
        raise wire.BadRequest(
            f"machine {req.machine} has joined already, with another key or token: remove it "
            f"on the mesh first (`mesh machine remove {req.machine}`), or join under another "
            "--name",
            code="conflict",
        )
    registered = req.machine in fleet.machines
    if registered or await machines.placement(conn, req.machine) is not None:
        raise wire.BadRequest(
            f"machine {req.machine}: the name is taken (the mesh has a machine of that name): "
            "join under another --name",
            code="conflict",
        )
    grant = await tokens.redeem(conn, token_id=token_id, secret=req.secret,
                                machine=req.machine, by=who, epoch=epoch)  # fmt: skip
    await machines.place(conn, name=req.machine, tier=grant.tier, labels=grant.labels)
    await joined.record(conn, name=req.machine, public=req.public, token_id=token_id,
                        grant=grant)  # fmt: skip
    return grant, False
