"""The holder's planner: rolls recorded plans out, one at a time, tier by tier.

A plan's steps are one per machine. When a plan starts, its machines are composed again from
the store (a plan that waited in the queue carries the catalog as it is when its turn comes) and
each step keeps the declaration the machine had before. Then tier 0, 1, 2: a step stores and
publishes the machine's new declaration and is done when the machine reports it applied and
every process in it healthy, within the plan's deadline; `max_parallel` machines at a time.

The first failing step stops the plan: no later step or tier is touched. With `auto_revert`, the
machines already changed get their old declarations back, tier by tier in reverse, the catalog
change is taken back, and the plan ends `reverted`. Every write checks the seat's epoch in the
same transaction, and the plan's state lives only in the store, so whichever controller holds
the seat next continues it from where it stands (publishing a declaration again is harmless).
"""

import logging
import time
from datetime import UTC, datetime

import anyio
import asyncpg
import msgspec

from mesh import wire
from mesh.model import PlanSummary
from mesh.modules.compose import Declaration, encode, merge
from mesh.store import catalog, events, plans
from services.controller.catalog import Catalog
from services.controller.fleet import Fleet

log = logging.getLogger(__name__)

# Digests whose process names are remembered, the most recently used: every machine's
# declaration has its own digest, and a plan judges one or two per machine (after, before).
# Forgotten when the plan ends; this bounds what one very large plan keeps.
NAMES_KEPT = 16384
IDLE_CHECK = 5.0  # look for a plan this often even without being woken (a missed wake-up)
LOOK_EVERY = 1.0  # the longest the planner waits without judging deadlines


class Planner:
    def __init__(self, *, pool: asyncpg.Pool, catalog: Catalog, fleet: Fleet, epoch: int) -> None:
        self._pool = pool
        self._catalog = catalog
        self._fleet = fleet
        self._epoch = epoch
        self._wake = anyio.Event()
        # digest -> the processes it declares, least recently used first (at most NAMES_KEPT)
        self._names: dict[str, frozenset[str]] = {}
        self._plan: plans.Plan | None = None
        self._tier: int | None = None
        self.current: PlanSummary | None = None  # what `status` shows

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            plan_id = await plans.oldest_open(self._pool)
            if plan_id is None:
                self._show(None)
                with anyio.move_on_after(IDLE_CHECK):
                    await self._wake.wait()
                self._wake = anyio.Event()
                continue
            plan = await plans.load(self._pool, plan_id)
            assert plan is not None
            await self._run(plan)
            self._names.clear()  # its digests are done with; the next plan brings its own

    # --- one plan ------------------------------------------------------------------------------

    async def _run(self, p: plans.Plan) -> None:
        self._show(p)
        if p.state == "pending":
            try:
                await self._start(p)
            except catalog.Fenced:
                raise  # the seat moved on: this controller must stop, not fail the plan
            except wire.BadRequest as e:  # e.g. a conflict the catalog has come to since
                await self._finish(p, "failed", f"could not compose: {e}")
                return
        else:
            log.info("plan %d: continuing under epoch %d (%s)", p.id, self._epoch, p.phase)
        if p.phase == "forward":
            # A failed step already in the store (written with its plan's stop, but kept here
            # too: a plan with a failed step never rolls on).
            bad = next((s for s in p.steps if s.state == "failed"), None)
            failure = f"machine {bad.machine}: {bad.error}" if bad else None
            for tier in sorted({s.tier for s in p.steps}):
                if failure is not None:
                    break
                failure = await self._roll_tier(p, tier)
            if failure is None:
                await self._finish(p, "done", None)
                return
            if not p.settings.auto_revert:
                await self._finish(p, "failed", failure)
                return
            log.info("plan %d stopped: %s; reverting", p.id, failure)
            p.phase, p.error = "revert", failure
            self._show(p)
        for tier in sorted({s.tier for s in p.steps}, reverse=True):
            await self._revert_tier(p, tier)
        await self._finish(p, "reverted", p.error)

    async def _start(self, p: plans.Plan) -> None:
        now = datetime.now(UTC)
        machines = [s.machine for s in p.steps]
        async with self._pool.acquire() as conn, conn.transaction():
            await catalog.fence(conn, epoch=self._epoch)
            composed = await self._catalog.compose(conn, machines)
            stored = await catalog.declarations(conn, machines)
            for s in p.steps:
                s.after, s.after_body = composed[s.machine]
                before = stored.get(s.machine)
                s.before, s.before_body = (before[0], before[1]) if before else (None, None)
                s.tier = self._fleet.machines[s.machine].tier  # `mesh tier` may have moved it
                if s.before == s.after:
                    s.state, s.finished = "skipped", now
                    s.error = "no change by the time the plan started"
            await plans.set_steps(conn, p.id, p.steps, epoch=self._epoch)
            await plans.set_plan(conn, p.id, state="rolling", started=now)
            await events.record(conn, "plan.started", epoch=self._epoch, plan=p.id)
        p.state, p.started = "rolling", now
        p.steps.sort(key=lambda s: (s.tier, s.machine))
        tiers = sorted({s.tier for s in p.steps})
        log.info("plan %d (%s %s): %d machine(s) in tier(s) %s", p.id, p.trigger, p.subject,
                 len(p.steps), ", ".join(map(str, tiers)))  # fmt: skip
        self._show(p)

    async def _finish(self, p: plans.Plan, state: str, error: str | None) -> None:
        now = datetime.now(UTC)
        async with self._pool.acquire() as conn, conn.transaction():
            await catalog.fence(conn, epoch=self._epoch)
            if state == "reverted":
                taken_back = await catalog.undo(conn, p.trigger, p.undo, plan_id=p.id)
                log.info("plan %d: %s", p.id, taken_back)
            await plans.set_plan(conn, p.id, state=state, finished=now, error=error)
            await events.record(conn, f"plan.{state}", epoch=self._epoch, plan=p.id, error=error)
        p.state, p.finished, p.error = state, now, error
        took = (now - p.started).total_seconds() if p.started else 0.0
        if error:
            log.info("plan %d %s after %.1fs: %s", p.id, state, took, error)
        else:
            log.info("plan %d %s in %.1fs", p.id, state, took)
        self._show(None)

    # --- rolling forward -------------------------------------------------------------------------

    async def _roll_tier(self, p: plans.Plan, tier: int) -> str | None:
        """Roll one tier out; None when every step is done, else why the plan stops."""
        steps = [s for s in p.steps if s.tier == tier and s.state in ("pending", "applying")]
        if not steps:
            return None
        self._tier = tier
        deadline = p.settings.deadline
        limit = p.settings.max_parallel or len(steps)
        queue = [s for s in steps if s.state == "pending"]
        active: dict[str, tuple[plans.Step, float]] = {}
        resumed = [s for s in steps if s.state == "applying"]
        if resumed:  # a step in flight when the last holder stopped: send it again
            await self._send(p, resumed, "after")
            active.update((s.machine, (s, time.monotonic() + deadline)) for s in resumed)
        log.info("plan %d: tier %d: %d machine(s)", p.id, tier, len(steps))
        self._show(p)
        look: set[str] = {s.machine for s in resumed}
        while queue or active:
            room = limit - len(active)
            if room > 0 and queue:
                batch, queue = queue[:room], queue[room:]
                await self._send(p, batch, "after")
                active.update(
                    (s.machine, (s, time.monotonic() + deadline))
                    for s in batch
                    if s.state == "applying"  # not skipped because it is down
                )
                look |= {s.machine for s in batch}
            if not look:
                soonest = min((d for _, d in active.values()), default=time.monotonic())
                wait = min(LOOK_EVERY, max(0.0, soonest - time.monotonic()))
                look = await self._fleet.changes(wait)
            done: list[plans.Step] = []
            failed: tuple[plans.Step, str] | None = None
            for machine in look & active.keys():
                s = active[machine][0]
                verdict = self._judge(machine, s.after, s.after_body)
                if verdict is True:
                    done.append(s)
                    del active[machine]
                elif isinstance(verdict, str):
                    failed = (s, verdict)
                    break
            look = set()
            now = time.monotonic()
            if failed is None:
                late = next(((s, d) for s, d in active.values() if now >= d), None)
                if late is not None:
                    bad = late[0]
                    failed = (bad, self._why(bad.machine, bad.after, bad.after_body, deadline))
            finished = datetime.now(UTC)
            for s in done:
                s.state, s.finished = "done", finished
            changed = list(done)
            if failed is not None:
                bad, why = failed
                bad.state, bad.finished, bad.error = "failed", finished, why
                for s, _ in active.values():
                    if s is not bad:  # changed, but not seen through: the revert covers them
                        s.state, s.finished = "failed", finished
                        s.error = f"not finished when the plan stopped at machine {bad.machine}"
                changed = [s for s in steps if s.state in ("done", "failed")]
            if failed is not None:
                # The failing step and the plan's stop in one transaction: whoever continues
                # the plan sees both or neither, so it never rolls on past a failure.
                failure = f"machine {failed[0].machine}: {failed[1]}"
                stop = {"phase": "revert"} if p.settings.auto_revert else {}
                await self._write(p, changed, error=failure, **stop)
                return failure
            if changed:
                await self._write(p, changed)
        log.info("plan %d: tier %d done", p.id, tier)
        return None

    async def _send(self, p: plans.Plan, steps: list[plans.Step], which: str) -> None:
        """Store and publish each step's `after` (or, reverting, `before`) declaration."""
        now = datetime.now(UTC)
        bodies: dict[str, tuple[str, bytes]] = {}
        for s in steps:
            if which == "after":
                bodies[s.machine] = (s.after, s.after_body)
                if s.state == "pending":
                    s.state, s.started, s.published = "applying", now, True
                    if p.settings.skip_down and not self._fleet.up(s.machine):
                        s.state, s.finished = "skipped", now
                        s.error = (f"machine {s.machine} is down: skipped; it gets this "
                                   "declaration when it comes back")  # fmt: skip
            else:
                bodies[s.machine] = self._before(s)
            self._fleet.forget_error(s.machine)  # an old failure is not this step's
        async with self._pool.acquire() as conn, conn.transaction():
            await catalog.fence(conn, epoch=self._epoch)
            await catalog.write_declarations(conn, bodies, epoch=self._epoch)
            await plans.set_steps(conn, p.id, steps, epoch=self._epoch)
        await self._catalog.publish(bodies)
        self._show(p)

    async def _write(self, p: plans.Plan, steps: list[plans.Step], **plan: str) -> None:
        """Steps (and, given, the plan's own fields) in one fenced transaction."""
        async with self._pool.acquire() as conn, conn.transaction():
            await catalog.fence(conn, epoch=self._epoch)
            await plans.set_steps(conn, p.id, steps, epoch=self._epoch)
            if plan:
                await plans.set_plan(conn, p.id, **plan)
        self._show(p)

    # --- reverting -----------------------------------------------------------------------------

    async def _revert_tier(self, p: plans.Plan, tier: int) -> None:
        """Give this tier's changed machines their old declarations back and wait, within the
        deadline, for them to settle; a machine that does not is noted, not waited for longer."""
        steps = [s for s in p.steps if s.tier == tier and s.published and not s.reverted]
        if not steps:
            return
        self._tier = tier
        log.info("plan %d: reverting tier %d: %d machine(s)", p.id, tier, len(steps))
        await self._send(p, steps, "before")
        until = time.monotonic() + p.settings.deadline
        waiting = {s.machine: s for s in steps if self._fleet.up(s.machine)}
        look = set(waiting)
        while waiting and time.monotonic() < until:
            for machine in look & waiting.keys():
                s = waiting[machine]
                digest, body = self._before(s)
                if self._judge(machine, digest, body) is not None:  # settled, well or not
                    del waiting[machine]
            look = await self._fleet.changes(min(LOOK_EVERY, max(0.0, until - time.monotonic())))
        for s in steps:
            s.reverted = True
            if s.state != "failed":
                s.state = "reverted"  # `finished` stays when its forward step finished
            if s.machine in waiting:
                digest, body = self._before(s)
                note = f"revert: {self._why(s.machine, digest, body, p.settings.deadline)}"
                s.error = f"{s.error}; {note}" if s.error else note
        await self._write(p, steps)

    def _before(self, s: plans.Step) -> tuple[str, bytes]:
        if s.before is not None and s.before_body is not None:
            return s.before, s.before_body
        body, digest = encode(merge(s.machine, []))  # it had none: nothing runs there again
        return digest, body

    # --- judging a machine ---------------------------------------------------------------------

    def _judge(self, machine: str, digest: str, body: bytes) -> bool | str | None:
        """True: applied and healthy; a string: why it failed; None: not yet."""
        if self._fleet.failed_digest.get(machine) == digest:
            return self._fleet.apply_errors.get(machine, "the apply failed")
        if self._fleet.applied.get(machine) != digest:
            return None
        states = {ps.name: ps for ps in self._fleet.processes.get(machine, [])}
        for name in self._processes(digest, body):
            ps = states.get(name)
            if ps is None or not ps.healthy:
                return None
        return True

    def _why(self, machine: str, digest: str, body: bytes, deadline: float) -> str:
        """Why a machine is not there yet, for a step that ran out of time."""
        if not self._fleet.up(machine):
            return f"machine {machine} is down"
        if self._fleet.applied.get(machine) != digest:
            trials = [ps for ps in self._fleet.processes.get(machine, [])
                      if ps.name.endswith(" (new version)") and not ps.healthy]  # fmt: skip
            if trials:  # a start-first trial still waiting for its checks
                return (f"process {trials[0].name} is {trials[0].state}, not healthy, "
                        f"after {deadline:g}s")  # fmt: skip
            return f"did not apply its new declaration within {deadline:g}s"
        states = {ps.name: ps for ps in self._fleet.processes.get(machine, [])}
        for name in sorted(self._processes(digest, body)):
            ps = states.get(name)
            if ps is None:
                return f"process {name} is not running after {deadline:g}s"
            if not ps.healthy:
                return f"process {name} is {ps.state}, not healthy, after {deadline:g}s"
        return f"not healthy after {deadline:g}s"

    def _processes(self, digest: str, body: bytes) -> frozenset[str]:
        names = self._names.pop(digest, None)
        if names is None:
            names = frozenset(msgspec.json.decode(body, type=Declaration).processes)
            if len(self._names) >= NAMES_KEPT:  # forget the least recently used
                del self._names[next(iter(self._names))]
        self._names[digest] = names  # last: the most recently used
        return names

    # --- what status shows -----------------------------------------------------------------------

    def _show(self, p: plans.Plan | None) -> None:
        if p is None or p.state not in plans.OPEN:
            self.current = None
            return
        self.current = PlanSummary(
            id=p.id, state=p.state, trigger=p.trigger, subject=p.subject, by=p.by,
            created=p.created, finished=p.finished, machines=len(p.steps),
            done=sum(s.state in ("done", "skipped") for s in p.steps), tier=self._tier,
            phase=p.phase, failure=p.error,
        )  # fmt: skip
