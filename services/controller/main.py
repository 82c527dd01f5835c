"""`mesh controller run`: take the seat or stand by for it, then serve until told to stop.

Lifetime, in order: apply migrations (under their own advisory lock), connect to NATS, try the
seat's lock; a standby announces itself every second while blocked on the lock. The holder
increments the epoch, loads the fleet, subscribes to the verbs in the `mesh-controller` queue
group and serves. On SIGTERM/SIGINT it drains its subscriptions (in-flight verbs are answered),
flushes heartbeats and closes the lock's session, which hands the lock to a waiting standby.
If the lock's session fails, the holder stops at once rather than answer with a seat it may
have lost.
"""

import logging
import os
import socket
from collections.abc import Awaitable
from datetime import UTC, datetime
from functools import partial

import anyio
import asyncpg
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import blobs, bus, subjects, wire
from mesh.lifetime import stop_on_signals
from mesh.model import Applied, Beat, ProcessesEvent, SeatAnnounce, SeatInfo
from mesh.store import db, events, seats
from mesh.store.migrate import migrate
from services.controller.catalog import Catalog
from services.controller.fleet import Fleet
from services.controller.planner import Planner
from services.controller.seat import SeatLock
from services.controller.standbys import ANNOUNCE_EVERY, Standbys
from services.controller.verbs import Holder, on_host_verb, on_verb

log = logging.getLogger("mesh.controller")

BUS_GRACE = 3.0  # a holder cut off from NATS this long steps down (design.md §5.4)


class BusLost(Exception):
    """The holder lost NATS for longer than BUS_GRACE and gave up the seat."""


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
    instance = instance or f"{host}-{pid}"
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

        async def on_seat_event(msg: Msg) -> None:
            try:
                announce = msgspec.json.decode(msg.data, type=SeatAnnounce)
            except msgspec.DecodeError:
                return
            if msg.subject.endswith(".standby"):
                standbys.heard(announce)
            else:
                standbys.gone(announce.instance)

        await nc.subscribe(subjects.SEAT_EVENTS, cb=on_seat_event)
        me = SeatAnnounce(instance=instance, pid=pid, host=host, since=started)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope)
            if not await lock.try_acquire():
                log.info("controller %s standing by for the seat %s", instance, subjects.SEAT)
                async with anyio.create_task_group() as waiting:
                    waiting.start_soon(_announce_standby, nc, me)
                    await lock.wait()
                    waiting.cancel_scope.cancel()
            await _hold(
                nc=nc,
                link=link,
                pool=pool,
                lock=lock,
                me=me,
                standbys=standbys,
                down_after=down_after,
            )
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await lock.release()
            if nc is not None:
                await _attempt("close NATS", bus.close(nc))
            await _attempt("close the store pool", pool.close())


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
) -> None:
    assert lock.conn is not None
    row = await seats.take(
        lock.conn, seat=subjects.SEAT, holder=me.instance, pid=me.pid, host=me.host
    )
    assert row.since is not None
    await events.record(pool, "seat.taken", epoch=row.epoch, holder=me.instance, pid=me.pid)
    log.info("controller %s holds the seat %s, epoch %d", me.instance, subjects.SEAT, row.epoch)

    fleet = Fleet(pool=pool, epoch=row.epoch, down_after=down_after)
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
            log.info("machine %s could not apply %s: %s: %s", applied.name,
                     applied.digest[:19], applied.step, applied.error)  # fmt: skip

    subs = []
    held = msgspec.structs.replace(me, since=row.since, epoch=row.epoch)
    try:
        async with anyio.create_task_group() as serving:
            catalog = Catalog(
                pool=pool, nc=nc, kv=kv, obs=obs, fleet=fleet, epoch=row.epoch,
                wake=lambda: planner.wake(),
            )  # fmt: skip
            planner = Planner(pool=pool, catalog=catalog, fleet=fleet, epoch=row.epoch)
            holder = Holder(
                seat=SeatInfo(
                    holder=me.instance, pid=me.pid, host=me.host, epoch=row.epoch, since=row.since
                ),
                fleet=fleet,
                standbys=standbys,
                catalog=catalog,
                planner=planner,
                tasks=serving,
            )
            republished = await catalog.republish()
            if republished:
                log.info("republished %d declaration(s) under epoch %d", republished, row.epoch)
            subs = [
                await nc.subscribe(
                    subjects.CTL_VERBS, queue=subjects.QUEUE, cb=partial(on_verb, holder)
                ),
                await nc.subscribe(
                    subjects.CTL_HOST_VERBS, queue=subjects.QUEUE, cb=partial(on_host_verb, holder)
                ),
                await nc.subscribe(subjects.HOST_BEATS, queue=subjects.QUEUE, cb=on_beat),
                await nc.subscribe("mesh.event.*.applied", queue=subjects.QUEUE, cb=on_applied),
                await nc.subscribe("mesh.event.*.processes", queue=subjects.QUEUE, cb=on_processes),
            ]
            await nc.flush()
            await nc.publish(subjects.seat("held"), wire.encode(held))
            link.on_up = fleet.forgive  # beats lost while we were away are not the machines' fault
            serving.start_soon(lock.watch)
            serving.start_soon(fleet.watch)
            serving.start_soon(catalog.keep_published)
            serving.start_soon(planner.run)
            serving.start_soon(_step_down_without_bus, link)
    finally:
        # Each step on its own deadline: a store or bus that is gone must not keep the lock.
        with anyio.CancelScope(shield=True):
            if not nc.is_connected:
                await lock.release()  # nobody can hear us: let the standby have the seat now
            for sub in subs:
                # drain answers what is in flight; without a connection there is nothing to drain
                await _attempt("stop verbs", sub.drain() if nc.is_connected else sub.unsubscribe())
            await _attempt("flush heartbeats", fleet.flush())
            await _attempt(
                "record release",
                events.record(pool, "seat.released", epoch=row.epoch, holder=me.instance),
            )
            await lock.release()
            await _attempt(
                "announce release", nc.publish(subjects.seat("released"), wire.encode(held))
            )
            log.info("controller %s released the seat, epoch %d", me.instance, row.epoch)


async def _step_down_without_bus(link: bus.Link) -> None:
    await link.down_for(BUS_GRACE)
    raise BusLost(f"lost NATS for more than {BUS_GRACE:g}s: gave up the seat")


async def _attempt(what: str, step: Awaitable[object], *, within: float = 3.0) -> None:
    try:
        with anyio.fail_after(within):
            await step
    except Exception as e:
        log.warning("while stopping, could not %s: %s", what, e or type(e).__name__)
