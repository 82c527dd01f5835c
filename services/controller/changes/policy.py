"""An admin's change of the mesh's policy (`mesh policy set approvals N`): how many distinct
operators, none of them its author, approve a held plan before it runs. Kept in the store, so
it holds across takeovers; audited as every change is. Counted as each approval is given
(plans/approvals.py)."""

import logging
from dataclasses import dataclass

import asyncpg

from mesh import wire
from mesh.model import PolicyReply, PolicySetRequest
from mesh.store import policy, seats
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


@dataclass
class PolicyChanges:
    pool: asyncpg.Pool
    epoch: int
    secured: bool  # operators are verified (their names are theirs): persons can be told apart

    async def policy_set(self, req: PolicySetRequest, audit: Audit) -> PolicyReply:
        if req.approvals > 1 and not self.secured:
            raise wire.BadRequest(
                f"approvals: {req.approvals} needs operators the bus verifies, to tell them "
                "apart; this mesh's bus authenticates nobody (mesh init makes one that does)",
                code="bad_request",
            )  # fmt: skip
        async with self.pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self.epoch)
            was = await policy.policy(conn)
            now = await policy.set_approvals(conn, req.approvals, by=audit.who)
            said = f"approvals {now.approvals} (was {was.approvals})"
            await audit.write(conn, subject="approvals", detail=said)
        log.info("policy: a held plan needs %d approval(s) (was %d), set by %s",
                 now.approvals, was.approvals, audit.who)  # fmt: skip
        return PolicyReply(
            approvals=now.approvals, set_by=now.set_by, set_at=now.set_at,
            message=f"a held plan now needs {now.approvals} approval(s) by distinct operators, "
            f"none of them its author (was {was.approvals})",
        )  # fmt: skip
