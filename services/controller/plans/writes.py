"""What a plan's life writes, and the one way it writes it: a fenced transaction on one plan
(`PlanWrites.on`), whose seven methods are every write the planner and the operator's hand on
a plan make (the plan's row locked, its fields, its steps, its events, its machines'
declarations, its catalog change taken back, a held plan approved). Each transaction first
checks the seat's epoch, so a holder that lost the seat writes nothing, and the next holder goes
on from what the store has. A plan is born in the transaction of the change that makes it
(recording.py), which cancels the plans it supersedes there through the same methods.
"""

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg

from mesh.model import PlanSettings
from mesh.store import declarations, events, modules, plans, seats, secrets


@dataclass
class OnePlan:
    """One plan's fenced transaction. `conn` is there for what a write is made of (composing
    its machines); every write goes through the methods."""

    conn: asyncpg.Connection
    epoch: int
    plan_id: int

    async def locked(self) -> plans.Plan | None:
        """The plan (without its steps), its row locked until the transaction ends."""
        return await plans.locked(self.conn, self.plan_id)

    async def plan(self, **fields: Any) -> None:
        """The plan's own fields (its state, phase, times, error, steering marks)."""
        await plans.set_plan(self.conn, self.plan_id, **fields)

    async def steps(self, steps: list[plans.Step]) -> None:
        await plans.set_steps(self.conn, self.plan_id, steps, epoch=self.epoch)

    async def event(self, kind: str, **detail: Any) -> None:
        """The plan's event (`plan.started`, `plan.paused`, ...), in the same transaction."""
        await events.record(self.conn, kind, epoch=self.epoch, plan=self.plan_id, **detail)

    async def declarations(self, bodies: dict[str, tuple[str, bytes]]) -> None:
        """The machines' declarations it sends (digest and body each), before publishing."""
        await declarations.write_declarations(self.conn, bodies, epoch=self.epoch)

    async def approved(
        self, steps: list[plans.Step], *, settings: PlanSettings, undo: dict[str, Any],
        hold: plans.Held,
    ) -> None:  # fmt: skip
        """A held plan approved: its steps as the catalog composes them now, its settings and
        undo, and what it held with who approved it; it waits its turn (`pending`)."""
        await plans.replace_steps(self.conn, self.plan_id, steps)
        await plans.approved(self.conn, self.plan_id, settings=settings, undo=undo, hold=hold)

    async def hold(self, hold: plans.Held) -> None:
        """What a held plan holds, with the approvals given so far (it stays held)."""
        await plans.set_hold(self.conn, self.plan_id, hold)

    async def undo(self, p: plans.Plan) -> str:
        """Its catalog change taken back (a later change of the module or secret stands); in
        words."""
        if p.trigger == "secret":
            return await secrets.undo(self.conn, p.undo)
        return await modules.undo(self.conn, p.trigger, p.undo, plan_id=p.id)


@dataclass
class PlanWrites:
    pool: asyncpg.Pool
    epoch: int

    @contextlib.asynccontextmanager
    async def on(self, plan_id: int) -> AsyncIterator[OnePlan]:
        """A fenced transaction on plan `plan_id`: committed when the block ends, rolled back
        if it raises."""
        async with self.pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self.epoch)
            yield OnePlan(conn=conn, epoch=self.epoch, plan_id=plan_id)
