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
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import blobs, bus, subjects, wire
from mesh.errors import MeshError
from mesh.model import Applied, Beat, Handover, ProcessesEvent, SeatAnnounce, SeatInfo
from mesh.store import db, events, seats
from mesh.store.migrate import migrate
from services.controller import handover, readiness
from services.controller.catalog import Catalog
from services.controller.fleet import Fleet, open_bus
from services.controller.handover import VerbSubscriptions
from services.controller.planner import Planner
from services.controller.readiness import Readiness
from services.controller.seat import SeatLock
from services.controller.standbys import ANNOUNCE_EVERY, Releases, Standbys
from services.controller.verbs import Holder, on_host_verb, on_verb

log = logging.getLogger("mesh.controller")

BUS_GRACE = 3.0  # a holder cut off from NATS this long steps down (design.md §5.4)


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
) -> None:
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
        standbys = Standbys(own_instance=instance)
        released = Releases()  # holder instance -> when we heard it let go

        async def on_seat_event(msg: Msg) -> None:
            try:
                announce = msgspec.json.decode(msg.data, type=SeatAnnounce)
            except msgspec.DecodeError:
                return
            if msg.subject.endswith(".standby"):
                standbys.heard(announce)
            elif msg.subject.endswith((".held", ".released")):
                standbys.gone(announce.instance)
                if msg.subject.endswith(".released"):
                    released.heard(announce.instance)

        await nc.subscribe(subjects.SEAT_EVENTS, cb=on_seat_event)
        me = SeatAnnounce(instance=instance, pid=pid, host=host, since=started)
        # Start-up leaves tens of thousands of objects that live as long as the process; a full
        # collection walks them all (25 ms of CPU on a small VM) and the first one tends to fall
        # in this controller's first takeover. Collect now and keep them out of later ones.
        gc.collect()
        gc.freeze()

        ready = Readiness(readiness.default_file())
        async with anyio.create_task_group() as tg:
            tg.start_soon(ready.keep_writing)
            holding: list[Stop] = []  # the current hold's Stop, while this controller holds
            signalled = anyio.Event()
            tg.start_soon(_signals, tg.cancel_scope, holding, signalled)
            while True:
                verbs = VerbSubscriptions(
                    nc, tg, [(subjects.CTL_VERBS, on_verb), (subjects.CTL_HOST_VERBS, on_host_verb)]
                )
                if not await lock.try_acquire():
                    log.info("controller %s standing by for the seat %s", instance, subjects.SEAT)
                    ready.set("standby")
                    async with anyio.create_task_group() as waiting:
                        waiting.start_soon(_announce_standby, nc, me)
                        waiting.start_soon(handover.stand_ready, nc, me, verbs)
                        await lock.wait()
                        waiting.cancel_scope.cancel()
                stop = Stop()
                holding.append(stop)
                if signalled.is_set():  # the signal came as the lock did: hand straight over
                    stop.requested.set()
                try:
                    await _hold(
                        nc=nc, link=link, pool=pool, lock=lock, me=me, standbys=standbys,
                        down_after=down_after, verbs=verbs, stop=stop, released=released,
                        ready=ready,
                    )  # fmt: skip
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
                await _attempt("close NATS", bus.close(nc))
            await _attempt("close the store pool", pool.close())


async def _signals(scope: anyio.CancelScope, holding: list[Stop], signalled: anyio.Event) -> None:
    """SIGTERM/SIGINT to the holder starts a handover, then the process exits; to a standby, or
    a second time, it stops at once."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            name = signal.Signals(signum).name
            if signalled.is_set() or not holding:
                log.info("received %s: stopping", name)
                scope.cancel()
                return
            log.info("received %s: handing the seat over, then stopping", name)
            signalled.set()
            holding[0].requested.set()


async def _announce_standby(nc: Client, me: SeatAnnounce) -> None:
    body = wire.encode(me)
    while True:
        await nc.publish(subjects.seat("standby"), body)
        await anyio.sleep(ANNOUNCE_EVERY)


async def _hold(
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
) -> None:
    assert lock.conn is not None
    before = await seats.read(lock.conn, seat=subjects.SEAT)
    row = await seats.take(
        lock.conn, seat=subjects.SEAT, holder=me.instance, pid=me.pid, host=me.host
    )
    assert row.since is not None
    ready.set("holding", row.epoch)
    previous = before.holder if before else None
    let_go = released.take(previous) if previous else None
    taken = Handover(
        at=row.since, from_=previous, to=me.instance, planned=let_go is not None,
        gap_ms=round((time.monotonic() - let_go) * 1000, 1) if let_go is not None else None,
    )  # fmt: skip
    await events.record(
        pool, "seat.taken", epoch=row.epoch, holder=me.instance, pid=me.pid,
        previous=previous, planned=taken.planned, gap_ms=taken.gap_ms,
    )  # fmt: skip
    how = f" (handed over by {previous} after {taken.gap_ms} ms)" if taken.planned else ""
    log.info("controller %s holds the seat %s, epoch %d%s", me.instance, subjects.SEAT,
             row.epoch, how)  # fmt: skip

    fleet = Fleet(pool=pool, epoch=row.epoch, down_after=down_after, open_bus=lambda: open_bus(nc))
    await fleet.load()
    kv, obs = await blobs.ensure(nc)

    async def on_beat(msg: Msg) -> None:
        try:
            beat = wire.decode(msg.data, Beat)
        except wire.BadRequest:
            return  # a malformed beat is noise, not a reason to stop
        if msg.subject != subjects.host(beat.name, "beat"):
            return  # a machine speaks only for itself
        await fleet.beat(beat)

    async def on_processes(msg: Msg) -> None:
        try:
            event = wire.decode(msg.data, ProcessesEvent)
        except wire.BadRequest:
            return
        if msg.subject == f"mesh.event.{event.name}.processes":  # only for itself
            fleet.heard_processes(event.name, event.processes)

    async def on_applied(msg: Msg) -> None:
        try:
            applied = wire.decode(msg.data, Applied)
        except wire.BadRequest:
            return
        if msg.subject != f"mesh.event.{applied.name}.applied":
            return  # a machine speaks only for itself
        if applied.ok:
            fleet.heard_applied(applied.name, applied.digest, None, applied.processes)
        else:
            if applied.step != "fence":  # an ignored stale value says nothing of the machine
                fleet.heard_applied(
                    applied.name, applied.digest, f"{applied.step}: {applied.error}",
                    applied.processes,
                )  # fmt: skip
            else:  # the key's newest value may be a stale put: put the stored one again
                catalog.wanted.pop(applied.name, None)
            log.info("machine %s could not apply %s: %s: %s", applied.name,
                     applied.digest[:19], applied.step, applied.error)  # fmt: skip

    async def on_event(msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        if kind == "applied":
            await on_applied(msg)
        elif kind == "processes":
            await on_processes(msg)

    subs = []
    held = msgspec.structs.replace(me, since=row.since, epoch=row.epoch)
    try:
        async with anyio.create_task_group() as background:
            catalog = Catalog(
                pool=pool, nc=nc, kv=kv, obs=obs, fleet=fleet, epoch=row.epoch,
                wake=lambda: planner.wake(),
            )  # fmt: skip
            planner = Planner(pool=pool, catalog=catalog, fleet=fleet, epoch=row.epoch)
            async with anyio.create_task_group() as serving:  # slow verbs, answered before we go
                holder = Holder(
                    seat=SeatInfo(holder=me.instance, pid=me.pid, host=me.host, epoch=row.epoch,
                                  since=row.since),
                    fleet=fleet, standbys=standbys, catalog=catalog, planner=planner,
                    tasks=serving, handover=taken, stop=stop.handover,
                )  # fmt: skip
                await verbs.subscribe()
                verbs.serve(holder, fresh=lock.fresh)
                # Not in a queue group: a paused old holder that NATS has not dropped yet
                # must not take every other beat and report (design.md §5.1).
                subs = [
                    await nc.subscribe(subjects.HOST_BEATS, cb=on_beat),
                    # One subscription for both: a host's `applied` and `processes` reports are
                    # handled in the order it sent them (an older snapshot never wins).
                    await nc.subscribe("mesh.event.*.*", cb=on_event),
                ]
                await nc.flush()
                await nc.publish(subjects.seat("held"), wire.encode(held))
                link.on_up = fleet.forgive  # beats lost while we were away are not theirs
                background.start_soon(lock.watch)
                background.start_soon(fleet.watch)
                background.start_soon(catalog.keep_published)
                background.start_soon(_step_down_without_bus, link)
                plans = anyio.CancelScope()
                background.start_soon(_plan_work, catalog, planner, row.epoch, plans)

                await stop.requested.wait()
                ready.set("handing-over", row.epoch)
                # The handover (design.md §5.2): a standby joins the verb group first.
                successor = await handover.announce(nc, held) if nc.is_connected else None
                log.info("controller %s hands over the seat%s", me.instance,
                         f" to {successor}" if successor else " (no standby answered)")  # fmt: skip
                plans.cancel()  # every plan write is a fenced transaction: the next holder goes on
                await verbs.stop(drain=nc.is_connected)
                serving.cancel_scope.deadline = anyio.current_time() + 10  # slow verbs finish
            background.cancel_scope.cancel()
    finally:
        # Each step on its own deadline: a store or bus that is gone must not keep the lock.
        with anyio.CancelScope(shield=True):
            if not nc.is_connected:
                await lock.release()  # nobody can hear us: let the standby have the seat now
            await verbs.stop(drain=nc.is_connected)
            for sub in subs:
                await _attempt("stop", sub.drain() if nc.is_connected else sub.unsubscribe())
            await _attempt("flush heartbeats", fleet.flush())
            await _attempt(
                "record release",
                events.record(pool, "seat.released", epoch=row.epoch, holder=me.instance),
            )
            # Said before the lock goes, so the standby that gets it has heard it: its takeover
            # is known to be a handover, and the gap is measured from here.
            gone = msgspec.structs.replace(held, at=datetime.now(UTC))
            if nc.is_connected:
                await _attempt("announce release", _publish_flushed(
                    nc, subjects.seat("released"), wire.encode(gone)))  # fmt: skip
            await lock.release()
            log.info("controller %s released the seat, epoch %d", me.instance, row.epoch)


async def _publish_flushed(nc: Client, subject: str, body: bytes) -> None:
    await nc.publish(subject, body)
    await nc.flush()


async def _plan_work(
    catalog: Catalog, planner: Planner, epoch: int, scope: anyio.CancelScope
) -> None:
    """Declarations again under this epoch, then plans: a plan's publish never races the
    republish of what the store had."""
    with scope:
        republished = await catalog.republish()
        if republished:
            log.info("republished %d declaration(s) under epoch %d", republished, epoch)
        await planner.run()


async def _step_down_without_bus(link: bus.Link) -> None:
    await link.down_for(BUS_GRACE)
    raise BusLost(f"lost NATS for more than {BUS_GRACE:g}s: gave up the seat")


async def _attempt(what: str, step: Awaitable[object], *, within: float = 3.0) -> None:
    try:
        with anyio.fail_after(within):
            await step
    except Exception as e:
        log.warning("while stopping, could not %s: %s", what, e or type(e).__name__)
