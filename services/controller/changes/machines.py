"""An operator's changes of a machine: its tier and labels (`mesh tier`, `mesh label`), and
draining it out of every plan and back (`mesh drain`, `mesh undrain`): a drained machine keeps
what it runs and every plan skips it; undrained, a plan brings it up to date when what the
catalog composes for it differs from what it has.
"""

from dataclasses import dataclass

import asyncpg
from nats.aio.client import Client

from mesh.model import (
    DrainReply,
    DrainRequest,
    LabelReply,
    LabelRequest,
    MachineChanged,
    PlanSettings,
    TierReply,
    TierRequest,
)
from mesh.store import modules
from services.controller.catalog.pushing import settings_of
from services.controller.fleet.fleet import Fleet, tell_changed
from services.controller.fleet.placing import Placing
from services.controller.fleet.publishing import Manifests
from services.controller.plans.recording import Recorder
from services.controller.trust.audit import Audit


@dataclass
class Machines:
    nc: Client
    fleet: Fleet
    placing: Placing
    manifests: Manifests
    recorder: Recorder

    async def tier(self, req: TierRequest, audit: Audit) -> TierReply:
        was, registered = await self.placing.set_tier(req.machine, req.tier, audit)
        return TierReply(machine=req.machine, tier=req.tier, was=was, registered=registered)

    async def label(self, req: LabelRequest, audit: Audit) -> LabelReply:
        labels, was, registered = await self.placing.set_labels(
            req.machine, add=req.set, remove=req.remove, audit=audit
        )
        return LabelReply(machine=req.machine, labels=labels, was=was, registered=registered)

    async def drain(self, req: DrainRequest, audit: Audit) -> DrainReply:
        return await self._drain(req, audit, undo=False)

    async def undrain(self, req: DrainRequest, audit: Audit) -> DrainReply:
        return await self._drain(req, audit, undo=True)

    async def _drain(self, req: DrainRequest, audit: Audit, *, undo: bool) -> DrainReply:
        """Drain a machine (every plan skips it; it keeps what it runs), or undrain it: then a
        plan brings it up to date if what the catalog composes for it differs from what it
        has (or will have once the plans already recorded finish)."""
        name = req.machine

        async def up_to_date(conn: asyncpg.Connection) -> int | None:
            if not undo:
                await audit.write(conn, detail="drained")
                return None
            plan, _ = await self.recorder.plan(
                conn, [name], trigger="undrain", subject=name, by=req.by,
                settings=await self._settings_of_machine(conn, name), undo={}, audit=audit,
            )  # fmt: skip
            return plan

        async with self.recorder.one_change:
            was, plan = await self.placing.set_drained(
                name, drained=not undo, by=req.by, then=up_to_date
            )
        if undo and plan is None:
            self.fleet.wants_what_it_is_sent(name)  # nothing left to bring it
        self.recorder.wake()
        await tell_changed(self.nc, MachineChanged(machine=name, drained=not undo))
        if undo:
            message = f"machine {name} undrained" + (
                f": plan {plan} brings it up to date" if plan is not None else ": it is up to date"
            )
        else:
            message = (f"machine {name} drained: every plan skips it, and it keeps what it runs "
                       f"until `mesh undrain {name}`")  # fmt: skip
        if was == (not undo):
            message += f" (it already was {'drained' if was else 'undrained'})"
        return DrainReply(machine=name, drained=not undo, was=was, message=message, plan=plan)

    async def _settings_of_machine(self, conn: asyncpg.Connection, machine: str) -> PlanSettings:
        """An undrain's plan: as patient as the most patient module on the machine, reverting
        only if every one of them would."""
        current = await modules.current_modules(conn)
        mine = sorted((await modules.assignments(conn)).get(machine, ()))
        manifests = [settings_of(self.manifests.of(current[m])) for m in mine if m in current]
        if not manifests:
            return PlanSettings()
        return PlanSettings(
            deadline=max(s.deadline for s in manifests),
            auto_revert=all(s.auto_revert for s in manifests),
        )
