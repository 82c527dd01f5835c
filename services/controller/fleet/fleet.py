"""The holder's view of the fleet: machines, their heartbeats, and up/down transitions.

Heartbeats are kept in memory and written to the store in batches; up/down transitions are
written at once, each with an event. A machine is down after `down_after` of its own beat
intervals without a beat, and up again at its next beat. What one machine can make us write is
bounded (CHANGE_BURST): a host that comes and goes in a loop costs a few rows and one log line a
window, not one of each per message. Registrations are registering.py's, and an operator's
placement (tier, labels, drain) placing.py's; both keep this memory.
"""

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime

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
    ToolServerReport,
)
from mesh.ratelimit import PerKey
from mesh.store import db, events, machines
from mesh.store.machines import MachineRow

log = logging.getLogger(__name__)

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
# What one machine can make the holder write by coming and going (each change between up and
# down a row, an event and a line; mesh/ratelimit.py): a machine that comes and goes faster
# than this is held in its state until its next turn.
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
        # Told of a machine registered for the first time (its labels before: None) or labelled
        # (changes/following.py places it by its labels).
        self.relabelled: Callable[[str, dict[str, str] | None, dict[str, str]], None] = lambda *_: (
            None
        )
        self.machines: dict[str, MachineRow] = {}
        # The names of up machines, kept beside `machines` so `status` costs the same for a
        # fleet of any size (bench/verbs.py: walking 1000 machines per call halved its rate).
        self.up_names: set[str] = set()
        # (tier, name) of every machine, kept sorted as machines come and move: `nodes`
        # answers a page from its place here (mesh/paging.py), never sorting the fleet.
        self.order: list[tuple[int, str]] = []
        self.beat_at: dict[str, float] = {}  # monotonic time of the last beat (or takeover)
        self._unflushed: dict[str, datetime] = {}
        self.unknown_logged: set[str] = set()
        self._unknown_heard: list[str] = []  # beating before registering: not logged yet
        self._changing_state = PerKey[str](burst=CHANGE_BURST, every=CHANGE_EVERY)
        # Registrations and up/down transitions come from three tasks (verbs, beats, watch);
        # one at a time keeps memory, the store and the event order in agreement.
        self.changing = anyio.Lock()
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
        return machine in self.up_names

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
        self.up_names = {name for name, m in self.machines.items() if m.up}
        if any(m.drained for m in self.machines.values()):
            self.wanted_while_drained = await machines.wanted_while_drained(self._pool)
        self.forgive()

    def forgive(self) -> None:
        """Judge nobody on the silence just past: after a takeover, a reconnect to NATS, or a
        stall of this process, beats were lost by us, not by the machines."""
        self.beat_at = dict.fromkeys(self.machines, time.monotonic())

    def place(self, name: str, *, was: int | None, tier: int) -> None:
        """Keep `order` sorted: a new machine goes in at its place, a moved one moves."""
        if was == tier:
            return
        if was is not None:
            at = bisect.bisect_left(self.order, (was, name))
            if at < len(self.order) and self.order[at] == (was, name):
                del self.order[at]
        bisect.insort(self.order, (tier, name))

    # --- drained machines -----------------------------------------------------------------------

    def drained(self, name: str) -> bool:
        m = self.machines.get(name)
        return m is not None and m.drained

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
            if beat.name not in self.unknown_logged:  # said by `watch`, many in one line
                self.unknown_logged.add(beat.name)
                self._unknown_heard.append(beat.name)
            return
        now = datetime.now(UTC)
        self.beat_at[beat.name] = time.monotonic()
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
        async with self.changing:
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
                (self.up_names.add if up else self.up_names.discard)(m.name)
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
                due = self.beat_at.get(m.name, now) + self._down_after * m.beat_interval
                if m.up and due < judged:
                    self._change(m.name, False, at)
            self._say_changing()
            if now - flushed >= FLUSH_EVERY:
                await self.flush()
                flushed = now

    def _say_changing(self) -> None:
        """Once per window, the machines whose ups and downs were held back in it."""
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
            async with self.changing, self._pool.acquire() as conn:
                await machines.touch_many(conn, seen)
        except (*db.GONE, asyncpg.PostgresError) as e:
            log.warning("could not write %d last-seen time(s); with the next: %s", len(seen), e)
            self._unflushed = {**seen, **self._unflushed}

    def registration_window(self) -> float:
        """Seconds over which the fleet should spread its registrations with a new holder."""
        n = len(self.machines)
        return 0.0 if n <= REGISTER_BATCH else min(REGISTER_WINDOW, n / REGISTER_RATE)

    def counts(self) -> NodeCounts:
        total, up = len(self.machines), len(self.up_names)
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
