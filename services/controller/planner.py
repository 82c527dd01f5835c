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

What the planner decides (next steps, a step's verdict and its reason, revert order) is pure
and lives in rollout.py; here are the store, the publishing and the waiting.
"""

import logging
import time
from datetime import UTC, datetime

import anyio
import asyncpg
import msgspec
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from mesh import blobs, subjects, wire
from mesh.model import PlanProgress, PlanState, PlanSummary
from mesh.modules.compose import Declaration, tools_of
from mesh.store import declarations, events, modules, plans, seats
from services.controller import metrics, rollout
from services.controller.fleet import Fleet
from services.controller.publishing import Publisher

log = logging.getLogger(__name__)

# Digests whose process names are remembered, the most recently used: every machine's
# declaration has its own digest, and a plan judges one or two per machine (after, before).
# Forgotten when the plan ends; this bounds what one very large plan keeps.
NAMES_KEPT = 16384
IDLE_CHECK = 5.0  # look for a plan this often even without being woken (a missed wake-up)
LOOK_EVERY = 1.0  # the longest the planner waits without judging deadlines


class Planner:
    def __init__(
        self, *, pool: asyncpg.Pool, publisher: Publisher, fleet: Fleet, epoch: int,
        nc: Client | None = None, obs: ObjectStore | None = None,
    ) -> None:  # fmt: skip
        self._pool = pool
        self._nc = nc  # where progress is told (mesh.plan.<id>); None: nowhere
        self._obs = obs  # the bundle store, checked before a plan starts; None: not checked
        self._publisher = publisher
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
                await self._show(None)
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
        self._tier = None  # not the last plan's
        await self._show(p)
        if p.state == "pending":
            missing = await self._missing_bundle(p)
            if missing is not None:  # no machine is touched for a bundle it cannot fetch
                await self._finish(p, "reverted" if p.settings.auto_revert else "failed", missing)
                return
            try:
                await self._start(p)
            except seats.Fenced:
                raise  # the seat moved on: this controller must stop, not fail the plan
            except wire.BadRequest as e:  # e.g. a conflict the catalog has come to since
                await self._finish(p, "failed", f"could not compose: {e}")
                return
        else:
            log.info("plan %d: continuing under epoch %d (%s)", p.id, self._epoch, p.phase)
        if p.phase == "forward":
            # A failed step already in the store (written with its plan's stop, but kept here
            # too: a plan with a failed step never rolls on).
            failure = rollout.recorded_failure(p.steps)
            for tier in rollout.tiers(p.steps):
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
            await self._show(p)
        for tier in rollout.revert_order(p.steps):
            await self._revert_tier(p, tier)
        await self._finish(p, "reverted", p.error)

    async def _start(self, p: plans.Plan) -> None:
        now = datetime.now(UTC)
        machines = [s.machine for s in p.steps]
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            composed = await self._publisher.compose(conn, machines)
            stored = await declarations.declarations(conn, machines)
            tier_of = {m: self._fleet.machines[m].tier for m in machines}
            rollout.prepare(p.steps, composed=composed, stored=stored, tier_of=tier_of, at=now)
            await plans.set_steps(conn, p.id, p.steps, epoch=self._epoch)
            await plans.set_plan(conn, p.id, state="rolling", started=now)
            await events.record(conn, "plan.started", epoch=self._epoch, plan=p.id)
        p.state, p.started = "rolling", now
        p.steps.sort(key=lambda s: (s.tier, s.machine))
        tiers = rollout.tiers(p.steps)
        log.info("plan %d (%s %s): %d machine(s) in tier(s) %s", p.id, p.trigger, p.subject,
                 len(p.steps), ", ".join(map(str, tiers)))  # fmt: skip
        await self._show(p)

    async def _missing_bundle(self, p: plans.Plan) -> str | None:
        """Why the plan cannot start, if a bundle its module needs is not in the bundle store
        (lost with JetStream's data, or purged): then every machine would fail to fetch it.
        A push of the module's folder stores it again (changes.Changes.push)."""
        if self._obs is None or p.trigger not in ("push", "assign", "rollback"):
            return None
        async with self._pool.acquire() as conn:
            current = (await modules.current_modules(conn)).get(p.subject)
        if current is None:
            return None
        for name, digest in sorted(current.bundles.items()):
            if digest.startswith("sha256:") and not await blobs.has(self._obs, digest):
                return (
                    f"bundle {name} of module {p.subject} ({digest[:19]}…) is not in the "
                    f"bundle store: push the module's folder again (mesh push DIR) to store "
                    "it, then ask again"
                )
        return None

    async def _finish(self, p: plans.Plan, state: PlanState, error: str | None) -> None:
        now = datetime.now(UTC)
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            if state == "reverted":
                taken_back = await modules.undo(conn, p.trigger, p.undo, plan_id=p.id)
                log.info("plan %d: %s", p.id, taken_back)
            await plans.set_plan(conn, p.id, state=state, finished=now, error=error)
            await events.record(conn, f"plan.{state}", epoch=self._epoch, plan=p.id, error=error)
        p.state, p.finished, p.error = state, now, error
        took = (now - p.started).total_seconds() if p.started else 0.0
        if error:
            log.info("plan %d %s after %.1fs: %s", p.id, state, took, error)
        else:
            log.info("plan %d %s in %.1fs", p.id, state, took)
        await self._show(p)  # its end told; no longer `current`

    # --- rolling forward -------------------------------------------------------------------------

    async def _roll_tier(self, p: plans.Plan, tier: int) -> str | None:
        """Roll one tier out; None when every step is done, else why the plan stops."""
        t = rollout.rolling(p.steps, tier=tier, settings=p.settings)
        if t is None:
            return None
        self._tier = tier
        resumed = rollout.resumed(t)
        if resumed:  # a step in flight when the last holder stopped: send it again
            await self._send(p, resumed, "after")
            rollout.await_(t, resumed, now=time.monotonic())
        log.info("plan %d: tier %d: %d machine(s)", p.id, tier, len(t.steps))
        await self._show(p)
        look: set[str] = {s.machine for s in resumed}
        while not t.finished:
            batch = rollout.next_batch(t)
            if batch:
                await self._send(p, batch, "after")
                rollout.await_(t, batch, now=time.monotonic())  # not those skipped: down
                look |= {s.machine for s in batch}
            if not look:
                look = await self._fleet.changes(
                    min(LOOK_EVERY, rollout.soonest(t, now=time.monotonic()))
                )
            verdict = rollout.look(
                t, machines=look, report=self._fleet.report, names=self._processes,
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
        log.info("plan %d: tier %d done", p.id, tier)
        return None

    async def _send(self, p: plans.Plan, steps: list[plans.Step], which: str) -> None:
        """Store and publish each step's `after` (or, reverting, `before`) declaration."""
        now = datetime.now(UTC)
        bodies: dict[str, tuple[str, bytes]] = {}
        for s in steps:
            if which == "after" and self._skipped_for_drain(p, s, at=now):
                continue  # nothing stored or published: it keeps what it runs
            self._fleet.wants_what_it_is_sent(s.machine)
            if which == "after":
                bodies[s.machine] = (s.after, s.after_body)
                up = self._fleet.up(s.machine)
                rollout.send(s, up=up, skip_down=p.settings.skip_down, at=now)
            else:
                bodies[s.machine] = rollout.before(s)
            self._fleet.forget_error(s.machine)  # an old failure is not this step's
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            await declarations.write_declarations(conn, bodies, epoch=self._epoch)
            await plans.set_steps(conn, p.id, steps, epoch=self._epoch)
        await self._publisher.publish(bodies)
        await self._show(p)

    def _skipped_for_drain(self, p: plans.Plan, s: plans.Step, *, at: datetime) -> bool:
        """A step whose machine is drained as it would start: skipped (rollout.skip_drained),
        and `nodes` shows what it would have got as its wanted declaration."""
        if not rollout.skip_drained(s, drained=self._fleet.drained(s.machine), at=at):
            return False
        self._fleet.skipped_for_drain(s.machine, s.after)
        log.info("plan %d: machine %s is drained: skipped", p.id, s.machine)
        return True

    async def _write(self, p: plans.Plan, steps: list[plans.Step], **plan: str) -> None:
        """Steps (and, given, the plan's own fields) in one fenced transaction."""
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            await plans.set_steps(conn, p.id, steps, epoch=self._epoch)
            if plan:
                await plans.set_plan(conn, p.id, **plan)
        await self._show(p)

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
        self._tier = tier
        log.info("plan %d: reverting tier %d: %d machine(s)", p.id, tier, len(steps))
        await self._send(p, steps, "before")
        until = time.monotonic() + p.settings.deadline
        waiting = {s.machine: s for s in steps if self._fleet.up(s.machine)}
        look = set(waiting)
        while waiting and time.monotonic() < until:
            rollout.settled(
                waiting, machines=look, report=self._fleet.report, names=self._processes
            )
            look = await self._fleet.changes(min(LOOK_EVERY, max(0.0, until - time.monotonic())))
        unsettled: dict[str, str] = {}
        for machine, s in waiting.items():
            digest, body = rollout.before(s)
            unsettled[machine] = rollout.why(
                machine=machine, report=self._fleet.report(machine), digest=digest,
                names=self._processes(digest, body), deadline=p.settings.deadline,
            )  # fmt: skip
        rollout.reverted(steps, unsettled=unsettled)
        await self._write(p, steps)

    # --- judging a machine ---------------------------------------------------------------------

    def _processes(self, digest: str, body: bytes) -> frozenset[str]:
        names = self._names.pop(digest, None)
        if names is None:
            decl = msgspec.json.decode(body, type=Declaration)
            # tool servers too: a plan waits until each is ready (initialized, tools listed)
            names = frozenset(decl.processes) | frozenset(tools_of(decl))
            if len(self._names) >= NAMES_KEPT:  # forget the least recently used
                del self._names[next(iter(self._names))]
        self._names[digest] = names  # last: the most recently used
        return names

    # --- what status shows -----------------------------------------------------------------------

    async def _show(self, p: plans.Plan | None) -> None:
        """What `status` shows, and the same summary told on mesh.plan.<id> with each tier's
        counts: every step or tier change passes here, so a watcher (the console, `--wait`)
        hears each one."""
        if p is None:
            self.current = None
            return
        summary = PlanSummary(
            id=p.id, state=p.state, trigger=p.trigger, subject=p.subject, by=p.by,
            created=p.created, finished=p.finished, machines=len(p.steps),
            done=sum(s.state in ("done", "skipped") for s in p.steps), tier=self._tier,
            phase=p.phase, failure=p.error,
        )  # fmt: skip
        self.current = summary if p.state in plans.OPEN else None
        if self._nc is None:
            return
        tiers = [rollout.tier_shown(t) for t in rollout.tier_counts(p.steps)]
        told = PlanProgress(**msgspec.structs.asdict(summary), tiers=tiers)
        try:
            await self._nc.publish(subjects.plan(p.id), wire.encode(told))
        except Exception as e:  # told, not stored: a lost one costs a watcher a refresh
            log.debug("plan %d: progress not told: %s: %s", p.id, type(e).__name__, e)


def _count_finished(steps: list[plans.Step]) -> None:
    """Each step that has just ended, in the plan step histogram (once: a step that ended is
    not judged again)."""
    for s in steps:
        if s.state in ("done", "failed") and s.started and s.finished:
            took = (s.finished - s.started).total_seconds()
            metrics.PLAN_STEP_SECONDS.labels(s.state).observe(max(0.0, took))
