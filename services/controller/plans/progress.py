"""What a plan tells as it goes: `status` shows the plan being rolled (`current`), and every
step or tier change is told on mesh.plan.<id> with each tier's counts, so a watcher (the
console, `--wait`) hears each one. Told, not stored: a lost one costs a watcher a refresh.
"""

import logging

import asyncpg
import msgspec
from nats.aio.client import Client

from mesh import subjects, wire
from mesh.model import PlanProgress, PlanSummary
from mesh.store import plans
from services.controller.plans import rollout

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, *, pool: asyncpg.Pool, nc: Client | None) -> None:
        self._pool = pool
        self._nc = nc  # where progress is told (mesh.plan.<id>); None: nowhere
        self.current: PlanSummary | None = None  # what `status` shows
        self.plan: int | None = None  # the plan the planner has
        self.tier: int | None = None  # the tier it rolls (or reverts) now

    async def show(self, p: plans.Plan | None) -> None:
        """The plan the planner has, as `status` shows it and as it is told: every step or
        tier change passes here."""
        if p is None:
            self.current = None
            return
        counted = rollout.tier_counts(p.steps)
        summary = _summary(p, counted, tier=self.tier)
        self.current = summary if p.state in plans.OPEN else None
        await self._tell(p, summary, counted)

    async def tell(self, plan_id: int) -> None:
        """Tell a plan's state after a verb moved it (approved, paused, resumed, cancelled:
        steering.py), so its followers hear it whether or not the planner is rolling it."""
        async with self._pool.acquire() as conn:
            p = await plans.head(conn, plan_id)
            counted = await plans.tiers(conn, plan_id)
        if p is not None:
            tier = self.tier if self.plan == plan_id else None
            await self._tell(p, _summary(p, counted, tier=tier), counted)

    async def _tell(
        self, p: plans.Plan, summary: PlanSummary, counted: list[plans.TierCounts]
    ) -> None:
        if self._nc is None:
            return
        soaking = p.soak_tier if p.soak_until is not None else None
        tiers = [rollout.tier_shown(t, soaking=t.tier == soaking) for t in counted]
        told = PlanProgress(**msgspec.structs.asdict(summary), tiers=tiers)
        try:
            await self._nc.publish(subjects.plan(p.id), wire.encode(told))
        except Exception as e:  # told, not stored: a lost one costs a watcher a refresh
            log.debug("plan %d: progress not told: %s: %s", p.id, type(e).__name__, e)


def _summary(p: plans.Plan, counted: list[plans.TierCounts], *, tier: int | None) -> PlanSummary:
    return PlanSummary(
        id=p.id, state=p.state, trigger=p.trigger, subject=p.subject, by=p.by,
        created=p.created, finished=p.finished, machines=sum(t.total for t in counted),
        done=sum(t.done for t in counted), tier=tier, phase=p.phase, failure=p.error,
        soak=plans.soak_shown(p.soak_tier, p.soak_until), cancelled=p.cancel,
    )  # fmt: skip
