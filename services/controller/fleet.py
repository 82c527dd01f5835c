"""The holder's view of the fleet: machines, their heartbeats, and up/down transitions.

Heartbeats are kept in memory and written to the store in batches; only registrations and
up/down transitions are written at once, each with an event. A machine is down after
`down_after` of its own beat intervals without a beat, and up again at its next beat.
"""

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

import anyio
import asyncpg
from nats.aio.client import Client

from mesh import wire
from mesh.model import Beat, Node, NodeCounts, ProcessState, Register, ToolServerReport
from mesh.store import events, machines, seats
from mesh.store.machines import MachineRow
from services.controller.rollout import Report

log = logging.getLogger(__name__)

CHECK_EVERY = 0.25
FLUSH_EVERY = 5.0
MAX_LABELS = 64  # as a registration could carry (mesh.model.Labels)


def open_bus(nc: Client) -> bool:
    """Whether the NATS server admits clients without credentials (its INFO has no
    `auth_required`). On such a bus anyone may call `mesh tier` and `mesh label`, so a host's
    own word on its tier and labels gives nothing away; under authentication it counts for
    nothing (Kubernetes' NodeRestriction: a kubelet may not set the labels that steer work)."""
    return not nc._server_info.get("auth_required", False)


class Fleet:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        epoch: int,
        down_after: int = 3,
        open_bus: Callable[[], bool] = lambda: False,
        bus_answered: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        # When NATS last answered the holder's own round trips: a machine is judged down only
        # once the bus has answered since its beat was due, or a holder cut off from NATS
        # would mark the whole fleet down before stepping down.
        self._bus_answered = bus_answered
        self._epoch = epoch
        self._down_after = down_after
        self._open_bus = open_bus  # asked at each registration: a server reload may add auth
        self.machines: dict[str, MachineRow] = {}
        # The names of up machines, kept beside `machines` so `status` costs the same for a
        # fleet of any size (bench/verbs.py: walking 1000 machines per call halved its rate).
        self._up: set[str] = set()
        self._beat_at: dict[str, float] = {}  # monotonic time of the last beat (or takeover)
        self._unflushed: dict[str, datetime] = {}
        self._unknown_logged: set[str] = set()
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
        # Machines whose applied digest, processes or liveness changed since the planner last
        # looked: it re-judges only those, so a tier of a thousand machines costs per event.
        self._touched: set[str] = set()
        self._touch = anyio.Event()

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

    def report(self, name: str) -> Report:
        """What this fleet last heard of a machine, as the planner's rules (rollout.py) take it."""
        return Report(
            up=name in self._up,
            applied=self.applied.get(name),
            failed=self.failed_digest.get(name),
            error=self.apply_errors.get(name),
            processes=self.processes.get(name, []),
        )

    def heard_tools(self, name: str, servers: list[ToolServerReport]) -> None:
        if name in self.machines:  # a machine that registered: not any name a subject carries
            self.tools[name] = servers

    def heard_processes(self, name: str, processes: list[ProcessState]) -> None:
        self.processes[name] = processes
        self.touch(name)

    async def load(self) -> None:
        """Read the fleet from the store at takeover; up machines get a full threshold to beat."""
        self.machines = {m.name: m for m in await machines.all_machines(self._pool)}
        self._up = {name for name, m in self.machines.items() if m.up}
        self.forgive()

    def forgive(self) -> None:
        """Judge nobody on the silence just past: after a takeover, a reconnect to NATS, or a
        stall of this process, beats were lost by us, not by the machines."""
        self._beat_at = dict.fromkeys(self.machines, time.monotonic())

    async def register(self, req: Register) -> MachineRow:
        async with self._changing:
            return await self._register(req)

    async def _register(self, req: Register) -> MachineRow:
        was = self.machines.get(req.name)
        trusted = self._open_bus()
        async with self._pool.acquire() as conn, conn.transaction():
            row = await machines.register(
                conn,
                name=req.name,
                facts=req.facts,
                beat_interval=req.beat_interval,
                version=req.version,
                claimed_tier=req.tier if trusted else None,
                claimed_labels=req.labels if trusted else None,
            )
            await events.record(
                conn, "machine.registered", machine=req.name, epoch=self._epoch, tier=row.tier
            )
            if was is not None and not was.up:
                await events.record(conn, "machine.up", machine=req.name, epoch=self._epoch)
        self.machines[req.name] = row
        if req.applied:  # what it had when it asked: an applied event heard meanwhile is newer
            self.applied.setdefault(req.name, req.applied)
        self.touch(req.name)
        self._up.add(req.name)  # registering is a sign of life
        self._beat_at[req.name] = time.monotonic()
        self._unknown_logged.discard(req.name)
        log.info("machine %s registered (tier %d, pid %d)", req.name, row.tier, req.pid)
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
        return row

    async def set_tier(self, name: str, tier: int) -> tuple[int, bool]:
        """Move a machine to another tier (plans recorded from now on use it), or place one
        that has not registered yet; the old tier, and whether it is registered."""
        async with self._changing:
            m = self.machines.get(name)
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                if m is None:
                    placed = await machines.placement(conn, name) or machines.Placement()
                    was = placed.tier
                    await machines.place(conn, name=name, tier=tier, labels=placed.labels)
                else:
                    was = m.tier
                    await machines.set_tier(conn, name=name, tier=tier)
                await events.record(conn, "machine.tier", machine=name, epoch=self._epoch,
                                    tier=tier, was=was, registered=m is not None)  # fmt: skip
            if m is not None:
                m.tier = tier
        log.info("machine %s moved from tier %d to tier %d%s", name, was, tier,
                 "" if m is not None else " (for its first registration)")  # fmt: skip
        return was, m is not None

    async def set_labels(
        self, name: str, *, add: dict[str, str], remove: list[str]
    ) -> tuple[dict[str, str], dict[str, str], bool]:
        """Set and remove labels of a machine, or of one that has not registered yet (its first
        registration takes them); (labels, the labels it had, whether it is registered)."""
        both = sorted(set(add) & set(remove))
        if both:
            raise wire.BadRequest(f"label {both[0]}: both set and removed")
        async with self._changing:
            m = self.machines.get(name)
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                if m is None:
                    placed = await machines.placement(conn, name) or machines.Placement()
                    was = dict(placed.labels)
                else:
                    placed, was = None, dict(m.labels)
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
            if m is not None:
                m.labels = labels
        log.info("machine %s labels %s (were %s)%s", name, labels, was,
                 "" if m is not None else " for its first registration")  # fmt: skip
        return labels, was, m is not None

    async def beat(self, beat: Beat) -> None:
        m = self.machines.get(beat.name)
        if m is None:
            if beat.name not in self._unknown_logged:
                self._unknown_logged.add(beat.name)
                log.info("beat from unregistered machine %s ignored until it registers", beat.name)
            return
        now = datetime.now(UTC)
        self._beat_at[beat.name] = time.monotonic()
        m.last_seen = now
        m.beat_interval = beat.interval
        if not m.up:
            await self._transition(beat.name, up=True, at=now)
        else:
            self._unflushed[beat.name] = now

    async def _transition(self, name: str, *, up: bool, at: datetime) -> None:
        async with self._changing:
            m = self.machines.get(name)
            if m is None or m.up == up:
                return  # someone else got there first (a registration, another beat)
            async with self._pool.acquire() as conn, conn.transaction():
                await machines.set_up(conn, name=m.name, up=up, last_seen=m.last_seen or at)
                await events.record(
                    conn, "machine.up" if up else "machine.down", machine=m.name, epoch=self._epoch
                )
            m.up = up  # only once the store has it
            (self._up.add if up else self._up.discard)(name)
            self.touch(name)
            self._unflushed.pop(m.name, None)
        log.info("machine %s is %s", m.name, "up" if up else "down (missed heartbeats)")

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
            answered = self._bus_answered()
            for m in list(self.machines.values()):
                due = self._beat_at.get(m.name, now) + self._down_after * m.beat_interval
                if m.up and due < now and due < answered:
                    await self._transition(m.name, up=False, at=datetime.now(UTC))
            if now - flushed >= FLUSH_EVERY:
                await self.flush()
                flushed = now

    async def flush(self) -> None:
        seen, self._unflushed = self._unflushed, {}
        if seen:
            async with self._pool.acquire() as conn:
                await machines.touch_many(conn, seen)

    def counts(self) -> NodeCounts:
        total, up = len(self.machines), len(self._up)
        return NodeCounts(total=total, up=up, down=total - up)

    def nodes(self, *, wanted: dict[str, str]) -> list[Node]:
        return [
            Node(
                name=m.name,
                tier=m.tier,
                labels=m.labels,
                up=m.up,
                last_seen=m.last_seen,
                facts=m.facts,
                processes=self.processes.get(m.name, []),
                digest_wanted=wanted.get(m.name),
                digest_applied=self.applied.get(m.name),
                apply_error=self.apply_errors.get(m.name),
                version=m.version,
            )
            for m in sorted(self.machines.values(), key=lambda m: (m.tier, m.name))
        ]
