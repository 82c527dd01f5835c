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

The operator steers a plan through the store (steering.py; docs/operations.md, Steering a
change): a paused plan sends no new machine its declaration (the steps in flight finish) and
does not end until it is resumed; a cancelled one stops at once and reverts as a failure does,
ending `cancelled`. With `[rollout] canary`, the first machines of each tier go first; with a
`soak`, they (or, without canaries, each tier) must stay healthy that long before the rest go,
and a machine that does not stops the plan; `pause_after` pauses the plan after those tiers.
The soak's end and the tiers paused after are kept in the store too, so a takeover soaks on
until the same moment and never pauses twice. The verbs move a plan's state with its row
locked (`plans.locked`), and so does the planner where it moves it (start, pause, finish):
whichever comes second sees what the first wrote.

What the planner decides (next steps, a step's verdict and its reason, revert order, waves,
soaks) is pure and lives in rollout.py; here are the store, the publishing and the waiting.
"""

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from mesh import wire
from mesh.model import PlanState
from mesh.store import declarations, plans, seats
from services.controller import metrics
from services.controller.catalog import bundles
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import Publisher
from services.controller.plans import rollout
from services.controller.plans.heard import Heard
from services.controller.plans.progress import Progress
from services.controller.plans.sending import Sending
from services.controller.plans.writes import PlanWrites

log = logging.getLogger(__name__)

IDLE_CHECK = 5.0  # look for a plan this often even without being woken (a missed wake-up)
LOOK_EVERY = 1.0  # the longest the planner waits without judging deadlines


class _Stopped(Exception):
    """The plan was cancelled (by an operator, or superseded by a newer change of its module)
    while it rolled forward: no new machine starts, its revert begins."""


class Planner:
    def __init__(
        self, *, pool: asyncpg.Pool, publisher: Publisher, fleet: Fleet, epoch: int,
        nc: Client | None = None, obs: ObjectStore | None = None,
    ) -> None:  # fmt: skip
        self._pool = pool
        self._obs = obs  # the bundle store, checked before a plan starts; None: not checked
        self._publisher = publisher
        self._fleet = fleet
        self._epoch = epoch
        self._writes = PlanWrites(pool=pool, epoch=epoch)  # every write of a plan's life
        self._wake = anyio.Event()
        self._reports = Heard(fleet)  # what the fleet last heard of each machine
        self.progress = Progress(pool=pool, nc=nc)  # what `status` shows, and what is told
        self._sending = Sending(
            fleet=fleet, writes=self._writes, publisher=publisher, nc=nc, heard=self._reports,
            progress=self.progress,
        )  # fmt: skip

    def wake(self) -> None:
        """A plan was recorded, or an operator steered one (steering.py): look again."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            plan_id = await plans.oldest_open(self._pool)
            if plan_id is None:
                self.progress.plan = None
                await self.progress.show(None)
                await self._woken(IDLE_CHECK)
                continue
            self.progress.plan = plan_id
            plan = await plans.load(self._pool, plan_id)
            assert plan is not None
            if plan.state == "paused" and plan.started is None:
                # Paused before it started: the queue waits for it (its change is in the
                # catalog) until it is resumed or cancelled.
                await self.progress.show(plan)
                await self._woken(IDLE_CHECK)
                continue
            await self._run(plan)
            self._reports.forget()

    async def _woken(self, within: float) -> None:
        with anyio.move_on_after(within):
            await self._wake.wait()
        self._wake = anyio.Event()

    # --- one plan ------------------------------------------------------------------------------

    async def _run(self, p: plans.Plan) -> None:
        self.progress.tier = None  # not the last plan's
        await self.progress.show(p)
        if p.state == "pending":
            missing = None
            if self._obs is not None and p.trigger in ("push", "assign", "rollback"):
                missing = await bundles.missing(self._pool, self._obs, p.subject, plan=p.id)
            if missing is not None:  # no machine is touched for a bundle it cannot fetch
                await self._finish(p, "reverted" if p.settings.auto_revert else "failed", missing)
                return
            try:
                if not await self._start(p):
                    return  # an operator paused or cancelled it first: taken again from the store
            except seats.Fenced:
                raise  # the seat moved on: this controller must stop, not fail the plan
            except wire.BadRequest as e:  # e.g. a conflict the catalog has come to since
                await self._finish(p, "failed", f"could not compose: {e}")
                return
        else:
            log.info("plan %d: continuing under epoch %d (%s, %s)", p.id, self._epoch, p.phase,
                     p.state)  # fmt: skip
        if p.phase == "forward" and await self._forwarded(p):
            return
        for tier in rollout.revert_order(p.steps):
            await self._revert_tier(p, tier)
        await self._finish(p, "reverted", p.error)  # `cancelled` when it was (_finish)

    async def _forwarded(self, p: plans.Plan) -> bool:
        """Roll the plan forward; True when it has ended (done, or failed without a revert),
        False when it must revert (a failure, or a cancel: `p.phase` is then `revert`)."""
        try:
            failure = await self._forward(p)
        except _Stopped:
            log.info("plan %d cancelled (%s): reverting", p.id, p.cancel)
            await self.progress.show(p)
            return False
        if failure is None and await self._finish(p, "done", None):
            return True
        if failure is not None and not p.settings.auto_revert:
            if await self._finish(p, "failed", failure):
                return True
        if failure is not None:
            log.info("plan %d stopped: %s; reverting", p.id, failure)
            p.error = failure
        p.phase = "revert"
        await self.progress.show(p)
        return False

    async def _forward(self, p: plans.Plan) -> str | None:
        """Every tier in order, each in its waves (canaries, then the rest) with the soak and
        the pause (`pause_after`) they call for; why the plan stops, or None when every machine
        is there. Raises _Stopped when the plan is cancelled meanwhile."""
        # A failed step already in the store (written with its plan's stop, but kept here
        # too: a plan with a failed step never rolls on).
        failure = rollout.recorded_failure(p.steps)
        if failure is not None:
            return failure
        for tier in rollout.tiers(p.steps):
            for wave in rollout.waves(
                p.steps, tier=tier, settings=p.settings, drained=self._fleet.drained
            ):
                failure = await self._roll_wave(p, tier, wave)
                if failure is None and wave.soaks:
                    failure = await self._soak(p, tier, wave)
                if failure is not None:
                    return failure
            if rollout.pause_due(tier=tier, settings=p.settings, paused_after=p.paused_after):
                await self._pause_self(p, tier)
        await self._while_paused(p)  # a paused plan ends only once resumed
        return None

    async def _start(self, p: plans.Plan) -> bool:
        """Compose the plan's machines and start it; False if an operator's verb moved it
        first (paused or cancelled it before it started)."""
        now = datetime.now(UTC)
        machines = [s.machine for s in p.steps]
        async with self._writes.on(p.id) as w:
            row = await w.locked()
            if row is None or row.state != "pending":
                return False
            stored = await declarations.declarations(w.conn, machines)
            if p.trigger == "restart":  # its machines keep what they run, restarted
                composed = {m: (d, b) for m, (d, b, _) in stored.items()}
            else:
                composed = await self._publisher.compose(w.conn, machines)
            tier_of = {m: self._fleet.machines[m].tier for m in machines}
            rollout.prepare(p.steps, composed=composed, stored=stored, tier_of=tier_of, at=now,
                            restart=p.trigger == "restart")  # fmt: skip
            await w.steps(p.steps)
            await w.plan(state="rolling", started=now)
            await w.event("plan.started")
        p.state, p.started = "rolling", now
        p.steps.sort(key=lambda s: (s.tier, s.machine))
        tiers = rollout.tiers(p.steps)
        log.info("plan %d (%s %s): %d machine(s) in tier(s) %s", p.id, p.trigger, p.subject,
                 len(p.steps), ", ".join(map(str, tiers)))  # fmt: skip
        await self.progress.show(p)
        return True

    async def _finish(self, p: plans.Plan, state: PlanState, error: str | None) -> bool:
        """End the plan; False (nothing written) when it was cancelled before it could end
        done or failed: its changed machines get their old declarations back first. A revert
        of a cancelled plan ends `cancelled`."""
        now = datetime.now(UTC)
        async with self._writes.on(p.id) as w:
            row = await w.locked()
            if row is not None and row.state not in plans.OPEN:
                return True  # ended already (cancelled by a verb before it started)
            if row is not None and row.cancel is not None:
                p.cancel = row.cancel
                if state in ("done", "failed"):
                    return False
                state = "cancelled"
            if state == "reverted":  # a cancel took its change back when it was asked
                log.info("plan %d: %s", p.id, await w.undo(p))
            await w.plan(state=state, finished=now, error=error, soak_until=None)
            await w.event(f"plan.{state}", error=error, cancel=p.cancel)
        p.state, p.finished, p.error, p.soak_until = state, now, error, None
        took = (now - p.started).total_seconds() if p.started else 0.0
        if error:
            log.info("plan %d %s after %.1fs: %s", p.id, state, took, error)
        else:
            log.info("plan %d %s in %.1fs", p.id, state, took)
        await self.progress.show(p)  # its end told; no longer `current`
        return True

    # --- rolling forward -------------------------------------------------------------------------

    async def _roll_wave(self, p: plans.Plan, tier: int, wave: rollout.Wave) -> str | None:
        """Roll one wave of a tier out (its canaries, the rest, or the whole tier); None when
        every step is done, else why the plan stops. Paused, it sends nothing new and waits
        for the steps in flight; cancelled, it raises _Stopped."""
        t = rollout.rolling(wave.steps, tier=tier, settings=p.settings)
        if t is None:
            return None
        self.progress.tier = tier
        resumed = rollout.resumed(t)
        if resumed:  # a step in flight when the last holder stopped: send it again
            await self._sending.send(p, resumed, "after")
            rollout.await_(t, resumed, now=time.monotonic())
        what = "canary machine(s)" if wave.canary else "machine(s)"
        log.info("plan %d: tier %d: %d %s", p.id, tier, len(t.steps), what)
        await self.progress.show(p)
        look: set[str] = {s.machine for s in resumed}
        while not t.finished:
            await self._heard(p)
            batch = rollout.next_batch(t) if p.state != "paused" else []
            if batch:
                await self._sending.send(p, batch, "after")
                rollout.await_(t, batch, now=time.monotonic())  # not those skipped: down
                look |= {s.machine for s in batch}
            if not look and not t.active:  # paused, nothing in flight: until resumed
                await self._changes(IDLE_CHECK)
                continue
            if not look:
                look = await self._changes(
                    min(LOOK_EVERY, rollout.soonest(t, now=time.monotonic()))
                )
            verdict = rollout.look(
                t, machines=look, report=self._reports.report, names=self._reports.names,
                now=time.monotonic(), at=datetime.now(UTC),
            )  # fmt: skip
            look = set()
            if verdict.failure is not None:
                # The failing step and the plan's stop in one transaction: whoever continues
                # the plan sees both or neither, so it never rolls on past a failure.
                stop = {"phase": "revert"} if p.settings.auto_revert else {}
                await self._write(p, verdict.changed, error=verdict.failure, **stop)
                _count_finished(verdict.changed)
                return verdict.failure
            if verdict.changed:
                await self._write(p, verdict.changed)
                _count_finished(verdict.changed)
        log.info("plan %d: tier %d: %d %s done", p.id, tier, len(t.steps), what)
        return None

    # --- the operator's hand: soaks, pauses, cancels (docs/operations.md, Steering a change) ---

    async def _soak(self, p: plans.Plan, tier: int, wave: rollout.Wave) -> str | None:
        """Watch the wave's machines (done, not skipped) for `soak` seconds from when it
        started (kept in the store: a takeover soaks on until the same moment); the first
        that is no longer healthy fails its step and stops the plan (its tier's rest never
        starts). Paused, it soaks on; cancelled, it raises _Stopped."""
        watched = rollout.soaking(wave)
        stage = rollout.soak_stage(tier=tier, soak_tier=p.soak_tier, soak_until=p.soak_until)
        if not watched or stage == "passed":
            return None
        soak = p.settings.soak
        if stage == "start":
            until = datetime.now(UTC) + timedelta(seconds=soak)
            await self._set(p, "plan.soaking", soak_tier=tier, soak_until=until)
        assert p.soak_until is not None
        self.progress.tier = tier
        log.info("plan %d: tier %d: %d machine(s) soak until %s", p.id, tier, len(watched),
                 p.soak_until.isoformat(timespec="seconds"))  # fmt: skip
        everyone = {s.machine for s in watched}
        look, whole = everyone, time.monotonic()
        while True:
            await self._heard(p)
            left = (p.soak_until - datetime.now(UTC)).total_seconds()
            failure = rollout.soak_look(
                watched, machines=look, report=self._reports.report, names=self._reports.names,
                soak=soak, left=left, at=datetime.now(UTC),
            )  # fmt: skip
            if failure is not None:
                stop = {"phase": "revert"} if p.settings.auto_revert else {}
                failed = [s for s in watched if s.state == "failed"]
                p.soak_until = None
                await self._write(p, failed, error=failure, soak_until=None, **stop)
                return failure
            if left <= 0:
                break
            look = await self._changes(min(LOOK_EVERY, left))
            if time.monotonic() - whole >= LOOK_EVERY:  # a machine gone quiet is judged too
                look, whole = everyone, time.monotonic()
        await self._set(p, "plan.soaked", soak_until=None)
        return None

    async def _pause_self(self, p: plans.Plan, tier: int) -> None:
        """`pause_after`: the plan pauses itself after `tier` (once: the tier is kept) and
        waits until it is resumed."""
        async with self._writes.on(p.id) as w:
            row = await w.locked()
            assert row is not None
            if row.phase == "revert":  # cancelled as the tier ended
                p.phase, p.cancel = "revert", row.cancel
                raise _Stopped
            await w.plan(state="paused", paused_after=tier)
            await w.event("plan.paused", by="pause_after", tier=tier)
        p.state, p.paused_after = "paused", tier
        log.info("plan %d paused itself after tier %d (pause_after): mesh plan resume %d",
                 p.id, tier, p.id)  # fmt: skip
        await self.progress.show(p)
        await self._while_paused(p)

    async def _while_paused(self, p: plans.Plan) -> None:
        """Wait while the plan is paused (until resumed; cancelled, raise _Stopped)."""
        while p.state == "paused":
            await self._woken(IDLE_CHECK)
            self._wake.set()  # look at the store whether woken or not (a missed wake-up)
            await self._heard(p)

    async def _heard(self, p: plans.Plan) -> None:
        """When a verb woke the planner (steering.py: pause, resume, cancel), the plan's own
        state again from the store; cancelled, raise _Stopped."""
        if not self._wake.is_set():
            return
        self._wake = anyio.Event()
        head = await plans.head(self._pool, p.id)
        assert head is not None
        was = p.state
        p.state, p.cancel = head.state, head.cancel
        if head.phase == "revert" and p.phase == "forward":
            p.phase, p.soak_until = "revert", head.soak_until  # a soak ends with the cancel
            raise _Stopped
        if p.state != was:
            log.info("plan %d: %s (was %s)", p.id, p.state, was)
            await self.progress.show(p)

    async def _changes(self, within: float) -> set[str]:
        """The machines whose reports changed (fleet.changes), waiting up to `within`, or
        less when a verb wakes the planner."""
        touched: set[str] = set()
        if self._wake.is_set():
            return touched

        async def machines(scope: anyio.CancelScope) -> None:
            touched.update(await self._fleet.changes(within))
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(machines, tg.cancel_scope)
            await self._wake.wait()
            tg.cancel_scope.cancel()
        return touched

    async def _set(self, p: plans.Plan, event: str, **fields: Any) -> None:
        """The plan's own steering fields, with their event, in one fenced transaction."""
        async with self._writes.on(p.id) as w:
            await w.plan(**fields)
            await w.event(event, **{k: v for k, v in fields.items() if v is not None})
        for name, value in fields.items():
            setattr(p, name, value)
        await self.progress.show(p)

    async def _write(self, p: plans.Plan, steps: list[plans.Step], **plan: Any) -> None:
        """Steps (and, given, the plan's own fields) in one fenced transaction."""
        async with self._writes.on(p.id) as w:
            await w.steps(steps)
            if plan:
                await w.plan(**plan)
        await self.progress.show(p)

    # --- reverting -----------------------------------------------------------------------------

    async def _revert_tier(self, p: plans.Plan, tier: int) -> None:
        """Give this tier's changed machines their old declarations back and wait, within the
        deadline, for them to settle; a machine that does not is noted, not waited for longer."""
        steps = rollout.to_revert(p.steps, tier=tier)
        kept = rollout.kept_by_drain(steps, drained=self._fleet.drained)
        if kept:  # noted, never sent: a drained machine keeps what it runs
            await self._write(p, kept)
            steps = [s for s in steps if s not in kept]
        if not steps:
            return
        self.progress.tier = tier
        log.info("plan %d: reverting tier %d: %d machine(s)", p.id, tier, len(steps))
        await self._sending.send(p, steps, "before")
        until = time.monotonic() + p.settings.deadline
        waiting = {s.machine: s for s in steps if self._fleet.up(s.machine)}
        look = set(waiting)
        while waiting and time.monotonic() < until:
            heard = self._reports
            rollout.settled(waiting, machines=look, report=heard.report, names=heard.names)
            look = await self._fleet.changes(min(LOOK_EVERY, max(0.0, until - time.monotonic())))
        unsettled: dict[str, str] = {}
        for machine, s in waiting.items():
            digest, body = rollout.before(s)
            unsettled[machine] = rollout.why(
                machine=machine, report=self._reports.report(machine), digest=digest,
                names=self._reports.names(digest, body), deadline=p.settings.deadline,
            )  # fmt: skip
        rollout.reverted(steps, unsettled=unsettled)
        await self._write(p, steps)


def _count_finished(steps: list[plans.Step]) -> None:
    """Each step that has just ended, in the plan step histogram (once: a step that ended is
    not judged again)."""
    for s in steps:
        if s.state in ("done", "failed") and s.started and s.finished:
            took = (s.finished - s.started).total_seconds()
            metrics.PLAN_STEP_SECONDS.labels(s.state).observe(max(0.0, took))
