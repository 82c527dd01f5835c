"""The holder's view of the fleet: machines, their heartbeats, and up/down transitions.

Heartbeats are kept in memory and written to the store in batches; only registrations and
up/down transitions are written at once, each with an event. A machine is down after
`down_after` of its own beat intervals without a beat, and up again at its next beat. What one
machine can make us write is bounded (REGISTER_BURST, CHANGE_BURST): a host that registers or
comes and goes in a loop costs a few rows and one log line a window, not one of each per message.
"""

import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

import anyio
import asyncpg
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from mesh import bus, subjects, wire
from mesh.batching import Batches
from mesh.model import (
    Beat,
    MachineChanged,
    Node,
    NodeCounts,
    ProcessState,
    Register,
    ToolServerReport,
    labels_said,
)
from mesh.ratelimit import PerKey
from mesh.store import db, events, machines, seats
from mesh.store.machines import MachineRow
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECK_EVERY = 0.25
FLUSH_EVERY = 5.0
# Registrations written in one transaction at most. A takeover's storm of ten thousand is a
# handful of batches; each holds the fleet's lock (and the beats' judgement) for tens of ms.
REGISTER_BATCH = 1000
# After a takeover the fleet registers again, each host at a random moment of the window the
# `held` announcement gives (services/host/registration.py): this many a second, at most
# REGISTER_WINDOW seconds in all; a fleet that fits in one batch asks at once.
REGISTER_RATE = 2000.0
TRANSITIONS_LOGGED = 10  # machines named a batch of registrations, ups or downs; the rest counted
REGISTER_WINDOW = 5.0
MAX_LABELS = 64  # as a registration could carry (mesh.model.Labels)
# What one machine can make the holder write and log (mesh/ratelimit.py). A host registers at
# its start and once per new holder; one registering in a loop (a crash loop, or a compromised
# machine: 5,000 registrations were 5,000 rows and log lines) has REGISTER_BURST written at
# once, then one each REGISTER_EVERY seconds. The rest are answered from memory, the newest
# written when its turn comes, and counted in one line per window.
REGISTER_BURST = 3
REGISTER_EVERY = 10.0
# Likewise its changes between up and down (each a row, an event and a line): a machine that
# comes and goes faster than this is held in its state until its next turn.
CHANGE_BURST = 4  # two whole outages
CHANGE_EVERY = 10.0


def open_bus(nc: Client) -> bool:
    """Whether the NATS server admits clients without credentials: its INFO has no
    `auth_required`, or this controller itself connected without any (a server whose only
    users are the system account's kicker, mesh/auth/system.py, says `auth_required` and
    still admits everyone else). On such a bus anyone may call `mesh tier` and `mesh label`, so
    a host's own word on its tier and labels gives nothing away; under authentication it
    counts for nothing (Kubernetes' NodeRestriction: a kubelet may not set the labels that
    steer work)."""
    return not nc._server_info.get("auth_required", False) or not bus.authenticated(nc)


async def tell_changed(nc: Client | None, changed: MachineChanged) -> None:
    """Tell watchers (the console) that a machine changed where no host reports it: drained,
    undrained, or skipped by a plan for its drain (what it wants changed)."""
    if nc is None:
        return
    try:
        await nc.publish(subjects.machine(changed.machine), wire.encode(changed))
    except Exception as e:  # told, not stored: a watcher that missed it asks `nodes` later
        log.debug("machine %s: change not told: %s: %s", changed.machine, type(e).__name__, e)


class Arrivals:
    """When beats reached this controller, as against when it handled them: a busy controller
    (a takeover's registrations, a flood of verbs) handles beats late, and a machine whose
    beat waits in the queue has not missed it. Marked at every check with how many beats the
    subscription had received by then; `handled_until(t)` is the latest time up to which every
    beat received has been handled."""

    KEEP = 60.0  # seconds of marks kept (a controller further behind than this is stalled)

    def __init__(self) -> None:
        self.sub: Subscription | None = None
        self._marks: deque[tuple[float, int]] = deque()  # (monotonic time, beats received)

    def mark(self, now: float) -> None:
        if self.sub is None:
            return
        self._marks.append((now, self.sub.delivered))
        while self._marks and self._marks[0][0] < now - self.KEEP:
            self._marks.popleft()

    def handled_until(self, until: float) -> float:
        """`until`, or earlier: the last mark at or before it whose beats have all been handled
        (received and no longer waiting in the queue)."""
        if self.sub is None:
            return until
        handled = self.sub.delivered - self.sub.pending_msgs
        best = float("-inf")
        for when, received in self._marks:
            if when > until or received > handled:
                break
            best = when
        return best


class Fleet:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        epoch: int,
        down_after: int = 3,
        open_bus: Callable[[], bool] = lambda: False,
        bus_answered: Callable[[], float] = time.monotonic,
        noisy: Callable[[str], bool] = lambda _: False,
    ) -> None:
        self._pool = pool
        self._noisy = noisy  # whether a machine sent more than its budget lately (noisy.py)
        # When the holder's last answered NATS round trip was sent (every beat sent before it
        # had reached us): a machine is judged down only once the bus has answered since its
        # beat was due, or a holder cut off from NATS (or behind a host's flood, its beats
        # queued ahead of the answer) would mark the fleet down.
        self._bus_answered = bus_answered
        self._epoch = epoch
        self._down_after = down_after
        self._open_bus = open_bus  # asked at each registration: a server reload may add auth
        # Told of a machine registered for the first time (its labels before: None) or labelled
        # (changes/following.py places it by its labels).
        self.relabelled: Callable[[str, dict[str, str] | None, dict[str, str]], None] = lambda *_: (
            None
        )
        self.machines: dict[str, MachineRow] = {}
        # The names of up machines, kept beside `machines` so `status` costs the same for a
        # fleet of any size (bench/verbs.py: walking 1000 machines per call halved its rate).
        self._up: set[str] = set()
        # (tier, name) of every machine, kept sorted as machines come and move: `nodes`
        # answers a page from its place here (mesh/paging.py), never sorting the fleet.
        self.order: list[tuple[int, str]] = []
        self._beat_at: dict[str, float] = {}  # monotonic time of the last beat (or takeover)
        self._unflushed: dict[str, datetime] = {}
        self._unknown_logged: set[str] = set()
        self._unknown_heard: list[str] = []  # beating before registering: not logged yet
        self._registered: dict[str, Register] = {}  # machine -> its last registration written
        self._registering = PerKey[str](burst=REGISTER_BURST, every=REGISTER_EVERY)
        self._held_back: dict[str, Register] = {}  # machine -> its newest registration not written
        self._late: set[str] = set()  # held-back registrations being written: said in the count
        self._changing_state = PerKey[str](burst=CHANGE_BURST, every=CHANGE_EVERY)
        self._claims_logged: set[str] = set()  # machines whose own tier/labels were not taken
        # Registrations and up/down transitions come from three tasks (verbs, beats, watch);
        # one at a time keeps memory, the store and the event order in agreement.
        self._changing = anyio.Lock()
        self.applied: dict[str, str] = {}  # machine -> digest it reports applied
        self.processes: dict[str, list[ProcessState]] = {}  # machine -> as it last reported
        self.apply_errors: dict[str, str] = {}  # machine -> where and why its apply stopped
        # machine -> its tool servers and their tools, as it last reported (in memory: a new
        # holder hears them again, since every host reports them when it says `held`)
        self.tools: dict[str, list[ToolServerReport]] = {}
        self.failed_digest: dict[str, str] = {}  # machine -> the digest whose apply stopped
        # Drained machine -> what the catalog composed for it when a plan skipped it for the
        # drain (`nodes` shows it as wanted; the store says it again at takeover).
        self.wanted_while_drained: dict[str, str] = {}
        # Machines whose applied digest, processes or liveness changed since the planner last
        # looked: it re-judges only those, so a tier of a thousand machines costs per event.
        self._touched: set[str] = set()
        self._touch = anyio.Event()
        self._registrations: Batches[str, Register, MachineRow] = Batches(
            key=lambda req: req.name, write=self._register_batch, most=REGISTER_BATCH,
            stopped=lambda: wire.BadRequest(
                "the controller stopped holding the seat; try again", code="unavailable"
            ),
        )  # fmt: skip
        self._transitions: Batches[str, tuple[str, bool, datetime], None] = Batches(
            key=lambda change: change[0], write=self._write_transitions, most=REGISTER_BATCH,
            stopped=lambda: wire.BadRequest("the controller stopped holding the seat"),
        )  # fmt: skip
        self.arrivals = Arrivals()  # the beats' subscription, set once subscribed (reports.py)

    def touch(self, machine: str) -> None:
        self._touched.add(machine)
        self._touch.set()

    async def changes(self, within: float) -> set[str]:
        """The machines touched since the last call, waiting up to `within` for one."""
        if not self._touched:
            with anyio.move_on_after(within):
                await self._touch.wait()
        touched, self._touched = self._touched, set()
        self._touch = anyio.Event()
        return touched

    def up(self, machine: str) -> bool:
        return machine in self._up

    def heard_applied(
        self, name: str, digest: str, error: str | None, processes: list[ProcessState]
    ) -> None:
        self.processes[name] = processes
        if error is None:
            self.applied[name] = digest
            self.apply_errors.pop(name, None)
            self.failed_digest.pop(name, None)
        else:
            self.apply_errors[name] = error
            self.failed_digest[name] = digest
        self.touch(name)

    def forget_error(self, name: str) -> None:
        self.apply_errors.pop(name, None)
        self.failed_digest.pop(name, None)

    def heard_tools(self, name: str, servers: list[ToolServerReport]) -> None:
        if name in self.machines:  # a machine that registered: not any name a subject carries
            self.tools[name] = servers

    def heard_processes(self, name: str, processes: list[ProcessState]) -> None:
        self.processes[name] = processes
        self.touch(name)

    async def load(self) -> None:
        """Read the fleet from the store at takeover; up machines get a full threshold to beat."""
        self.machines = {m.name: m for m in await machines.all_machines(self._pool)}
        self.order = sorted((m.tier, m.name) for m in self.machines.values())
        self._up = {name for name, m in self.machines.items() if m.up}
        if any(m.drained for m in self.machines.values()):
            self.wanted_while_drained = await machines.wanted_while_drained(self._pool)
        self.forgive()

    def forgive(self) -> None:
        """Judge nobody on the silence just past: after a takeover, a reconnect to NATS, or a
        stall of this process, beats were lost by us, not by the machines."""
        self._beat_at = dict.fromkeys(self.machines, time.monotonic())

    async def register(self, req: Register) -> MachineRow:
        """Register a machine: written with the others that came meanwhile, in one batch. The
        same registration again, while the machine is up, is answered from memory: a host
        asking again because our answer came after its window (a cold start of ten thousand)
        would otherwise be written again, and again, each retry more work than the last. A
        known machine past its allowance (REGISTER_BURST) is answered from memory too, and its
        newest registration is written when its turn comes (`_write_held_back`)."""
        if self._registered.get(req.name) == req and req.name in self._up:
            self._beat_at[req.name] = time.monotonic()  # registering is a sign of life
            return self.machines[req.name]
        known = self.machines.get(req.name)
        if known is not None and not self._registering.allows(req.name):
            self._held_back[req.name] = req
            self._registering.hold(req.name)
            self._beat_at[req.name] = time.monotonic()
            return known  # its tier and labels are the operator's: the answer is the same
        self._held_back.pop(req.name, None)  # this one is newer
        return await self._registrations.submit(req)

    def _write_held_back(self) -> None:
        """Held-back registrations whose machine has its turn again, into the next batch
        (whose writer says its own failures: nobody waits for these)."""
        for name in [n for n in self._held_back if self._registering.allows(n)]:
            req = self._held_back.pop(name)
            if self._registrations.put(req) is None:
                return  # no longer writing: the seat's next holder hears from the host
            self._late.add(name)

    async def _register_batch(self, reqs: list[Register]) -> dict[str, MachineRow]:
        async with self._changing:
            try:
                return await self._write_registrations(reqs)
            except (*db.GONE, asyncpg.PostgresError) as e:
                # Said once for the batch; every host of it hears `unavailable` and asks again
                # after its pause (services/host/registration.py).
                log.warning("could not write %d registration(s); they will be asked again: "
                            "%s: %s", len(reqs), type(e).__name__, e)  # fmt: skip
                raise wire.BadRequest(
                    f"the store did not take the registration ({type(e).__name__}); try again",
                    code="unavailable",
                ) from None

    async def _write_registrations(self, reqs: list[Register]) -> dict[str, MachineRow]:
        trusted = self._open_bus()
        was = {req.name: self.machines.get(req.name) for req in reqs}
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await machines.register_many(
                conn,
                [
                    machines.Registration(
                        name=req.name, facts=req.facts, beat_interval=req.beat_interval,
                        version=req.version, claimed_tier=req.tier if trusted else None,
                        claimed_labels=req.labels if trusted else None,
                    )
                    for req in reqs
                ],
            )  # fmt: skip
            by_name = {row.name: row for row in rows}
            recorded: list[tuple[str, str | None, int | None, dict[str, object]]] = []
            for req in reqs:
                recorded.append(("machine.registered", req.name, self._epoch,
                                 {"tier": by_name[req.name].tier}))  # fmt: skip
                before = was[req.name]
                if before is not None and not before.up:
                    recorded.append(("machine.up", req.name, self._epoch, {}))
            await events.record_many(conn, recorded)
        now = time.monotonic()
        again, new = 0, 0
        for req in reqs:
            self._registering.spend(req.name)  # what was written counts, whoever asked for it
            row, before = by_name[req.name], was[req.name]
            self.machines[req.name] = row
            self._place(req.name, was=before.tier if before is not None else None, tier=row.tier)
            if req.applied:  # what it had when it asked: an applied event heard meanwhile is newer
                self.applied.setdefault(req.name, req.applied)
            self.touch(req.name)
            self._up.add(req.name)  # registering is a sign of life
            self._beat_at[req.name] = now
            self._unknown_logged.discard(req.name)
            self._registered[req.name] = req
            if before is None:
                self.relabelled(req.name, None, row.labels)
            if req.name in self._late:
                self._late.discard(req.name)  # said in its window's count (`_say_held_back`)
            elif before is not None and before.up and before.tier == row.tier:
                again += 1  # a known machine saying hello to a new holder: counted, not logged
            else:
                new += 1  # named up to TRANSITIONS_LOGGED a batch: a cold start of thousands
                if new <= TRANSITIONS_LOGGED:
                    log.info("machine %s registered (tier %d, pid %d)", req.name, row.tier,
                             req.pid)  # fmt: skip
            self._log_claims(req, row)
        if new > TRANSITIONS_LOGGED:
            log.info("... and %d more machine(s) registered", new - TRANSITIONS_LOGGED)
        if again:
            log.info("%d machine(s) registered again%s", again,
                     f" (in a batch of {len(reqs)})" if len(reqs) > again else "")  # fmt: skip
        return by_name

    def _log_claims(self, req: Register, row: MachineRow) -> None:
        ignored = req.tier not in (None, row.tier) or (
            bool(req.labels) and req.labels != row.labels
        )
        if ignored and req.name not in self._claims_logged:
            self._claims_logged.add(req.name)
            log.info(
                "machine %s asked for tier %s and labels %s: it keeps tier %d and labels %s "
                "(the operator's: mesh tier, mesh label)",
                req.name, req.tier, req.labels, row.tier, row.labels,
            )  # fmt: skip

    @contextlib.asynccontextmanager
    async def _placing(
        self, name: str
    ) -> AsyncIterator[tuple[asyncpg.Connection, machines.Placement | None]]:
        """A fenced transaction changing machine `name`'s tier or labels, with its placement
        (as stored, or the default) if it has not registered: None if it has (`machines`)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            if name in self.machines:
                yield conn, None
            else:
                yield conn, await machines.placement(conn, name) or machines.Placement()

    async def set_tier(self, name: str, tier: int, audit: Audit) -> tuple[int, bool]:
        """Move a machine to another tier (plans recorded from now on use it), or place one
        that has not registered yet; the old tier, and whether it is registered."""
        async with self._changing:
            m = self.machines.get(name)
            async with self._placing(name) as (conn, placed):
                if placed is not None:
                    was = placed.tier
                    await machines.place(conn, name=name, tier=tier, labels=placed.labels)
                else:
                    was = m.tier
                    await machines.set_tier(conn, name=name, tier=tier)
                await events.record(conn, "machine.tier", machine=name, epoch=self._epoch,
                                    tier=tier, was=was, registered=m is not None)  # fmt: skip
                await audit.write(conn, detail=f"tier {tier} (was {was})")
            if m is not None:
                self._place(name, was=m.tier, tier=tier)
                m.tier = tier
        log.info("machine %s moved from tier %d to tier %d%s", name, was, tier,
                 "" if m is not None else " (for its first registration)")  # fmt: skip
        return was, m is not None

    def _place(self, name: str, *, was: int | None, tier: int) -> None:
        """Keep `order` sorted: a new machine goes in at its place, a moved one moves."""
        if was == tier:
            return
        if was is not None:
            at = bisect.bisect_left(self.order, (was, name))
            if at < len(self.order) and self.order[at] == (was, name):
                del self.order[at]
        bisect.insort(self.order, (tier, name))

    async def set_labels(
        self, name: str, *, add: dict[str, str], remove: list[str], audit: Audit
    ) -> tuple[dict[str, str], dict[str, str], bool]:
        """Set and remove labels of a machine, or of one that has not registered yet (its first
        registration takes them); (labels, the labels it had, whether it is registered)."""
        both = sorted(set(add) & set(remove))
        if both:
            raise wire.BadRequest(f"label {both[0]}: both set and removed")
        async with self._changing:
            m = self.machines.get(name)
            async with self._placing(name) as (conn, placed):
                was = dict((placed or m).labels)  # type: ignore[union-attr]  # one of the two
                labels = {k: v for k, v in {**was, **add}.items() if k not in remove}
                if len(labels) > MAX_LABELS:
                    raise wire.BadRequest(
                        f"labels: machine {name} would carry {len(labels)} labels, "
                        f"at most {MAX_LABELS}"
                    )
                if placed is not None:
                    await machines.place(conn, name=name, tier=placed.tier, labels=labels)
                else:
                    await machines.set_labels(conn, name=name, labels=labels)
                await events.record(conn, "machine.labels", machine=name, epoch=self._epoch,
                                    labels=labels, was=was, registered=m is not None)  # fmt: skip
                await audit.write(
                    conn, detail=f"labels {labels_said(labels)} (were {labels_said(was)})"[:200]
                )
            if m is not None:
                m.labels = labels
                self.relabelled(name, was, labels)
        log.info("machine %s labels %s (were %s)%s", name, labels, was,
                 "" if m is not None else " for its first registration")  # fmt: skip
        return labels, was, m is not None

    # --- drained machines -----------------------------------------------------------------------

    def drained(self, name: str) -> bool:
        m = self.machines.get(name)
        return m is not None and m.drained

    async def set_drained(
        self,
        name: str,
        *,
        drained: bool,
        by: str,
        then: Callable[[asyncpg.Connection], Awaitable[T]],
    ) -> tuple[bool, T]:
        """Drain a machine (or undrain it) in one fenced transaction with its event and `then`
        (the plan that brings an undrained machine up to date); whether it was drained before,
        and what `then` gave. Memory follows the store, under the lock registrations take: a
        registration written meanwhile carries the flag as the store has it."""
        async with self._changing:
            m = self.machines.get(name)
            if m is None:
                raise wire.BadRequest(f"machine {name} is not registered", code="not_found")
            was = m.drained
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                await machines.set_drained(conn, name=name, drained=drained)
                await events.record(conn, "machine.drained" if drained else "machine.undrained",
                                    machine=name, epoch=self._epoch, by=by, was=was)  # fmt: skip
                then_gave = await then(conn)
            m.drained = drained
        log.info("machine %s %s%s", name, "drained" if drained else "undrained",
                 "" if was != drained else " (it already was)")  # fmt: skip
        return was, then_gave

    def drained_count(self) -> int:
        return sum(m.drained for m in self.machines.values())

    def skipped_for_drain(self, name: str, digest: str) -> None:
        """A plan skipped this drained machine, which would have got `digest`."""
        self.wanted_while_drained[name] = digest

    def wants_what_it_is_sent(self, name: str) -> None:
        """A declaration is published for the machine (or none is left to bring it): `nodes`
        shows what was published as wanted again."""
        self.wanted_while_drained.pop(name, None)

    def beat(self, beat: Beat) -> None:
        m = self.machines.get(beat.name)
        if m is None:
            if beat.name not in self._unknown_logged:  # said by `watch`, many in one line
                self._unknown_logged.add(beat.name)
                self._unknown_heard.append(beat.name)
            return
        now = datetime.now(UTC)
        self._beat_at[beat.name] = time.monotonic()
        m.last_seen = now
        m.beat_interval = beat.interval
        if not m.up:
            self._change(beat.name, True, now)
        else:
            self._unflushed[beat.name] = now

    def _change(self, name: str, up: bool, at: datetime) -> None:
        """Up or down, into the next batch, if the machine has its turn (CHANGE_BURST): else
        it stays as it is until then (its next beat, or check, asks again). Never waits."""
        if self._changing_state.allows(name):
            self._transitions.put((name, up, at))
        else:
            self._changing_state.hold(name)

    async def _write_transitions(
        self, changes: list[tuple[str, bool, datetime]]
    ) -> dict[str, None]:
        """Machines up or down, in one transaction (a fleet coming back after an outage is
        thousands at once); memory follows once the store has them."""
        async with self._changing:
            todo = [
                (m, up, at)
                for name, up, at in changes
                if (m := self.machines.get(name)) is not None and m.up != up
            ]  # a registration, or the other way back, may have got there first
            if not todo:
                return {}
            try:
                async with self._pool.acquire() as conn, conn.transaction():
                    await machines.set_up_many(
                        conn, [(m.name, up, m.last_seen or at) for m, up, at in todo]
                    )
                    await events.record_many(conn, [
                        ("machine.up" if up else "machine.down", m.name, self._epoch, {})
                        for m, up, _ in todo
                    ])  # fmt: skip
            except (*db.GONE, asyncpg.PostgresError) as e:
                # Not in memory either: the next beat (or check) asks again.
                log.warning("could not record %d machine(s) up or down: %s", len(todo), e)
                return {}
            for m, up, _ in todo:
                self._changing_state.spend(m.name)
                m.up = up  # only once the store has it
                (self._up.add if up else self._up.discard)(m.name)
                self.touch(m.name)
                self._unflushed.pop(m.name, None)
        for up in (True, False):
            names = [m.name for m, u, _ in todo if u == up]
            how = "up" if up else "down (missed heartbeats)"
            for name in names[:TRANSITIONS_LOGGED]:
                log.info("machine %s is %s", name, how)
            if len(names) > TRANSITIONS_LOGGED:
                log.info("... and %d more machine(s) %s", len(names) - TRANSITIONS_LOGGED, how)
        return {}

    async def run(self) -> None:
        """The holder's fleet work, until cancelled: registrations written in batches, beats
        judged, last-seen times flushed."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._registrations.run)
            tg.start_soon(self._transitions.run)
            tg.start_soon(self.watch)

    async def watch(self) -> None:
        """Mark machines down that missed their beats; batch last-seen times to the store."""
        flushed = tick = time.monotonic()
        while True:
            await anyio.sleep(CHECK_EVERY)
            now = time.monotonic()
            if now - tick > 4 * CHECK_EVERY:
                log.info("this controller stalled for %.1fs: heartbeat clocks restart", now - tick)
                self.forgive()
            tick = now
            self._log_unknown()
            self.arrivals.mark(now)
            # Judged at the last time at which both hold: NATS answered a round trip we sent
            # then (so every beat sent before it had reached us), and we had handled every beat
            # that had reached us by then. A beat still waiting in a queue is not a missed one.
            judged = self.arrivals.handled_until(self._bus_answered())
            at = datetime.now(UTC)
            for m in self.machines.values():
                due = self._beat_at.get(m.name, now) + self._down_after * m.beat_interval
                if m.up and due < judged:
                    self._change(m.name, False, at)
            self._write_held_back()
            self._say_held_back()
            if now - flushed >= FLUSH_EVERY:
                await self.flush()
                flushed = now

    def _say_held_back(self) -> None:
        """Once per window, the machines held back in it: one line for each of the first few,
        with how many of its registrations were answered from memory; one for the rest."""
        registered = self._registering.held()
        if registered:
            named = sorted(registered.items(), key=lambda kv: -kv[1])
            for name, n in named[:TRANSITIONS_LOGGED]:
                log.warning(
                    "machine %s: %d registration(s) in the last %gs answered from memory, "
                    "not written (a machine's are written %d at once, then one each %gs, its "
                    "newest in turn): a host restarting in a loop, or one not behaving as a host",
                    name, n, REGISTER_EVERY, REGISTER_BURST, REGISTER_EVERY,
                )  # fmt: skip
            if len(named) > TRANSITIONS_LOGGED:
                log.warning("... and %d more machine(s) (%d registrations) held back likewise",
                            len(named) - TRANSITIONS_LOGGED,
                            sum(n for _, n in named[TRANSITIONS_LOGGED:]))  # fmt: skip
        changed = self._changing_state.held()
        if changed:
            names = sorted(changed)
            more = len(names) - TRANSITIONS_LOGGED
            log.warning(
                "machine(s) %s went up and down more than %d times within %gs: each is "
                "written up or down at most once each %gs until it settles",
                ", ".join(names[:TRANSITIONS_LOGGED]) + (f" and {more} more" if more > 0 else ""),
                CHANGE_BURST, CHANGE_EVERY, CHANGE_EVERY,
            )  # fmt: skip

    def _log_unknown(self) -> None:
        """Hosts beat from their start, before they have registered: in a cold start of ten
        thousand, one line for them all, not one each."""
        heard, self._unknown_heard = self._unknown_heard, []
        if heard:
            shown = ", ".join(heard[:TRANSITIONS_LOGGED])
            more = (
                f" and {len(heard) - TRANSITIONS_LOGGED} more"
                if len(heard) > TRANSITIONS_LOGGED
                else ""
            )
            log.info("beats from unregistered machine(s) %s%s ignored until they register",
                     shown, more)  # fmt: skip

    async def flush(self) -> None:
        """Last-seen times to the store. One that cannot be written now goes with the next
        flush: a store that is gone is for the seat's lock to notice (seat/lock.py), not this."""
        seen, self._unflushed = self._unflushed, {}
        if not seen:
            return
        try:
            # With the other writes of many machines' rows, one at a time: two statements
            # locking the same rows in different orders deadlock (a takeover's registrations
            # beside this flush did, bench/scale.py at 10,000 machines).
            async with self._changing, self._pool.acquire() as conn:
                await machines.touch_many(conn, seen)
        except (*db.GONE, asyncpg.PostgresError) as e:
            log.warning("could not write %d last-seen time(s); with the next: %s", len(seen), e)
            self._unflushed = {**seen, **self._unflushed}

    def registration_window(self) -> float:
        """Seconds over which the fleet should spread its registrations with a new holder."""
        n = len(self.machines)
        return 0.0 if n <= REGISTER_BATCH else min(REGISTER_WINDOW, n / REGISTER_RATE)

    def counts(self) -> NodeCounts:
        total, up = len(self.machines), len(self._up)
        return NodeCounts(total=total, up=up, down=total - up)

    def node(self, name: str, *, wanted: dict[str, str]) -> Node:
        """A machine as `nodes` shows it; `wanted` is the digest published for each machine."""
        m = self.machines[name]
        return Node(
            name=m.name,
            tier=m.tier,
            labels=m.labels,
            up=m.up,
            last_seen=m.last_seen,
            facts=m.facts,
            processes=self.processes.get(m.name, []),
            digest_wanted=self.wanted_while_drained.get(m.name) or wanted.get(m.name),
            digest_applied=self.applied.get(m.name),
            apply_error=self.apply_errors.get(m.name),
            version=m.version,
            drained=m.drained,
            noisy=self._noisy(m.name),
        )
