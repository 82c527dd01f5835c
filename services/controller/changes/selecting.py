"""A module's standing selectors (placement by label, migration 016) as an assign or unassign
by labels alone keeps or drops them; following.py places machines by them."""

import logging

import asyncpg

from mesh import wire
from mesh.model import AssignRequest, ChangeReply
from mesh.store import modules, seats, selectors
from services.controller.plans.recording import replied
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


async def keep(conn: asyncpg.Connection, req: AssignRequest, *, undo: bool) -> bool:
    """The module's standing selector `req.labels` kept (assign) or dropped (unassign); False
    if it already was (or was not there)."""
    if (await modules.current_modules(conn)).get(req.module) is None:
        raise wire.BadRequest(f"module {req.module} has not been pushed", code="not_found")
    if undo:
        return await selectors.forget(conn, module=req.module, labels=req.labels)
    return await selectors.record(conn, module=req.module, labels=req.labels, by=req.by)


async def alone(
    pool: asyncpg.Pool, epoch: int, req: AssignRequest, audit: Audit, *, undo: bool
) -> ChangeReply:
    """A selector that matches no machine now: kept or dropped, no plan."""
    said = ",".join(f"{k}={v}" for k, v in sorted(req.labels.items()))
    async with pool.acquire() as conn, conn.transaction():
        await seats.fence(conn, epoch=epoch)
        changed = await keep(conn, req, undo=undo)
        await audit.write(conn, detail=f"labels {said}: no machine matches now")
    if undo:
        message = (f"{req.module} is no longer placed by labels {said}" if changed
                   else f"{req.module} had no placement by labels {said}")  # fmt: skip
    else:
        message = (f"no machine matches {said} now: {req.module} goes to each machine "
                   "labelled so, as it comes")  # fmt: skip
    log.info("%s: labels %s %s", req.module, said, "dropped" if undo else "kept")
    return replied(plan=None, changed=[], message=message)
