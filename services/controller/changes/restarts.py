"""`mesh restart MODULE [MACHINE...]`: a plan that changes no declaration and restarts the
module's processes (and tool servers) on each machine that runs it, tier by tier, through the
same health gates, canaries and soak as any plan (plans/planner.py sends each machine's step as
restarts, not a declaration). A failure stops it; there is nothing to revert. It can be held,
paused and cancelled like any plan.
"""

import logging
from dataclasses import dataclass

import asyncpg

from mesh import wire
from mesh.model import ChangeReply, RestartPlanRequest
from mesh.store import events, modules, plans, seats
from services.controller.catalog.pushing import settings_of
from services.controller.fleet.publishing import Manifests
from services.controller.plans.recording import Recorder, replied
from services.controller.plans.rollout import restart_settings
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


async def targets(conn: asyncpg.Connection, module: str, named: list[str]) -> list[str]:
    """The machines whose processes of `module` a restart restarts: those named (each must
    run it), or every machine it is assigned to."""
    running = await modules.machines_of(conn, module)
    missing = sorted(set(named) - set(running))
    if missing:
        one = len(missing) == 1
        raise wire.BadRequest(
            f"machines: {'machine' if one else 'machines'} {', '.join(missing[:5])} "
            f"{'does' if one else 'do'} not run module {module}", code="not_found",
        )  # fmt: skip
    if not running:
        raise wire.BadRequest(f"module {module} is assigned to no machine", code="not_found")
    return sorted(named) if named else running


@dataclass
class Restarts:
    pool: asyncpg.Pool
    epoch: int
    recorder: Recorder
    manifests: Manifests

    async def restart(self, req: RestartPlanRequest, audit: Audit) -> ChangeReply:
        async with self.recorder.one_change:
            async with self.pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self.epoch)
                current = (await modules.current_modules(conn)).get(req.module)
                if current is None:
                    raise wire.BadRequest(
                        f"module {req.module} has not been pushed", code="not_found"
                    )
                machines = await targets(conn, req.module, req.machines)
                hold = plans.HeldRestart(module=req.module, machines=machines) if req.hold else None
                plan, changed = await self.recorder.plan(
                    conn, machines, trigger="restart", subject=req.module, by=req.by,
                    settings=restart_settings(settings_of(self.manifests.of(current))), undo={},
                    steps=await self.recorder.restart_steps(conn, machines), hold=hold,
                    audit=audit,
                )  # fmt: skip
                if hold is not None:
                    await events.record(conn, "plan.held", epoch=self.epoch, plan=plan, by=req.by)
        self.recorder.wake()
        log.info("restart of %s on %d machine(s): plan %s%s", req.module, len(changed), plan,
                 " (held)" if req.hold else "")  # fmt: skip
        if req.hold:
            return replied(
                plan=plan, changed=changed, state="held",
                message=f"plan {plan} is held: it would restart module {req.module} on "
                f"{len(changed)} machine(s); nothing restarts until mesh plan approve {plan}",
            )  # fmt: skip
        return replied(
            plan=plan, changed=changed, state="pending",
            message=f"plan {plan} restarts module {req.module} on {len(changed)} machine(s), "
            "tier by tier",
        )  # fmt: skip
