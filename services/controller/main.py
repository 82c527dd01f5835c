"""`mesh controller run`: take the seat or stand by for it, then serve until told to stop.

Lifetime, in order: apply migrations (under their own advisory lock), connect to NATS, try the
seat's lock; a standby announces itself every second while blocked on the lock. The holder
increments the epoch, loads the fleet, subscribes to the verbs in the `mesh-controller` queue
group and serves. On SIGTERM/SIGINT it drains its subscriptions (in-flight verbs are answered),
flushes heartbeats and closes the lock's session, which hands the lock to a waiting standby.
If the lock's session fails, the holder stops at once rather than answer with a seat it may
have lost.
"""

import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable
from datetime import UTC, datetime

import anyio
import asyncpg
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from mesh import blobs, bus, errors, origin, paging, subjects, version, wire
from mesh import metrics as served_metrics
from mesh.auth.signing import Signing
from mesh.config import EventsKept, events_kept
from mesh.discovery import Discovery
from mesh.errors import MeshError, reason
from mesh.model import Handover, SeatAnnounce, SeatInfo
from mesh.serving import Stats
from mesh.store import db, events, replication, seats
from mesh.store.migrate import migrate
from services.controller import epochs, handover, metrics, pruning, readiness
from services.controller.changes import Changes
from services.controller.fleet import Fleet, open_bus
from services.controller.handover import VerbSubscriptions
from services.controller.planner import Planner
from services.controller.publishing import Manifests, Publisher
from services.controller.readiness import Readiness
from services.controller.reports import HostReports
from services.controller.seat import SeatLock, SeatLost
from services.controller.standbys import ANNOUNCE_EVERY, Releases, Standbys
from services.controller.verbs import ENDPOINTS, Holder
from services.controller.views import Views

log = logging.getLogger("mesh.controller")

SERVING = ("holding", "handing-over")  # readiness states in which this controller serves verbs
BUS_GRACE = 3.0  # a holder cut off from NATS this long steps down (docs/design.md, the seat)
ROUND_TRIP_EVERY = 1.0  # how often the holder checks that NATS answers
STANDBY_LEAVE_WITHIN = 5.0  # a stopping standby's leave of the verb group (two drains)


# Past this, every verb and host request is answered `busy` before any work is done, until
# the controller has caught up: the seat's pings (its lock session every second, NATS round
# trips) run in the same event loop as the verbs, and a loop that runs late would miss them
# and give the seat away for being busy (docs/architecture.md, Liveness: shedding). Only this
# process's own lateness counts: a slow round trip may be the bus's (a cluster electing), and
# refusing work would not make that faster.
SHED_LAG = 0.5  # seconds the event loop runs its timers late


def _overloaded() -> str | None:
    lag = metrics.LOOP_LAG.behind(SHED_LAG)
    return f"its event loop runs {lag:.1f}s late" if lag is not None else None


# A store session that ended under us, as asyncpg says it.
_SESSION_ENDED = (
    asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
)  # fmt: skip


class BusLost(MeshError):
    """The holder lost NATS for longer than BUS_GRACE and gave up the seat."""


class Stop:
    """Why the holder stops holding: a signal (then the process exits) or the `handover` verb
    (then it stands by again)."""

    def __init__(self) -> None:
        self.requested = anyio.Event()
        self.stand_by_after = False

    def handover(self) -> None:
        self.stand_by_after = True
        self.requested.set()


async def run(
    *,
    nats_url: str,
    database_url: str,
    instance: str | None = None,
    creds: str | None = None,
    down_after: int = 3,
    metrics_on: served_metrics.Listen | None = None,
    events: EventsKept | None = None,
) -> None:
    events = events or events_kept()
    host = socket.gethostname()
    pid = os.getpid()
    # Run by a host as a process: named after the machine (MESH_MACHINE), not the OS's hostname.
    instance = instance or f"{os.environ.get('MESH_MACHINE') or host}-{pid}"
    started = datetime.now(UTC)

    conn = await db.connect(database_url)
    try:
        await migrate(conn)
    finally:
        await conn.close()

    pool = await db.pool(database_url)
    nc: Client | None = None
    lock = SeatLock(database_url)
    link = bus.Link()
    try:
        nc = await bus.connect(nats_url, name=f"mesh-controller {instance}", creds=creds, link=link)
        signing = Signing.controller(creds)  # what we announce, signed; what we hear, checked
        standbys = Standbys(own_instance=instance)
        released = Releases()  # holder instance -> when we heard it let go

        async def on_seat_event(msg: Msg) -> None:
            if not signing.genuine(msg):
                origin.STRAYS.refused(subjects.SEAT_EVENTS, msg, "not signed by the controllers")
                return
            try:
                announce = wire.decode(msg.data, SeatAnnounce)
            except wire.BadRequest:
                return
            if msg.subject.endswith(".standby"):
                standbys.heard(announce)
            elif msg.subject.endswith((".held", ".released")):
                standbys.gone(announce.instance)
                if msg.subject.endswith(".released"):
                    released.heard(announce.instance)

        await origin.subscribe(nc, subjects.SEAT_EVENTS, cb=on_seat_event)
        me = SeatAnnounce(
            instance=instance, pid=pid, host=host, since=started, version=version.running()
        )
        # Start-up leaves tens of thousands of objects that live as long as the process; a full
        # collection walks them all (25 ms of CPU on a small VM) and the first one tends to fall
        # in this controller's first takeover. Collect now and keep them out of later ones.
        gc.collect()
        gc.freeze()

        ready = Readiness(readiness.default_file())
        stats = Stats(observe=metrics.VERB_ANSWERED)  # every hold's verbs, counted together
        # `$SRV` answers, holder and standby alike; only the holder lists the verbs.
        await Discovery(
            nc, name=subjects.CONTROLLER_SERVICE, id=instance, stats=stats,
            description="mesh's controller: holds the seat mesh-controller or stands by",
            endpoints=lambda: ENDPOINTS if ready.state in SERVING else (),
            metadata=lambda: {"seat": ready.state, "epoch": str(ready.epoch), "host": host,
                              "pid": str(pid), "mesh": me.version},
        ).start()  # fmt: skip
        async with anyio.create_task_group() as tg:
            if metrics_on is not None:
                await tg.start(
                    served_metrics.serve, metrics.REGISTRY, metrics_on, f"controller {instance}"
                )
            tg.start_soon(ready.keep_writing)
            tg.start_soon(metrics.LOOP_LAG.run)
            holding: list[Stop] = []  # the current hold's Stop, while this controller holds
            current: list[VerbSubscriptions] = []  # this controller's verb subscriptions
            signalled = anyio.Event()
            tg.start_soon(_signals, tg.cancel_scope, holding, current, signalled)
            while True:
                verbs = VerbSubscriptions(nc=nc, tasks=tg, endpoints=ENDPOINTS, stats=stats,
                                          overloaded=_overloaded)  # fmt: skip
                current[:] = [verbs]
                if not await lock.try_acquire():
                    log.info("controller %s standing by for the seat %s", instance, subjects.SEAT)
                    ready.set("standby")
                    async with anyio.create_task_group() as waiting:
                        waiting.start_soon(_announce_standby, nc, me, signing)
                        waiting.start_soon(handover.stand_ready, nc, me, verbs, signing)
                        await lock.wait()
                        waiting.cancel_scope.cancel()
                stop = Stop()
                holding.append(stop)
                if signalled.is_set():  # the signal came as the lock did: hand straight over
                    stop.requested.set()
                try:
                    await Hold(
                        nc=nc, link=link, pool=pool, lock=lock, me=me, standbys=standbys,
                        down_after=down_after, verbs=verbs, stop=stop, released=released,
                        ready=ready, signing=signing, events=events,
                    ).run()  # fmt: skip
                finally:
                    holding.clear()
                await lock.release()
                if not stop.stand_by_after or signalled.is_set():
                    break
                lock = SeatLock(database_url)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await lock.release()
            if nc is not None:
                await _attempt("close NATS", bus.close(nc, drain=link.answers(nc)))
            await _attempt("close the store pool", pool.close())


async def _signals(
    scope: anyio.CancelScope,
    holding: list[Stop],
    current: list[VerbSubscriptions],
    signalled: anyio.Event,
) -> None:
    """SIGTERM/SIGINT to the holder starts a handover, then the process exits; to a standby, or
    a second time, it stops at once: a standby in the verb group (a handover under way) leaves
    it first, passing on the requests it holds, so none is left unanswered."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            name = signal.Signals(signum).name
            if signalled.is_set() or not holding:
                log.info("received %s: stopping", name)
                if not holding and current and current[0].active:
                    with anyio.move_on_after(STANDBY_LEAVE_WITHIN):
                        passed = await current[0].leave()
                        log.info("left the verb group, %d request(s) passed on", passed)
                scope.cancel()
                return
            log.info("received %s: handing the seat over, then stopping", name)
            signalled.set()
            holding[0].requested.set()


async def _announce_standby(nc: Client, me: SeatAnnounce, signing: Signing) -> None:
    subject = subjects.seat("standby")
    body = wire.encode(me)
    headers = signing.headers(subject, body)
    while True:
        await nc.publish(subject, body, headers=headers)
        await anyio.sleep(ANNOUNCE_EVERY)


async def _say(nc: Client, signing: Signing, event: str, what: SeatAnnounce) -> None:
    """Say a seat event, signed (mesh.auth.signing): hosts and controllers act on no other."""
    await signing.publish(nc, subjects.seat(event), wire.encode(what))


class Hold:
    """One hold of the seat, in its named parts and in this order: take the seat (`_take`),
    serve verbs and hear the hosts' reports (`_serve`) until asked to stop, hand over
    (`_hand_over`), and release (`_release`), whatever happened in between."""

    def __init__(
        self,
        *,
        nc: Client,
        link: bus.Link,
        pool: asyncpg.Pool,
        lock: SeatLock,
        me: SeatAnnounce,
        standbys: Standbys,
        down_after: int,
        verbs: VerbSubscriptions,
        stop: Stop,
        released: Releases,
        ready: Readiness,
        signing: Signing,
        events: EventsKept,
    ) -> None:
        self.nc = nc
        self.signing = signing
        self.link = link
        self.pool = pool
        self.lock = lock
        self.me = me
        self.standbys = standbys
        self.down_after = down_after
        self.verbs = verbs
        self.stop = stop
        self.released = released
        self.ready = ready
        self.events = events  # how much history the store keeps (pruning.py)
        self.reports: list[Subscription] = []  # the hosts' reports, once subscribed
        self.seat_kv: KeyValue | None = None  # the bus's record of the seat (epochs)
        self.warnings: list[str] = []  # what the takeover found wrong with the store

    async def run(self) -> None:
        try:
            row, taken = await self._take()
        except _SESSION_ENDED as e:  # the store went (a restart, a dropped database) as we took
            raise SeatLost(f"the store failed as the seat was taken: {reason(e)}") from e
        self.link.answered_at = time.monotonic()  # the round trips start with the hold
        fleet = Fleet(
            pool=self.pool, epoch=row.epoch, down_after=self.down_after,
            open_bus=lambda: open_bus(self.nc), bus_answered=lambda: self.link.answered_at,
        )  # fmt: skip
        await fleet.load()
        _, obs = await blobs.ensure(self.nc)
        held = msgspec.structs.replace(self.me, since=row.since, epoch=row.epoch,
                                       register_within=fleet.registration_window())  # fmt: skip
        try:
            async with anyio.create_task_group() as background:
                manifests = Manifests()
                publisher = Publisher(pool=self.pool, js=self.nc.jetstream(), epoch=row.epoch,
                                      manifests=manifests, holder=self.me.instance)  # fmt: skip
                changes = Changes(
                    pool=self.pool, nc=self.nc, obs=obs, fleet=fleet, epoch=row.epoch,
                    signing=self.signing,
                    manifests=manifests, publisher=publisher, wake=lambda: planner.wake(),
                )  # fmt: skip
                views = Views(
                    pool=self.pool, nc=self.nc, obs=obs, fleet=fleet, manifests=manifests,
                    publisher=publisher,
                    budget=lambda: paging.budget(self.nc.max_payload),
                )  # fmt: skip
                planner = Planner(pool=self.pool, publisher=publisher, fleet=fleet, epoch=row.epoch,
                                  nc=self.nc, obs=obs)  # fmt: skip
                # Slow verbs run in `serving`, answered before we go.
                async with anyio.create_task_group() as serving:
                    assert row.since is not None
                    holder = Holder(
                        seat=SeatInfo(holder=self.me.instance, pid=self.me.pid, host=self.me.host,
                                      epoch=row.epoch, since=row.since, warnings=self.warnings,
                                      version=self.me.version),
                        fleet=fleet, standbys=self.standbys, changes=changes, views=views,
                        publisher=publisher, planner=planner,
                        tasks=serving, handover=taken, stop=self.stop.handover,
                    )  # fmt: skip
                    await self._serve(
                        holder=holder, reports=HostReports(fleet=fleet, publisher=publisher),
                        held=held, background=background,
                    )  # fmt: skip
                    plans = anyio.CancelScope()
                    background.start_soon(_plan_work, publisher, planner, row.epoch, plans)

                    await self.stop.requested.wait()
                    await self._hand_over(held=held, plans=plans)
                    serving.cancel_scope.deadline = anyio.current_time() + 10  # slow verbs finish
                background.cancel_scope.cancel()
        except BaseException as e:
            cause = errors.leaf(e)
            if isinstance(cause, Exception):  # said when it happens, not only at the exit
                log.warning("controller %s steps down: %s", self.me.instance, reason(cause))
            raise
        finally:
            await self._release(fleet=fleet, held=held)

    async def _take(self) -> tuple[seats.SeatRow, Handover]:
        """Take the seat: a new epoch above both the store's and the bus's, recorded in both,
        and how it came to us (a handover, or not)."""
        lock, me = self.lock, self.me
        assert lock.conn is not None
        self.seat_kv = await blobs.ensure_seat(self.nc)
        on_bus = await epochs.read(self.seat_kv)
        bus_epoch = on_bus.record.epoch if on_bus.record else 0
        before = await seats.read(lock.conn, seat=subjects.SEAT)
        row = await seats.take(
            lock.conn, seat=subjects.SEAT, holder=me.instance, pid=me.pid, host=me.host,
            at_least=bus_epoch + 1,
        )  # fmt: skip
        assert row.since is not None
        store_epoch = before.epoch if before else 0
        if store_epoch < bus_epoch:
            warning = (
                f"the store's epoch ({store_epoch}) was below the bus's ({bus_epoch}): the store "
                "lost writes, as a failover without synchronous replication does; took epoch "
                f"{row.epoch}, above both"
            )
            log.warning("controller %s: %s", me.instance, warning)
            self.warnings.append(warning)
            await events.record(self.pool, "seat.store_behind", store_epoch=store_epoch,
                                bus_epoch=bus_epoch, epoch=row.epoch)  # fmt: skip
        await epochs.claim(self.seat_kv, seen=on_bus, epoch=row.epoch, holder=me.instance,
                           pid=me.pid)  # fmt: skip
        said = await replication.check(lock.conn)
        if said.warning is not None:  # HA needs synchronous replication (docs/operations.md)
            log.warning("controller %s: %s", me.instance, said.warning)
            self.warnings.append(said.warning)
        self.ready.set("holding", row.epoch)
        previous = before.holder if before else None
        let_go = self.released.take(previous) if previous else None
        taken = Handover(
            at=row.since, from_=previous, to=me.instance, planned=let_go is not None,
            gap_ms=round((time.monotonic() - let_go) * 1000, 1) if let_go is not None else None,
        )  # fmt: skip
        await events.record(
            self.pool, "seat.taken", epoch=row.epoch, holder=me.instance, pid=me.pid,
            previous=previous, planned=taken.planned, gap_ms=taken.gap_ms,
        )  # fmt: skip
        metrics.took_seat(row.epoch, planned=taken.planned, previous=previous)
        how = f" (handed over by {previous} after {taken.gap_ms} ms)" if taken.planned else ""
        log.info("controller %s holds the seat %s, epoch %d%s", me.instance, subjects.SEAT,
                 row.epoch, how)  # fmt: skip
        return row, taken

    async def _serve(
        self, *, holder: Holder, reports: HostReports, held: SeatAnnounce, background: TaskGroup
    ) -> None:
        """Serve verbs, hear the hosts, say `held`, and start the holder's background work."""
        nc = self.nc
        await self.verbs.subscribe()
        self.verbs.serve(holder=holder, tasks=holder.tasks, fresh=self.lock.fresh)
        self.reports = await reports.subscribe(nc)
        await nc.flush()
        await _say(nc, self.signing, "held", held)

        def back_on_nats() -> None:
            holder.fleet.forgive()  # beats lost while we were away are not theirs
            # ...and reports may have been lost too: `held` again asks every host for them.
            background.start_soon(_attempt, "announce held again",
                                  _say(nc, self.signing, "held", held))  # fmt: skip

        self.link.on_up = back_on_nats
        background.start_soon(self.lock.watch)
        assert self.seat_kv is not None
        background.start_soon(lambda: epochs.watch(self.seat_kv, epoch=held.epoch))
        background.start_soon(holder.fleet.run)
        background.start_soon(
            lambda: pruning.keep_pruned(self.pool, epoch=held.epoch, kept=self.events)
        )
        background.start_soon(holder.publisher.keep_published)
        background.start_soon(metrics.HELD.holding, holder.fleet, self.pool)
        background.start_soon(_step_down_without_bus, self.link, nc)

    async def _hand_over(self, *, held: SeatAnnounce, plans: anyio.CancelScope) -> None:
        nc = self.nc
        self.ready.set("handing-over", held.epoch)
        # The handover (docs/design.md, the seat): a standby joins the verb group first.
        answers = self.link.answers(self.nc)
        successor = await handover.announce(nc, held, self.signing) if answers else None
        log.info("controller %s hands over the seat%s", self.me.instance,
                 f" to {successor}" if successor else " (no standby answered)")  # fmt: skip
        plans.cancel()  # every plan write is a fenced transaction: the next holder goes on
        await self.verbs.stop(drain=self.link.answers(self.nc))

    async def _release(self, *, fleet: Fleet, held: SeatAnnounce) -> None:
        nc, lock = self.nc, self.lock
        # Each step on its own deadline: a store or bus that is gone must not keep the lock.
        answers = self.link.answers(self.nc)
        with anyio.CancelScope(shield=True):
            if not answers:
                await lock.release()  # nobody can hear us: let the standby have the seat now

            # The bus's steps and the store's at once: a link cut both ways costs one deadline,
            # not one per step (it was 15 s of them, one after another).
            unfinished: list[bool] = []

            async def on_bus(stopped: Awaitable[bool]) -> None:
                if not await stopped:
                    unfinished.append(True)

            async with anyio.create_task_group() as steps:
                steps.start_soon(on_bus, self.verbs.stop(drain=answers))
                for sub in self.reports:
                    stopping = sub.drain() if answers else sub.unsubscribe()
                    steps.start_soon(on_bus, _attempt(f"stop {sub.subject}", stopping))
                steps.start_soon(_attempt, "flush heartbeats", fleet.flush())
                steps.start_soon(
                    _attempt, "record release",
                    events.record(self.pool, "seat.released", epoch=held.epoch,
                                  holder=self.me.instance),
                )  # fmt: skip
            # A drain cut at its deadline: a slow callback, or a silent link? A round trip says.
            if unfinished and answers and not await _attempt("reach NATS", nc.flush(1), within=1):
                self.link.unanswered()  # then neither announce nor drain at the close
            # Said before the lock goes, so the standby that gets it has heard it: its takeover
            # is known to be a handover, and the gap is measured from here.
            gone = msgspec.structs.replace(held, at=datetime.now(UTC))
            if self.link.answers(nc):
                await _attempt("announce release", _announce_flushed(nc, self.signing, gone))
            await lock.release()
            metrics.left_seat()
            log.info("controller %s released the seat, epoch %d", self.me.instance, held.epoch)


async def _announce_flushed(nc: Client, signing: Signing, gone: SeatAnnounce) -> None:
    await _say(nc, signing, "released", gone)
    await nc.flush()


async def _plan_work(
    publisher: Publisher, planner: Planner, epoch: int, scope: anyio.CancelScope
) -> None:
    """Declarations again under this epoch, then plans: a plan's publish never races the
    republish of what the store had."""
    with scope:
        republished = await publisher.republish()
        if republished:
            log.info("republished %d declaration(s) under epoch %d", republished, epoch)
        await planner.run()


async def _step_down_without_bus(link: bus.Link, nc: Client) -> None:
    """Raise BusLost once NATS has been gone for BUS_GRACE: as nats-py reports it (a closed
    connection), or as our own round trips find it (a silent link)."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: link.round_trips(nc, every=ROUND_TRIP_EVERY, within=BUS_GRACE))
        tg.start_soon(_unanswered, link)
        await link.down_for(BUS_GRACE)
        raise BusLost(f"lost NATS for more than {BUS_GRACE:g}s: gave up the seat")


async def _unanswered(link: bus.Link) -> None:
    await link.silent_for()
    raise BusLost(
        f"lost NATS for more than {BUS_GRACE:g}s (our round trips had no answer): gave up the seat"
    )


async def _attempt(what: str, step: Awaitable[object], *, within: float = 3.0) -> bool:
    """Whether `step` was done within its deadline (if not, a warning says why)."""
    try:
        with anyio.fail_after(within):
            await step
    except Exception as e:
        log.warning("while stopping, could not %s: %s", what, reason(e))
        return False
    return True
