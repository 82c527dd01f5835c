"""Held changes and their approval (docs/operations.md, Steering a change).

A held change is recorded but not made: its plan (`held`) keeps the steps a dry run of the
change found (what it would change, in a savepoint rolled back) and, in `hold`, the change
to make (a push's stored version, an assign's machines). So nothing composes it meanwhile:
no machine gets it, whatever plan rolls before its approval. Approving makes the change in
the catalog, as the push or assign would have, composes its machines again from the catalog
as it is then, and puts the plan in the queue (`pending`). A newer change of the same module
(push, assign, unassign) supersedes the module's held and paused plans: they are cancelled
(a paused one reverts first), naming the plan that superseded them.
"""

import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from mesh import wire
from mesh.model import (
    AssignRequest,
    PlanBuild,
    PlanSettings,
    PlanState,
    PushRequest,
    SteerReply,
    SteerRequest,
)
from mesh.modules import gate
from mesh.modules.manifest import Manifest
from mesh.store import events, modules, plans
from services.controller.catalog.pushing import register, settings_of
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import Manifests
from services.controller.plans import states
from services.controller.plans.planner import Planner
from services.controller.plans.recording import Recorder
from services.controller.plans.writes import OnePlan, PlanWrites
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


class HeldChanges:
    def __init__(
        self, *, pool: asyncpg.Pool, epoch: int, fleet: Fleet, manifests: Manifests,
        recorder: Recorder, planner: Planner,
    ) -> None:  # fmt: skip
        self._pool = pool
        self._epoch = epoch
        self._fleet = fleet
        self._manifests = manifests
        self._rec = recorder
        self._planner = planner  # told of a plan approved, for its followers

    async def hold_push(
        self,
        conn: asyncpg.Connection,
        manifest: Manifest,
        req: PushRequest,
        bundles: dict[str, str],
        *,
        builds: list[PlanBuild],
        building: int | None,
        audit: Audit,
    ) -> tuple[int | None, list[str]]:
        """A held push: the version stored (not current) and its plan `held`."""
        name = manifest.module.name
        async with _tried(conn):
            targets = await register(
                conn, fleet=self._fleet, manifest=manifest, text=req.manifest,
                version=req.source, bundles=bundles, by=req.by,
            )  # fmt: skip
            steps = await self._rec.steps(conn, targets)
        version = await modules.keep_version(
            conn, module=name, version=req.source, manifest=req.manifest, bundles=bundles,
            by=req.by, note=req.note,
        )  # fmt: skip
        recorded = await self._rec.plan(
            conn, targets, trigger="push", subject=name, by=req.by,
            settings=settings_of(manifest), undo={"module": name}, builds=builds,
            building=building, hold=plans.HeldPush(module=name, version=version), steps=steps,
            audit=audit,
        )  # fmt: skip
        await events.record(conn, "plan.held", epoch=self._epoch, plan=recorded[0], by=req.by)
        return recorded

    async def hold_assign(
        self,
        conn: asyncpg.Connection,
        req: AssignRequest,
        machines: list[str],
        *,
        trigger: str,
        settings: PlanSettings,
        audit: Audit,
    ) -> tuple[int | None, list[str]]:
        """A held assign or unassign: its plan `held`, the machines kept for its approval."""
        held = (plans.HeldUnassign if trigger == "unassign" else plans.HeldAssign)(
            module=req.module, machines=machines
        )
        async with _tried(conn):
            await modules.reassign(conn, req.module, machines, undo=trigger == "unassign")
            steps = await self._rec.steps(conn, machines)
        recorded = await self._rec.plan(
            conn, machines, trigger=trigger, subject=req.module, by=req.by, settings=settings,
            undo={"module": req.module}, hold=held, steps=steps, audit=audit,
        )  # fmt: skip
        await events.record(conn, "plan.held", epoch=self._epoch, plan=recorded[0], by=req.by)
        return recorded

    async def approve(self, req: SteerRequest, audit: Audit) -> SteerReply:
        """Make a held plan's change and put it in the queue (`pending`); with no machine to
        change by now, it ends `done`. A conflict the catalog has come to since refuses the
        approval (the plan stays held)."""
        stale: str | None = None
        async with self._rec.one_change:
            async with PlanWrites(pool=self._pool, epoch=self._epoch).on(req.id) as w:
                p = states.found(await w.locked(), req.id)
                if p.state != "held" or p.hold is None:
                    raise states.refused(p, states.why_not_approved(p))
                if req.digest is not None:
                    stale = await self._moved(w.conn, p, req.digest)
                if stale is None:
                    steps, state = await self._approve(w, p, req, audit)
        if stale is not None:  # its steps are recorded as they are now: reviewed again, then
            raise wire.BadRequest(
                f"plan {req.id} now does {stale}, not {req.digest}: the catalog changed under "
                f"it since it was reviewed; review it again (mesh plan {req.id} --changes) and "
                f"approve with --digest {stale}", code="conflict",
            )  # fmt: skip
        self._rec.wake()
        await self._planner.tell(p.id)
        log.info("plan %d approved by %s: %d machine(s)", p.id, req.by or "?", len(steps))
        what = f"it changes {len(steps)} machine(s)" if steps else "no machine changes now"
        done = plans.digest_of((s.tier, s.machine, s.after) for s in steps)
        return SteerReply(plan=p.id, state=state,
                          message=f"plan {p.id} approved ({done}): {what}")  # fmt: skip

    async def _approve(
        self, w: OnePlan, p: plans.Plan, req: SteerRequest, audit: Audit
    ) -> tuple[list[plans.Step], PlanState]:
        """The held change made, and the plan queued (or done, with nothing to change)."""
        assert p.hold is not None
        targets, undo, settings = await self._make(w.conn, p)
        steps = await self._rec.steps(w.conn, targets)
        hold = msgspec.structs.replace(p.hold, approved_by=req.by)
        await w.approved(steps, settings=settings, undo=undo, hold=hold)
        state: PlanState = "pending"
        if not steps:
            state = "done"
            await w.plan(state=state, finished=datetime.now(UTC))
        await w.event("plan.approved", by=req.by, machines=len(steps))
        await audit.write(w.conn, detail=f"plan {p.id} {state}")
        return steps, state

    async def _moved(self, conn: asyncpg.Connection, p: plans.Plan, digest: str) -> str | None:
        """None if the held change, made now, does what `digest` says; else what it does now,
        with its steps recorded so (the change itself tried, not kept)."""
        async with _tried(conn):
            targets, _, _ = await self._make(conn, p)
            steps = await self._rec.steps(conn, targets)
        now = plans.digest_of((s.tier, s.machine, s.after) for s in steps)
        if now == digest:
            return None
        await plans.replace_steps(conn, p.id, steps)
        return now

    async def _make(
        self, conn: asyncpg.Connection, p: plans.Plan
    ) -> tuple[list[str], dict[str, Any], PlanSettings]:
        """A held plan's change, made in the catalog: its machines, its undo, its settings."""
        module = p.subject
        current = (await modules.current_modules(conn)).get(module)
        match p.hold:
            case plans.HeldPush(version=version):
                v = await modules.version_of(conn, version)
                manifest = gate.parse(v.manifest)
                targets = await register(
                    conn, fleet=self._fleet, manifest=manifest, text=v.manifest,
                    version=v.version, bundles=v.bundles, by=v.pushed_by,
                )  # fmt: skip
                now = (await modules.current_modules(conn))[module]
                undo = {"module": module, "from": current.id if current else None, "to": now.id}
                if current is not None and current.id == now.id:
                    undo["to"] = None  # it was current already: nothing to take back
                return targets, undo, settings_of(manifest)
            case plans.HeldAssign(machines=held) | plans.HeldUnassign(machines=held):
                if current is None:
                    raise wire.BadRequest(
                        f"module {module} is no longer registered: plan {p.id} cannot be "
                        f"approved (cancel it: mesh plan cancel {p.id})", code="conflict",
                    )  # fmt: skip
                machines = [m for m in held if m in self._fleet.machines]
                taken = isinstance(p.hold, plans.HeldUnassign)
                moved = await modules.reassign(conn, module, machines, undo=taken)
                return (
                    machines,
                    {"module": module, "machines": moved},
                    settings_of(self._manifests.of(current)),
                )
        raise AssertionError(f"plan {p.id}: nothing held")  # approve checked it holds one


def held_said(plan: int | None, changed: list[str]) -> str:
    return (f"plan {plan} is held: it would change {len(changed)} machine(s); nothing changes "
            f"until mesh plan approve {plan}")  # fmt: skip


@contextlib.asynccontextmanager
async def _tried(conn: asyncpg.Connection) -> AsyncIterator[None]:
    """A savepoint rolled back at the end: the change made inside is tried, never kept."""
    savepoint = conn.transaction()
    await savepoint.start()
    try:
        yield
    finally:
        await savepoint.rollback()
