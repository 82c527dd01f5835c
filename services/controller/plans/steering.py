"""The operator's hand on a plan: pausing, resuming and cancelling it (the verbs
`plan-pause`, `plan-resume`, `plan-cancel`; docs/operations.md, Steering a change). Holding a
change and approving it are catalog changes, in changes/modules.py and approvals.py.

Each move is one fenced transaction with the plan's row locked (`plans.locked`); the planner
takes the same lock where it moves a plan itself (starting it, pausing it after a tier,
ending it), so a verb and the planner never both act on what the other has not seen. A verb
only writes the store and wakes the planner, which reads the plan again at its next look:

- `pause`: the plan's state becomes `paused`; the planner sends no new machine its
  declaration (the steps in flight finish, a soak goes on) and does not end it;
- `resume`: `rolling` again (`pending` if it had not started), and it goes on;
- `cancel`: a plan that has not started (held, building, pending, paused before its turn)
  ends `cancelled` at once; one that has started gets `cancel` (why) and the phase `revert`:
  the planner starts no new machine and gives the changed ones their previous declarations
  back, tier by tier in reverse, as after a failure, and ends it `cancelled`. Either way its
  catalog change is taken back at once, so a change recorded from then on composes without
  it (a newer change of the same module stands: `modules.undo`).

The plan's state, `cancel`, and the planner's own marks (the soak's end, the tier it paused
after) live in the store, so each holds across a handover and a takeover.
"""

import logging
from datetime import UTC, datetime

import anyio
import asyncpg

from mesh import wire
from mesh.model import PlanState, SteerReply, SteerRequest
from mesh.store import events, modules, plans, seats
from services.controller.plans.planner import Planner
from services.controller.trust import operators

log = logging.getLogger(__name__)

# A plan whose change is in the catalog (the ones held wait for their approval to make it).
_IN_THE_CATALOG: tuple[PlanState, ...] = ("pending", "rolling", "paused")


def said(p: plans.Plan) -> str:
    """A plan's state in the words a refusal names it with."""
    if p.state == "rolling" and p.phase == "revert":
        return "being cancelled" if p.cancel else "reverting after a failure"
    return p.state


def found(p: plans.Plan | None, plan_id: int) -> plans.Plan:
    if p is None:
        raise wire.BadRequest(f"plan {plan_id} does not exist", code="not_found")
    return p


def refused(p: plans.Plan, why: str) -> wire.BadRequest:
    """One line naming the plan's state: `plan 7 is done: nothing to pause`."""
    return wire.BadRequest(f"plan {p.id} is {said(p)}: {why}", code="conflict")


async def cancelled(
    conn: asyncpg.Connection, p: plans.Plan, *, why: str, epoch: int, by: str
) -> PlanState:
    """Cancel `p` (its row locked by the caller, in the caller's fenced transaction): at once
    if it has not started, else by asking the planner to revert it. Its catalog change is
    taken back now. Its state now."""
    if p.state in _IN_THE_CATALOG:
        log.info("plan %d: %s", p.id, await modules.undo(conn, p.trigger, p.undo, plan_id=p.id))
    if p.started is None:
        now = datetime.now(UTC)
        await plans.set_plan(conn, p.id, state="cancelled", finished=now, cancel=why)
        await events.record(conn, "plan.cancelled", epoch=epoch, plan=p.id, by=by, cancel=why)
        return "cancelled"
    # A soak in progress ends with the cancel: its plan is reverting, not waiting on it.
    await plans.set_plan(conn, p.id, state="rolling", phase="revert", cancel=why, soak_until=None)
    await events.record(conn, "plan.cancelling", epoch=epoch, plan=p.id, by=by, cancel=why)
    return "rolling"


class Steering:
    """The verbs that pause, resume and cancel a plan; `one_change` is the catalog's lock
    (changes.Changes): a cancel takes a change back as a change is made, one at a time."""

    def __init__(
        self, *, pool: asyncpg.Pool, epoch: int, one_change: anyio.Lock, planner: Planner
    ) -> None:
        self._pool = pool
        self._epoch = epoch
        self._one_change = one_change
        self._planner = planner

    async def pause(self, req: SteerRequest) -> SteerReply:
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            p = found(await plans.locked(conn, req.id), req.id)
            if p.state == "paused":
                return await self._told(p, f"plan {p.id} is already paused")
            if p.state not in ("pending", "rolling") or p.phase == "revert":
                raise refused(p, _why_not("pause", p))
            await plans.set_plan(conn, p.id, state="paused")
            await events.record(conn, "plan.paused", epoch=self._epoch, plan=p.id, by=req.by)
            await operators.audited(conn, detail="paused")
        p.state = "paused"
        what = "the steps in flight finish, no new machine starts" if p.started else (
            "it will not start"
        )  # fmt: skip
        return await self._told(p, f"plan {p.id} paused: {what} until mesh plan resume {p.id}")

    async def resume(self, req: SteerRequest) -> SteerReply:
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            p = found(await plans.locked(conn, req.id), req.id)
            if p.state in ("pending", "rolling") and p.phase == "forward":
                return await self._told(p, f"plan {p.id} is not paused: it is {p.state}")
            if p.state != "paused":
                raise refused(p, _why_not("resume", p))
            p.state = "rolling" if p.started else "pending"
            await plans.set_plan(conn, p.id, state=p.state)
            await events.record(conn, "plan.resumed", epoch=self._epoch, plan=p.id, by=req.by)
            await operators.audited(conn, detail="resumed")
        return await self._told(p, f"plan {p.id} resumed: it is {p.state}")

    async def cancel(self, req: SteerRequest) -> SteerReply:
        async with self._one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                p = found(await plans.locked(conn, req.id), req.id)
                if p.phase == "revert" and p.cancel is not None and p.state in plans.OPEN:
                    return await self._told(p, f"plan {p.id} is already being cancelled")
                if p.state not in plans.OPEN or p.phase == "revert":
                    raise refused(p, _why_not("cancel", p))
                why = f"cancelled by {req.by or 'an operator'}"
                p.state = await cancelled(conn, p, why=why, epoch=self._epoch, by=req.by)
                await operators.audited(conn, detail=f"cancelled ({p.state})")
                p.phase, p.cancel = ("revert" if p.started else p.phase), why
        if p.state == "cancelled":
            return await self._told(p, f"plan {p.id} cancelled: no machine had changed")
        return await self._told(
            p, f"plan {p.id} is being cancelled: no new machine starts, and the machines "
            "already changed get their previous declarations back, tier by tier in reverse",
        )  # fmt: skip

    async def _told(self, p: plans.Plan, message: str) -> SteerReply:
        """The reply; the planner woken to look again, and the plan's followers told."""
        self._planner.wake()
        await self._planner.tell(p.id)
        log.info("%s", message)
        return SteerReply(plan=p.id, state=p.state, message=message, phase=p.phase)


def why_not_approved(p: plans.Plan) -> str:
    """Why `approve` does nothing to `p`, a plan not held."""
    if p.state in plans.OPEN and p.hold is not None and "approved_by" in p.hold:
        return f"it was approved already, by {p.hold['approved_by'] or 'an operator'}"
    if p.state in plans.OPEN:
        return "it was not held: nothing to approve"
    return "nothing to approve"


def _why_not(verb: str, p: plans.Plan) -> str:
    """Why `verb` does nothing to `p`, after its state."""
    if p.state in ("done", "failed", "reverted", "cancelled"):
        return f"nothing to {verb}"
    if p.state == "held":
        return f"approve it first (mesh plan approve {p.id}), or cancel it"
    if p.state == "building":
        return f"its bundles are being built; {verb} it once it is pending"
    if p.phase == "revert":
        return "a revert runs to its end"
    return f"nothing to {verb}"
