"""`mesh controller run`: take the seat or stand by for it, then serve until told to stop.

Lifetime, in order: apply migrations (under their own advisory lock), connect to NATS, try the
seat's lock; a standby announces itself every second while blocked on the lock. The holder
increments the epoch, loads the fleet, subscribes to the verbs in the `mesh-controller` queue
group and serves (hold.py). On SIGTERM/SIGINT it drains its subscriptions (in-flight verbs are
answered), flushes heartbeats and closes the lock's session, which hands the lock to a waiting
standby (stopping.py). If the lock's session fails, the holder stops at once rather than answer
with a seat it may have lost.

The controller's tasks: the signal handler, the readiness writer, the event loop's lag meter,
the metrics endpoint, and its turns at the seat (`_take_turns`: standing by, then holding),
one after another until a signal; the hosts' verbs and reports run in a hold's own tasks.

Two NATS connections: the controller's own (verbs, the seat, JetStream, discovery) and the
hosts' (their requests, beats and reports, each subscription with pending limits and every
machine within its budget: noisy.py). nats-server drops a client that reads too slowly as a slow
consumer, a whole connection at once: a host flooding its subjects may cost the hosts' one a
reconnect, never the operators' verbs theirs (docs/architecture.md, the hosts' traffic).
"""

import gc
import logging
import os
import socket
from datetime import UTC, datetime
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from mesh import bus, subjects, version
from mesh import metrics as served_metrics
from mesh.auth.signing import Signing
from mesh.config import EventsKept, VersionsKept, events_kept, versions_kept
from mesh.discovery import Discovery
from mesh.errors import reason
from mesh.model import SeatAnnounce, SeatRole
from mesh.serving import Stats
from mesh.store import db
from mesh.store.migrate import migrate
from services.controller import metrics
from services.controller.catalog import secretkeys
from services.controller.fleet.admission import Admission
from services.controller.fleet.noisy import Budgets
from services.controller.hold import Controller, Hold
from services.controller.seat import handover, readiness, standbys
from services.controller.seat.buckets import Buckets
from services.controller.seat.handover import VerbSubscriptions
from services.controller.seat.kick import Kicker
from services.controller.seat.lock import SeatLock
from services.controller.seat.readiness import Readiness
from services.controller.seat.standbys import Releases, SeatEvents, Standbys
from services.controller.seat.stopping import Stop, Stopping, attempt
from services.controller.serving.verbs import ENDPOINTS, HOST_ENDPOINTS, VERB_ENDPOINTS

log = logging.getLogger("mesh.controller")

SERVING: tuple[SeatRole, ...] = ("holding", "handing-over")  # in which it serves verbs


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


async def run(
    *,
    nats_url: str,
    database_url: str,
    secrets_key: Path,
    instance: str | None = None,
    creds: str | None = None,
    system_creds: str | None = None,
    signer_file: str | None = None,
    down_after: int = 3,
    metrics_on: served_metrics.Listen | None = None,
    events: EventsKept | None = None,
    versions: VersionsKept | None = None,
) -> None:
    events = events or events_kept()
    versions = versions or versions_kept()
    host = socket.gethostname()
    pid = os.getpid()
    # Run by a host as a process: named after the machine (MESH_MACHINE), not the OS's hostname.
    instance = instance or f"{os.environ.get('MESH_MACHINE') or host}-{pid}"
    started = datetime.now(UTC)

    conn = await db.connect(database_url)
    try:
        await migrate(conn)
        # Before anything is served: a key file that cannot read the store's secrets is one
        # line and an exit, not a controller that fails every host asking for a secret.
        keys = await secretkeys.opened(conn, secrets_key)
    finally:
        await conn.close()

    pool = await db.pool(database_url)
    nc = hosts_nc = None
    link = bus.Link("the controller's NATS connection")
    hosts_link = bus.Link("the hosts' NATS connection")
    kicker = Kicker(nats_url, system_creds)
    try:
        nc = await bus.connect(nats_url, name=f"mesh-controller {instance}", creds=creds, link=link)
        hosts_nc = await bus.connect(nats_url, name=f"mesh-controller {instance} hosts",
                                     creds=creds, link=hosts_link, beside=nc)  # fmt: skip
        me = SeatAnnounce(
            instance=instance, pid=pid, host=host, since=started, version=version.running()
        )
        c = Controller(
            nc=nc, link=link, hosts_nc=hosts_nc, hosts_link=hosts_link, pool=pool, me=me,
            standbys=Standbys(own_instance=instance),
            released=Releases(), ready=Readiness(readiness.default_file()),
            signing=Signing.controller(creds), events=events, versions=versions,
            stats=Stats(observe=metrics.VERB_ANSWERED), down_after=down_after, keys=keys,
            kicker=kicker, buckets=Buckets(nc), budgets=Budgets(),
            admission=Admission.load(signer_file, creds),
        )  # fmt: skip
        await SeatEvents(signing=c.signing, standbys=c.standbys, released=c.released).subscribe(nc)
        # Start-up leaves tens of thousands of objects that live as long as the process; a full
        # collection walks them all (25 ms of CPU on a small VM) and the first one tends to fall
        # in this controller's first takeover. Collect now and keep them out of later ones.
        gc.collect()
        gc.freeze()
        # `$SRV` answers, holder and standby alike; only the holder lists the verbs.
        await _discovery(c).start()
        async with anyio.create_task_group() as tg:
            if metrics_on is not None:
                await tg.start(
                    served_metrics.serve, metrics.REGISTRY, metrics_on, f"controller {instance}"
                )
            tg.start_soon(c.ready.keep_writing)
            tg.start_soon(metrics.LOOP_LAG.run)
            stopping = Stopping()
            tg.start_soon(stopping.on_signals, tg.cancel_scope)
            await _take_turns(c, database_url=database_url, stopping=stopping, tasks=tg)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as closing:  # at once: each on its deadline
                for what, client, its in [("NATS", nc, link), ("the hosts' NATS", hosts_nc,
                                                               hosts_link)]:  # fmt: skip
                    if client is not None:
                        drain = its.answers(client)
                        closing.start_soon(attempt, f"close {what}", bus.close(client, drain=drain))
            await attempt("close the store pool", pool.close())


async def _open_buckets(c: Controller) -> None:
    """The buckets opened while standing by, so a takeover does not wait on JetStream's API;
    not open yet (JetStream not answering), the take opens them."""
    try:
        await c.buckets.open()
    except Exception as e:
        log.info("controller %s: the bus's buckets not open yet: %s", c.me.instance, reason(e))


def _discovery(c: Controller) -> Discovery:
    ready, me = c.ready, c.me
    return Discovery(
        c.nc, name=subjects.CONTROLLER_SERVICE, id=me.instance, stats=c.stats,
        description="mesh's controller: holds the seat mesh-controller or stands by",
        endpoints=lambda: ENDPOINTS if ready.state in SERVING else (),
        metadata=lambda: {"seat": ready.state, "epoch": str(ready.epoch), "host": me.host,
                          "pid": str(me.pid), "mesh": me.version},
    )  # fmt: skip


async def _take_turns(
    c: Controller, *, database_url: str, stopping: Stopping, tasks: TaskGroup
) -> None:
    """Stand by until the seat is ours, then hold it until asked to stop; after a `handover`
    verb, stand by again; after a signal, return. The seat's lock is released whatever
    happens (the standby waiting on it gets it)."""
    lock = SeatLock(database_url)
    try:
        while True:
            verbs = VerbSubscriptions(
                nc=c.nc, tasks=tasks, endpoints=VERB_ENDPOINTS, stats=c.stats,
                overloaded=_overloaded, hosts_nc=c.hosts_nc, host_endpoints=HOST_ENDPOINTS,
                budgets=c.budgets,
            )  # fmt: skip
            stopping.verbs = verbs
            if not await lock.try_acquire():
                await _stand_by(c, lock=lock, verbs=verbs)
            stop = Stop()
            stopping.hold = stop
            if stopping.signalled.is_set():  # the signal came as the lock did: hand straight over
                stop.signal()
            try:
                await Hold(c, lock=lock, verbs=verbs, stop=stop).run()
            finally:
                stopping.hold = None
            await lock.release()
            if not stop.stand_by_after or stopping.signalled.is_set():
                return
            lock = SeatLock(database_url)
    finally:
        with anyio.CancelScope(shield=True):
            await lock.release()


async def _stand_by(c: Controller, *, lock: SeatLock, verbs: VerbSubscriptions) -> None:
    """Until the lock is ours: announce this standby every second, and join the verb group
    when the holder hands over (handover.py)."""
    log.info("controller %s standing by for the seat %s", c.me.instance, subjects.SEAT)
    c.ready.set("standby")
    async with anyio.create_task_group() as waiting:
        waiting.start_soon(standbys.announce, c.nc, c.me, c.signing)
        waiting.start_soon(handover.stand_ready, c.nc, c.me, verbs, c.signing)
        waiting.start_soon(_open_buckets, c)
        await lock.wait()
        waiting.cancel_scope.cancel()
