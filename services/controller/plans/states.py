"""A plan's states as the verbs that steer it read and move them (steering.py, approvals.py)
and a newer change cancels them (recording.py): the words a refusal says, and a cancel, in the
caller's fenced transaction with the plan's row locked."""

import logging
from datetime import UTC, datetime

from mesh import wire
from mesh.model import PlanState
from mesh.store import plans
from services.controller.plans.writes import OnePlan

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


async def cancelled(w: OnePlan, p: plans.Plan, *, why: str, by: str) -> PlanState:
    """Cancel `p` (its row locked by the caller, in the caller's fenced transaction): at once
    if it has not started, else by asking the planner to revert it. Its catalog change is
    taken back now. Its state now."""
    if p.state in _IN_THE_CATALOG:
        log.info("plan %d: %s", p.id, await w.undo(p))
    if p.started is None:
        await w.plan(state="cancelled", finished=datetime.now(UTC), cancel=why)
        await w.event("plan.cancelled", by=by, cancel=why)
        return "cancelled"
    # A soak in progress ends with the cancel: its plan is reverting, not waiting on it.
    await w.plan(state="rolling", phase="revert", cancel=why, soak_until=None)
    await w.event("plan.cancelling", by=by, cancel=why)
    return "rolling"


def why_not_approved(p: plans.Plan) -> str:
    """Why `approve` does nothing to `p`, a plan not held."""
    if p.state in plans.OPEN and p.hold is not None and p.hold.approved_by is not None:
        return f"it was approved already, by {p.hold.approved_by}"
    if p.state in plans.OPEN:
        return "it was not held: nothing to approve"
    return "nothing to approve"


def why_not(verb: str, p: plans.Plan) -> str:
    """Why `verb` does nothing to `p`, after its state."""
    if p.state in plans.ENDED:
        return f"nothing to {verb}"
    if verb == "reject":
        return f"only a held plan is rejected; cancel it instead (mesh plan cancel {p.id})"
    if p.state == "held":
        return f"approve it first (mesh plan approve {p.id}), or cancel it"
    if p.state == "building":
        return f"its bundles are being built; {verb} it once it is pending"
    if p.phase == "revert":
        return "a revert runs to its end"
    return f"nothing to {verb}"
