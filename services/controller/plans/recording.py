"""Recording a change's plan: what every change of the catalog, a secret or a drain shares
(changes/modules.py, changes/secrets.py, changes/machines.py). One change at a time (`one_change`):
each composes the machines it touches, finds those whose declaration differs from what they will
have once the plans before it finish, and records a plan with a step for each (or that none
changes), audited in the same transaction; a newer change of a module supersedes its held and paused
plans.
"""

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
import asyncpg

from mesh import wire
from mesh.model import CHANGED_LISTED, ChangeReply, PlanBuild, PlanSettings, PlanState
from mesh.store import declarations, plans
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import Publisher
from services.controller.plans import states
from services.controller.plans.writes import OnePlan
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)

NAMED = 5  # machines a change's message (and log line) names; the rest are counted


def named(machines: list[str]) -> str:
    """Machines in a message: a few by name, the rest as a number (thousands of names would
    make a message, and a log line, the size of the fleet)."""
    if len(machines) <= NAMED:
        return ", ".join(machines)
    return f"{', '.join(machines[:NAMED])} and {len(machines) - NAMED} more"


def replied(
    *,
    plan: int | None,
    changed: list[str],
    message: str,
    version: str | None = None,
    state: PlanState | None = None,
) -> ChangeReply:
    """A change's reply, bounded whatever the fleet's size: the first CHANGED_LISTED machines
    whose declarations change, and how many there are (the plan's steps list every one)."""
    return ChangeReply(plan=plan, machines=changed[:CHANGED_LISTED], message=message,
                       version=version, changed=len(changed), state=state)  # fmt: skip


class Recorder:
    def __init__(
        self, *, fleet: Fleet, epoch: int, publisher: Publisher,
        wake: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        self._fleet = fleet
        self._epoch = epoch
        self._publisher = publisher  # composes the machines' declarations
        self.wake = wake  # tells the planner a plan was recorded
        self._lock = anyio.Lock()
        # Told, in the change's transaction, of the machines whose declarations a recorded plan
        # moves (and the plan): the held plans on them are composed again (approvals.py).
        self.moved: Callable[..., Awaitable[None]] = _nothing

    async def steps(self, conn: asyncpg.Connection, machines: Iterable[str]) -> list[plans.Step]:
        """A step for each machine whose composition differs from what it will have once the
        plans before it finish."""
        composed = await self._publisher.compose(conn, machines)
        expected = await plans.expected(conn, sorted(composed))
        return [
            plans.Step(
                machine=m, tier=self._fleet.machines[m].tier, state="pending", after=d, after_body=b
            )
            for m, (d, b) in composed.items()
            if expected.get(m) != d
        ]

    async def restart_steps(
        self, conn: asyncpg.Connection, machines: Iterable[str]
    ) -> list[plans.Step]:
        """A restart's step for each machine: its declaration as stored, which it keeps."""
        stored = await declarations.declarations(conn, sorted(machines))
        tier = {m: self._fleet.machines[m].tier for m in stored if m in self._fleet.machines}
        return [
            plans.Step(machine=m, tier=tier[m], state="pending", after=d, after_body=b)
            for m, (d, b, _) in stored.items()
            if m in tier
        ]

    @property
    def one_change(self) -> anyio.Lock:
        """Held by each change while it records (steering.py takes it to cancel; the holder
        pruning bundles takes it so none goes between a rollback's check and its plan)."""
        return self._lock

    async def plan(
        self, conn: asyncpg.Connection, machines: Iterable[str], *, audit: Audit, **how: Any
    ) -> tuple[int | None, list[str]]:
        """`recorded`, and the change's audit entry in the same transaction: every change an
        operator asks records its plan here, or that it has none."""
        plan, changed = await self.recorded(conn, machines, **how)
        await audit.write(
            conn,
            detail=f"plan {plan}"
            if plan is not None
            else "no plan: no machine's declaration changes",
        )
        return plan, changed

    async def recorded(
        self,
        conn: asyncpg.Connection,
        machines: Iterable[str],
        *,
        trigger: str,
        subject: str,
        by: str,
        settings: PlanSettings,
        undo: dict[str, Any],
        builds: list[PlanBuild] | None = None,
        building: int | None = None,
        hold: plans.Held | None = None,
        steps: list[plans.Step] | None = None,
    ) -> tuple[int | None, list[str]]:
        """Record a plan for the machines whose composition differs from what they will have
        once the plans before it finish; (None, []) when there are none. `building`: the
        push's plan recorded while it built, which gets these steps (or goes, if none). With
        `hold` (the change its approval makes), the plan is `held`, with the `steps` a dry
        run of the change found, even none (approvals.py: held changes)."""
        if steps is None:
            steps = await self.steps(conn, machines)
        kept = hold is not None  # a held change is recorded whatever it changes
        if building is not None:
            if not steps and not kept:
                await plans.drop_building(conn, building)
                return None, []
            if not await plans.built(
                conn, building, settings=settings, builds=builds or [], undo=undo, steps=steps,
                hold=hold,
            ):  # fmt: skip
                raise await stopped_building(conn, building)
            if not kept:
                await self.moved(conn, [s.machine for s in steps], by=building)
            return building, [s.machine for s in steps]
        if not steps and not kept:
            return None, []
        plan_id = await plans.create(
            conn, trigger=trigger, subject=subject, by=by, epoch=self._epoch, settings=settings,
            builds=builds or [], undo=undo, steps=steps, state="held" if kept else "pending",
            hold=hold,
        )  # fmt: skip
        if not kept and trigger != "restart":  # it moves these declarations: held plans follow
            await self.moved(conn, [s.machine for s in steps], by=plan_id)
        return plan_id, [s.machine for s in steps]

    def select(self, *, machines: list[str], tier: int | None, labels: dict[str, str]) -> list[str]:
        """Machines by name, plus every machine that matches all the given selectors."""
        for name in machines:
            if name not in self._fleet.machines:
                raise wire.BadRequest(f"machine {name} is not registered", code="not_found")
        chosen = set(machines)
        if tier is not None or labels:
            chosen |= {
                m.name
                for m in self._fleet.machines.values()
                if (tier is None or m.tier == tier)
                and all(m.labels.get(k) == v for k, v in labels.items())
            }
        return sorted(chosen)

    async def supersede(self, conn: asyncpg.Connection, module: str, *, by: str) -> list[int]:
        """Cancel the module's held and paused plans: a newer change of the module supersedes
        them (a paused one's changed machines get their old declarations back first, its
        catalog change is taken back at once). Their ids; `superseded` names the newer plan."""
        old = await plans.steered_of(conn, module)
        for p in old:
            why = f"superseded by a newer change of module {module}"
            w = OnePlan(conn=conn, epoch=self._epoch, plan_id=p.id)  # the change's transaction
            await states.cancelled(w, p, why=why, by=by)
            log.info("plan %d (%s %s, %s) superseded", p.id, p.trigger, module, p.state)
        return [p.id for p in old]

    async def superseded(
        self, conn: asyncpg.Connection, old: list[int], *, plan: int | None, what: str
    ) -> None:
        for plan_id in old:
            why = f"superseded by {f'plan {plan}' if plan else f'{what}, which changed no machine'}"
            w = OnePlan(conn=conn, epoch=self._epoch, plan_id=plan_id)
            await w.plan(cancel=why)
            await w.event("plan.superseded", by_plan=plan)


async def _nothing(*_: Any, **__: Any) -> None:
    return None


async def stopped_building(conn: asyncpg.Connection, plan_id: int) -> wire.BadRequest:
    """Why a push's plan is no longer building: cancelled by an operator (`conflict`: the
    client must not push again on its own), or failed by a new holder (`unavailable`: the
    client asks again, and the new holder builds it)."""
    p = await plans.head(conn, plan_id)
    if p is not None and p.cancel is not None:
        return wire.BadRequest(
            f"plan {plan_id} was {p.cancel} while its bundles built: nothing was registered",
            code="conflict",
        )
    return wire.BadRequest(
        f"plan {plan_id} was stopped while its bundles built (its controller stopped); push again",
        code="unavailable",
    )
