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
from dataclasses import dataclass

import anyio

from mesh.model import SteerReply, SteerRequest
from mesh.store import plans
from services.controller.plans.planner import Planner
from services.controller.plans.states import cancelled, found, refused, why_not
from services.controller.plans.writes import PlanWrites
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


@dataclass
class Steering:
    """The verbs that pause, resume and cancel a plan; `one_change` is the catalog's lock
    (changes.Changes): a cancel takes a change back as a change is made, one at a time."""

    writes: PlanWrites  # each move one fenced transaction on the plan, its row locked
    one_change: anyio.Lock
    planner: Planner

    async def pause(self, req: SteerRequest, audit: Audit) -> SteerReply:
        async with self.writes.on(req.id) as w:
            p = found(await w.locked(), req.id)
            if p.state == "paused":
                return await self._told(p, f"plan {p.id} is already paused")
            if p.state not in ("pending", "rolling") or p.phase == "revert":
                raise refused(p, why_not("pause", p))
            await w.plan(state="paused")
            await w.event("plan.paused", by=req.by)
            await audit.write(w.conn, detail="paused")
        p.state = "paused"
        what = "the steps in flight finish, no new machine starts" if p.started else (
            "it will not start"
        )  # fmt: skip
        return await self._told(p, f"plan {p.id} paused: {what} until mesh plan resume {p.id}")

    async def resume(self, req: SteerRequest, audit: Audit) -> SteerReply:
        async with self.writes.on(req.id) as w:
            p = found(await w.locked(), req.id)
            if p.state in ("pending", "rolling") and p.phase == "forward":
                return await self._told(p, f"plan {p.id} is not paused: it is {p.state}")
            if p.state != "paused":
                raise refused(p, why_not("resume", p))
            p.state = "rolling" if p.started else "pending"
            await w.plan(state=p.state)
            await w.event("plan.resumed", by=req.by)
            await audit.write(w.conn, detail="resumed")
        return await self._told(p, f"plan {p.id} resumed: it is {p.state}")

    async def cancel(self, req: SteerRequest, audit: Audit) -> SteerReply:
        async with self.one_change:
            async with self.writes.on(req.id) as w:
                p = found(await w.locked(), req.id)
                if p.phase == "revert" and p.cancel is not None and p.state in plans.OPEN:
                    return await self._told(p, f"plan {p.id} is already being cancelled")
                if p.state not in plans.OPEN or p.phase == "revert":
                    raise refused(p, why_not("cancel", p))
                why = f"cancelled by {req.by or 'an operator'}"
                p.state = await cancelled(w, p, why=why, by=req.by)
                await audit.write(w.conn, detail=f"cancelled ({p.state})")
                p.phase, p.cancel = ("revert" if p.started else p.phase), why
        if p.state == "cancelled":
            return await self._told(p, f"plan {p.id} cancelled: no machine had changed")
        return await self._told(
            p, f"plan {p.id} is being cancelled: no new machine starts, and the machines "
            "already changed get their previous declarations back, tier by tier in reverse",
        )  # fmt: skip

    async def _told(self, p: plans.Plan, message: str) -> SteerReply:
        """The reply; the planner woken to look again, and the plan's followers told."""
        self.planner.wake()
        await self.planner.progress.tell(p.id)
        log.info("%s", message)
        return SteerReply(plan=p.id, state=p.state, message=message, phase=p.phase)
