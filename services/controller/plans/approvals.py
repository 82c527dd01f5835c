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
from typing import Any, NamedTuple

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
from mesh.store import events, modules, plans, policy
from services.controller.catalog.pushing import register, settings_of
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import Manifests
from services.controller.plans import rollout, states
from services.controller.plans.planner import Planner
from services.controller.plans.recording import Recorder
from services.controller.plans.writes import OnePlan, PlanWrites
from services.controller.trust.audit import ANONYMOUS, Audit

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
        """One operator's approval of a held plan, bound to what the plan does now. With as
        many as the policy asks (`mesh policy`: distinct operators, never its author), its
        change is made and the plan queued (`pending`); with no machine to change by now, it
        ends `done`. An approval given before the catalog moved under the plan is void. A
        conflict the catalog has come to since refuses it (the plan stays held)."""
        stale: str | None = None
        async with self._rec.one_change:
            async with PlanWrites(pool=self._pool, epoch=self._epoch).on(req.id) as w:
                p = states.found(await w.locked(), req.id)
                if p.state != "held" or p.hold is None:
                    raise states.refused(p, states.why_not_approved(p))
                _not_its_author(p, req.by)
                now = await self._doing_now(w.conn, p)
                if req.digest is not None and req.digest != now:
                    stale = now  # its steps are recorded as they are now, for the next review
                else:
                    counted = await self._count(w, p, req, now, audit)
        if stale is not None:
            raise wire.BadRequest(
                f"plan {req.id} now does {stale}, not {req.digest}: the catalog changed under "
                f"it since it was reviewed; review it again (mesh plan {req.id} --changes) and "
                f"approve with --digest {stale}", code="conflict",
            )  # fmt: skip
        await self._planner.progress.tell(p.id)
        message = f"plan {p.id} approved by {req.by or '?'} ({now}"
        if counted.waiting:
            log.info("plan %d: approval %d of %d, by %s", p.id, counted.given, counted.needed,
                     req.by or "?")  # fmt: skip
            message += (f"; {counted.given} of {counted.needed}): it stays held until "
                        f"{counted.needed - counted.given} more operator(s) approve it, "
                        "none of them its author")  # fmt: skip
        else:
            self._rec.wake()
            log.info("plan %d approved by %s: %d machine(s)", p.id, req.by or "?",
                     len(counted.steps))  # fmt: skip
            what = (f"it changes {len(counted.steps)} machine(s)" if counted.steps
                    else "no machine changes now")  # fmt: skip
            message += f"): {what}"
        if counted.void:
            message += (f"; {counted.void} approval(s) given before are void: the plan "
                        "changed since")  # fmt: skip
        return SteerReply(plan=p.id, state=counted.state, message=message)

    async def _count(
        self, w: OnePlan, p: plans.Plan, req: SteerRequest, now: str, audit: Audit
    ) -> "_Counted":
        """This approval counted with those given for what the plan does now; the change made
        once there are as many as the policy asks."""
        assert p.hold is not None
        valid = [a for a in p.hold.approvals if a.digest == now]
        for a in valid:
            if a.by == req.by:
                raise wire.BadRequest(
                    f"plan {p.id}: {req.by} approved it already "
                    f"({a.at.isoformat(timespec='seconds')}); another operator approves it",
                    code="conflict",
                )  # fmt: skip
        mine = plans.Approval(by=req.by, at=datetime.now(UTC), digest=now)
        hold = msgspec.structs.replace(p.hold, approvals=[*p.hold.approvals, mine])
        needed = (await policy.policy(w.conn)).approvals
        given, void = len(valid) + 1, len(p.hold.approvals) - len(valid)
        if given < needed:
            await w.hold(hold)
            await w.event("plan.approval", by=req.by, given=given, needed=needed, digest=now)
            await audit.write(w.conn, detail=f"plan {p.id} approval {given} of {needed}")
            return _Counted("held", [], given, needed, void, waiting=True)
        steps, state = await self._approve(w, p, req, audit, hold=hold)
        return _Counted(state, steps, given, needed, void, waiting=False)

    async def reject(self, req: SteerRequest, audit: Audit) -> SteerReply:
        """End a held plan `rejected`: nothing changes (its change was never made; a push's
        stored version stays in the history, never current)."""
        async with PlanWrites(pool=self._pool, epoch=self._epoch).on(req.id) as w:
            p = states.found(await w.locked(), req.id)
            if p.state != "held":
                raise states.refused(p, states.why_not("reject", p))
            why = f"rejected by {req.by or 'an operator'}" + (f": {req.reason}" if req.reason
                                                               else "")  # fmt: skip
            await w.plan(state="rejected", finished=datetime.now(UTC), cancel=why)
            await w.event("plan.rejected", by=req.by, reason=req.reason or None)
            await audit.write(w.conn, detail=f"plan {p.id} rejected"
                              + (f": {req.reason}" if req.reason else ""))  # fmt: skip
        await self._planner.progress.tell(p.id)
        log.info("plan %d %s", p.id, why)
        return SteerReply(plan=p.id, state="rejected",
                          message=f"plan {p.id} {why}: no machine changed")  # fmt: skip

    async def _approve(
        self, w: OnePlan, p: plans.Plan, req: SteerRequest, audit: Audit, *, hold: plans.Held
    ) -> tuple[list[plans.Step], PlanState]:
        """The held change made, and the plan queued (or done, with nothing to change)."""
        targets, undo, settings = await self._make(w.conn, p)
        steps = await self._steps(w.conn, p, targets)
        hold = msgspec.structs.replace(hold, approved_by=req.by)
        await w.approved(steps, settings=settings, undo=undo, hold=hold)
        state: PlanState = "pending"
        if not steps:
            state = "done"
            await w.plan(state=state, finished=datetime.now(UTC))
        await w.event("plan.approved", by=req.by, machines=len(steps))
        await audit.write(w.conn, detail=f"plan {p.id} {state}")
        return steps, state

    async def _doing_now(self, conn: asyncpg.Connection, p: plans.Plan) -> str:
        """What the held change, made now, does (its digest); its steps recorded so when that
        moved since they were (the change itself tried, not kept)."""
        async with _tried(conn):
            targets, _, _ = await self._make(conn, p)
            steps = await self._steps(conn, p, targets)
        now = plans.digest_of((s.tier, s.machine, s.after) for s in steps)
        if now != await plans.step_digest(conn, p.id):
            await plans.replace_steps(conn, p.id, steps)
        return now

    async def recompose(self, conn: asyncpg.Connection, machines: list[str], *, by: int) -> None:
        """A change (plan `by`) moved these machines' declarations: each held plan with a step
        on one of them is composed again, in the change's transaction, and a new digest makes
        the approvals given so far void (`plan` shows them so; they count for nothing)."""
        for p in await plans.held_on(conn, machines):
            if p.id == by or p.hold is None:
                continue
            was = await plans.step_digest(conn, p.id)
            try:
                now = await self._doing_now(conn, p)
            except wire.BadRequest as e:  # its approval will say so (a conflict, say)
                log.info("plan %d (held) not composed again: %s", p.id, e)
                continue
            if now != was:
                void = sum(a.digest == was for a in p.hold.approvals)
                await events.record(conn, "plan.recomposed", epoch=self._epoch, plan=p.id,
                                    by_plan=by, was=was, now=now, void=void)  # fmt: skip
                log.info("plan %d (held) composed again after plan %d: it now does %s; %d "
                         "approval(s) void", p.id, by, now[:19], void)  # fmt: skip

    async def _steps(
        self, conn: asyncpg.Connection, p: plans.Plan, targets: list[str]
    ) -> list[plans.Step]:
        """The held change's steps: each machine whose declaration it changes, or, for a
        restart, each machine it restarts (its declaration kept)."""
        if isinstance(p.hold, plans.HeldRestart):
            return await self._rec.restart_steps(conn, targets)
        return await self._rec.steps(conn, targets)

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
            case plans.HeldRestart(machines=held):
                if current is None:
                    raise wire.BadRequest(
                        f"module {module} is no longer registered: plan {p.id} cannot be "
                        f"approved (cancel it: mesh plan cancel {p.id})", code="conflict",
                    )  # fmt: skip
                settings = rollout.restart_settings(settings_of(self._manifests.of(current)))
                return [m for m in held if m in self._fleet.machines], {}, settings
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


class _Counted(NamedTuple):
    state: PlanState
    steps: list[plans.Step]
    given: int  # approvals for what the plan does now, this one included
    needed: int
    void: int  # given for what it did before
    waiting: bool  # for more approvals


def _not_its_author(p: plans.Plan, by: str) -> None:
    """An operator never approves its own plan (on a bus where nobody is verified, `by` is
    nobody's: the rule has no one to tell apart, and the policy asks for one approval)."""
    if by == p.by and by != ANONYMOUS:
        raise wire.BadRequest(
            f"forbidden: plan {p.id} was asked by {by}: an operator never approves its own "
            "plan; another operator approves it", code="forbidden",
        )  # fmt: skip


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
