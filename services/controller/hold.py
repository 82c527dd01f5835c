"""One hold of the seat: take it, serve, hand over, release (`Hold`), and the holder's own tasks
beside the verbs: plan work, and stepping down when NATS is gone.

A holder cut off from NATS for BUS_GRACE steps down (`BusLost`): as nats-py reports it (a
closed connection), or as its own round trips find it (a silent link), on either of its
connections (its own, and the hosts': main.py). A hold's last steps run at once, each on its
own deadline, so a store or bus that is gone never keeps the lock.
"""

import functools
import logging
import time
from collections.abc import Awaitable
from datetime import UTC, datetime

import anyio
import asyncpg
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from mesh import blobs, bus, errors, paging, subjects, wire
from mesh.auth.signing import Signing
from mesh.config import EventsKept, VersionsKept
from mesh.errors import MeshError, reason
from mesh.model import Handover, SeatAnnounce, SeatInfo
from mesh.serving import Parts, Stats
from mesh.store import events, replication, seats
from services.controller import metrics
from services.controller.catalog import bundles, secretkeys
from services.controller.catalog.secretkeys import Keys
from services.controller.changes.following import FollowLabels
from services.controller.changes.machines import Machines
from services.controller.changes.modules import Changes
from services.controller.changes.operators import Operators
from services.controller.changes.policy import PolicyChanges
from services.controller.changes.restarts import Restarts
from services.controller.changes.secrets import SecretChanges
from services.controller.fleet.admission import Admission
from services.controller.fleet.fleet import Fleet, open_bus
from services.controller.fleet.joining import Joins
from services.controller.fleet.noisy import Budgets
from services.controller.fleet.placing import Placing
from services.controller.fleet.publishing import Manifests, Publisher
from services.controller.fleet.registering import Registrations
from services.controller.fleet.reports import HostReports
from services.controller.fleet.tokens import Tokens
from services.controller.plans import pruning
from services.controller.plans.approvals import HeldChanges
from services.controller.plans.planner import Planner
from services.controller.plans.recording import Recorder
from services.controller.plans.steering import Steering
from services.controller.plans.writes import PlanWrites
from services.controller.seat import epochs, handover, kick
from services.controller.seat.buckets import Buckets
from services.controller.seat.handover import VerbSubscriptions
from services.controller.seat.kick import Kicker
from services.controller.seat.lock import SeatLock, SeatLost
from services.controller.seat.readiness import Readiness
from services.controller.seat.standbys import Releases, Standbys
from services.controller.seat.stopping import Stop, attempt
from services.controller.serving.holding import Holding
from services.controller.serving.views import Views
from services.controller.trust.operators import Trust

log = logging.getLogger("mesh.controller")

BUS_GRACE = 3.0  # a holder cut off from NATS this long steps down (docs/design.md, the seat)
# A silent link (no PONG, nothing else either) steps the holder down after SILENT_AFTER plus
# a round trip's interval: the takeover, and the kick of its connection (kick.py), follow at
# once, so this is most of the window a cut costs. While the holder's own event loop has run
# more than LAGGING late in the last 10 s (mesh/looplag.py), a PONG may only sit unread behind
# it, and silence takes BUS_GRACE instead: a busy holder does not give the seat away.
ROUND_TRIP_EVERY = 0.25  # how often the holder checks that NATS answers
SILENT_AFTER = 1.0
LAGGING = 0.5
# A handover lets its slow verbs finish this long (then they are answered `unavailable`): with
# the ready wait, the drain and the release it fits in mesh.lifetime.STOP_WITHIN.
SLOW_VERBS_WITHIN = 4.0
# How long a takeover asks the seat's bucket again while its stream elects a leader (a
# nats-server lost: 2 s or so); past it the controller exits and its supervisor restarts it.
BUS_TAKE_WITHIN = 20.0
# How long a signalled controller goes on taking the seat (then it serves and hands over at
# once); past it, it stops without serving: the process's bound (mesh.lifetime) comes first.
TAKE_WHEN_STOPPING = 3.0

# A store session that ended under us, as asyncpg says it.
_SESSION_ENDED = (
    asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
)  # fmt: skip


class BusLost(MeshError):
    """The holder lost NATS for longer than BUS_GRACE and gave up the seat."""


class Controller(msgspec.Struct):
    """What this controller keeps across its holds and its turns standing by."""

    nc: Client  # verbs, the seat, JetStream, discovery
    link: bus.Link
    # The hosts' requests, beats and reports: a connection of their own, which nats-server may
    # drop as a slow consumer under a host's flood without taking the verbs with it.
    hosts_nc: Client
    hosts_link: bus.Link
    pool: asyncpg.Pool
    me: SeatAnnounce  # who this controller is, as it announces itself
    standbys: Standbys  # the standbys it hears
    released: Releases  # holders heard letting go
    ready: Readiness  # what its module's check reads
    signing: Signing  # what it announces, signed; what it hears, checked
    events: EventsKept  # how much history the store keeps (pruning.py)
    versions: VersionsKept  # whose bundles the bundle store keeps (bundles.py)
    stats: Stats  # every hold's verbs, counted together
    down_after: int  # beats a machine may miss before it is down
    keys: Keys  # the key of the secrets (secretkeys.py)
    kicker: Kicker  # closes a cut-off holder's connection at a takeover (kick.py)
    buckets: Buckets  # the bus's buckets, opened once (buckets.py)
    budgets: Budgets  # what each host may send (noisy.py)
    admission: Admission | None = None  # admits joining machines (admission.py)


class Hold:
    """One hold of the seat, in its named parts and in this order: take the seat (`_take`),
    serve verbs and hear the hosts' reports (`_serve`) until asked to stop, hand over
    (`_hand_over`), and release (`_release`), whatever happened in between."""

    def __init__(
        self, c: Controller, *, lock: SeatLock, verbs: VerbSubscriptions, stop: Stop
    ) -> None:
        self.nc = c.nc
        self.signing = c.signing
        self.link = c.link
        self.hosts_nc = c.hosts_nc
        self.hosts_link = c.hosts_link
        self.budgets = c.budgets
        self.admission = c.admission
        self.pool = c.pool
        self.lock = lock
        self.me = c.me
        self.standbys = c.standbys
        self.down_after = c.down_after
        self.verbs = verbs
        self.stop = stop
        self.released = c.released
        self.ready = c.ready
        self.events = c.events  # how much history the store keeps (pruning.py)
        self.versions = c.versions  # whose bundles the bundle store keeps (bundles.py)
        self.keys = c.keys
        self.reports: list[Subscription] = []  # the hosts' reports, once subscribed
        self.seat_kv: KeyValue | None = None  # the bus's record of the seat (epochs)
        self.on_bus: epochs.Seen | None = None  # that record as this hold wrote it
        self.before: epochs.BusEpoch | None = None  # and as the holder before it left it
        self.unclaimed: int | None = None  # the store's epoch before ours, until `_claim_bus`
        self.kicker = c.kicker
        self.buckets = c.buckets
        self.warnings: list[str] = []  # what the takeover found wrong with the store

    def _writers(
        self, *, epoch: int, fleet: Fleet, obs: ObjectStore, manifests: Manifests,
        recorder: Recorder, planner: Planner,
    ) -> tuple[object, ...]:  # fmt: skip
        """The parts that change something: the catalog, a plan, a secret, a machine, the
        operators, the join tokens. The catalog's, a secret's and a machine's changes record
        their plans through `recorder`, one at a time."""
        held = HeldChanges(pool=self.pool, epoch=epoch, fleet=fleet, manifests=manifests,
                           recorder=recorder, planner=planner)  # fmt: skip
        recorder.moved = held.recompose  # a change under a held plan composes it again
        changes = Changes(pool=self.pool, nc=self.nc, obs=obs, fleet=fleet, epoch=epoch,
                          signing=self.signing, manifests=manifests, recorder=recorder,
                          held=held)  # fmt: skip
        return (
            held, changes,
            SecretChanges(pool=self.pool, epoch=epoch, keys=self.keys, recorder=recorder,
                          manifests=manifests),
            Machines(nc=self.nc, fleet=fleet, manifests=manifests, recorder=recorder,
                     placing=Placing(fleet=fleet, pool=self.pool, epoch=epoch)),
            Steering(writes=PlanWrites(pool=self.pool, epoch=epoch), planner=planner,
                     one_change=recorder.one_change),
            Operators(pool=self.pool, changes=changes),
            PolicyChanges(pool=self.pool, epoch=epoch, secured=self.signing.seed is not None),
            Restarts(pool=self.pool, epoch=epoch, recorder=recorder, manifests=manifests),
            Tokens(pool=self.pool, epoch=epoch, admission=self.admission,
                   budget=lambda: paging.budget(self.nc.max_payload)),
            Joins(pool=self.pool, epoch=epoch, fleet=fleet, admission=self.admission),
        )  # fmt: skip

    async def run(self) -> None:
        loaded = await self._load_or_stop()
        if loaded is None:
            log.info("controller %s stops before serving: the seat did not load within %gs of "
                     "the signal", self.me.instance, TAKE_WHEN_STOPPING)  # fmt: skip
            if self.verbs.active:  # joined at a handover: what it holds goes to the group
                with anyio.move_on_after(TAKE_WHEN_STOPPING):
                    await self.verbs.leave()
            return
        row, taken, fleet, obs = loaded
        held = msgspec.structs.replace(self.me, since=row.since, epoch=row.epoch,
                                       register_within=fleet.registration_window())  # fmt: skip
        try:
            async with anyio.create_task_group() as background:
                manifests = Manifests()
                publisher = Publisher(pool=self.pool, nc=self.nc, epoch=row.epoch,
                                      manifests=manifests, holder=self.me.instance)  # fmt: skip
                planner = Planner(pool=self.pool, publisher=publisher, fleet=fleet, epoch=row.epoch,
                                  nc=self.nc, obs=obs)  # fmt: skip
                recorder = Recorder(fleet=fleet, epoch=row.epoch, publisher=publisher,
                                    wake=planner.wake)  # fmt: skip
                writers = self._writers(epoch=row.epoch, fleet=fleet, obs=obs,
                                        manifests=manifests, recorder=recorder,
                                        planner=planner)  # fmt: skip
                registrations = Registrations(fleet=fleet, pool=self.pool, epoch=row.epoch,
                                              open_bus=lambda: open_bus(self.nc))  # fmt: skip
                follow = FollowLabels(changes=Parts(*writers).of(Changes), epoch=row.epoch)
                fleet.relabelled = follow.heard

                def budget() -> int:  # the server we answer on now (a reconnect may move us)
                    return paging.budget(self.nc.max_payload)

                views = Views(
                    pool=self.pool, nc=self.nc, obs=obs, fleet=fleet, manifests=manifests,
                    publisher=publisher, keys=self.keys, budget=budget,
                )  # fmt: skip
                trust = Trust(pool=self.pool, epoch=row.epoch, budget=budget,
                              secured=self.signing.seed is not None)  # fmt: skip
                # Slow verbs run in `serving`, answered before we go.
                async with anyio.create_task_group() as serving:
                    assert row.since is not None
                    holding = Holding(
                        seat=SeatInfo(holder=self.me.instance, pid=self.me.pid, host=self.me.host,
                                      epoch=row.epoch, since=row.since, warnings=self.warnings,
                                      version=self.me.version),
                        handover=taken, standbys=self.standbys, fleet=fleet, planner=planner,
                        tasks=serving, stop=self.stop.handover,
                    )  # fmt: skip
                    await self._serve(
                        parts=Parts(holding, views, trust, fleet, registrations, *writers),
                        tasks=serving,
                        held=held, background=background, taken=taken,
                        reports=HostReports(fleet=fleet, publisher=publisher,
                                            budgets=self.budgets),
                    )  # fmt: skip
                    background.start_soon(fleet.run)
                    background.start_soon(registrations.run)
                    background.start_soon(follow.run)
                    background.start_soon(publisher.keep_published)
                    plans = anyio.CancelScope()
                    background.start_soon(_plan_work, publisher, planner, row.epoch, plans)
                    background.start_soon(lambda: bundles.keep_pruned(
                        self.pool, obs, epoch=row.epoch, kept=self.versions,
                        lock=recorder.one_change,
                    ))  # fmt: skip

                    while True:
                        await self.stop.requested.wait()
                        if await self._hand_over(held=held, plans=plans, background=background):
                            break
                    serving.cancel_scope.deadline = anyio.current_time() + SLOW_VERBS_WITHIN
                background.cancel_scope.cancel()
        except BaseException as e:
            cause = errors.leaf(e)
            if isinstance(cause, Exception):  # said when it happens, not only at the exit
                log.warning("controller %s steps down: %s", self.me.instance, reason(cause))
            raise
        finally:
            await self._release(fleet=fleet, held=held)

    async def _load_or_stop(
        self,
    ) -> tuple[seats.SeatRow, Handover, Fleet, ObjectStore] | None:
        """The seat taken and what a hold needs loaded; None if a signal came and this took
        TAKE_WHEN_STOPPING more (a bus or store gone): the process must exit in its bound."""
        loaded = None
        async with anyio.create_task_group() as tg:

            async def until_signalled() -> None:
                await self.stop.requested.wait()
                if self.stop.signalled:
                    await anyio.sleep(TAKE_WHEN_STOPPING)  # ok: a deadline, not a wait
                    tg.cancel_scope.cancel()

            tg.start_soon(until_signalled)
            try:
                row, taken = await self._take()
            except _SESSION_ENDED as e:  # the store went (a restart, a dropped database)
                raise SeatLost(f"the store failed as the seat was taken: {reason(e)}") from e
            # the round trips start with the hold
            self.link.answered_at = self.hosts_link.answered_at = time.monotonic()
            self.hosts_link.caught_up = self.hosts_link.answered_at
            # The lock's session pinged, with the server's idle limit on it, from the take on:
            # a holder cut off while it loads loses the lock in IDLE_LIMIT, as one cut while
            # it serves does (the nemesis: cut as it took the seat in a handover, it kept the
            # lock until the cut ended, 7 s with no holder).
            tg.start_soon(self.lock.watch)
            # Beats come on the hosts' connection: judged up to when its last answered round
            # trip was sent (a flood's backlog ahead of the PONG holds beats sent meanwhile).
            fleet = Fleet(
                pool=self.pool, epoch=row.epoch, down_after=self.down_after,
                bus_answered=lambda: self.hosts_link.caught_up, noisy=self.budgets.noisy,
            )  # fmt: skip
            await fleet.load()
            await secretkeys.take_over(self.pool, self.keys, epoch=row.epoch)
            _, obs = await self.buckets.blobs()
            loaded = (row, taken, fleet, obs)
            tg.cancel_scope.cancel()
        return loaded

    async def _take(self) -> tuple[seats.SeatRow, Handover]:
        """Take the seat: a new epoch above both the store's and the bus's, recorded in both,
        and how it came to us (a handover, or not).

        After a handover the holder said its epoch as it began (signed): the bus holds none
        higher, so the store's epoch is taken at once and the bus's record is claimed by
        `_claim_bus` while verbs are served. A nats-server lost at that moment makes the
        seat's stream elect a leader (seconds); the takeover does not wait for it."""
        lock, me = self.lock, self.me
        assert lock.conn is not None
        # Waits on the bus keep the lock's session answering (its idle limit: seat/lock.py).
        self.seat_kv = kv = await lock.kept_while(self.buckets.seat)
        before = await seats.read(lock.conn, seat=subjects.SEAT)
        said_epoch = self.released.handing(before.holder) if before else None
        if before is not None and said_epoch is not None and said_epoch >= before.epoch:
            row = await seats.take(
                lock.conn, seat=subjects.SEAT, holder=me.instance, pid=me.pid, host=me.host,
                at_least=said_epoch + 1,
            )  # fmt: skip
            self.unclaimed = before.epoch
        else:
            # The stream's leader may be moving (its nats-server lost): asked again, not a crash.
            on_bus = await lock.kept_while(
                lambda: blobs.patiently(lambda: epochs.read(kv), within=BUS_TAKE_WITHIN)
            )
            bus_epoch = on_bus.record.epoch if on_bus.record else 0
            row = await seats.take(
                lock.conn, seat=subjects.SEAT, holder=me.instance, pid=me.pid, host=me.host,
                at_least=bus_epoch + 1,
            )  # fmt: skip
            await lock.kept_while(lambda: self._claim(
                kv, on_bus, row.epoch, store_epoch=before.epoch if before else 0
            ))  # fmt: skip
        assert row.since is not None
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

    async def _claim(
        self, kv: KeyValue, on_bus: epochs.Seen, epoch: int, *, store_epoch: int
    ) -> None:
        """Record our epoch on the bus over `on_bus` (compare-and-set: a controller that wrote
        since wins, and we step down)."""
        me = self.me
        bus_epoch = on_bus.record.epoch if on_bus.record else 0
        if bus_epoch >= epoch:
            raise epochs.EpochTaken(
                f"{on_bus.record.holder if on_bus.record else '?'} holds epoch {bus_epoch} on "
                f"the bus, not below ours ({epoch}): stepping down"
            )
        if store_epoch < bus_epoch:
            warning = (
                f"the store's epoch ({store_epoch}) was below the bus's ({bus_epoch}): the store "
                "lost writes, as a failover without synchronous replication does; took epoch "
                f"{epoch}, above both"
            )
            log.warning("controller %s: %s", me.instance, warning)
            self.warnings.append(warning)
            await events.record(self.pool, "seat.store_behind", store_epoch=store_epoch,
                                bus_epoch=bus_epoch, epoch=epoch)  # fmt: skip
        self.before = on_bus.record
        self.on_bus = await blobs.patiently(
            lambda: epochs.claim(kv, seen=on_bus, epoch=epoch, holder=me.instance,
                                 pid=me.pid, at=kick.where(self.nc),
                                 hosts_at=kick.where(self.hosts_nc)),
            within=BUS_TAKE_WITHIN,
        )  # fmt: skip

    async def _claim_bus(self, epoch: int) -> None:
        """After a handover's takeover, the bus's record, while verbs are served."""
        assert self.seat_kv is not None and self.unclaimed is not None
        kv = self.seat_kv
        on_bus = await blobs.patiently(lambda: epochs.read(kv), within=BUS_TAKE_WITHIN)
        await self._claim(kv, on_bus, epoch, store_epoch=self.unclaimed)
        self.unclaimed = None

    async def _serve(
        self, *, parts: Parts, tasks: TaskGroup, reports: HostReports, held: SeatAnnounce,
        background: TaskGroup, taken: Handover,
    ) -> None:  # fmt: skip
        """Serve verbs, hear the hosts, say `held`, close the last holder's connection if the
        seat did not come by a handover, and start the holder's background work."""
        nc, hosts_nc = self.nc, self.hosts_nc
        await self.verbs.subscribe()
        await self.lock.confirm()
        self.verbs.serve(holder=parts, tasks=tasks, fresh=self.lock.fresh)
        self.reports = await reports.subscribe(hosts_nc)
        background.start_soon(reports.take_kept, hosts_nc)
        await nc.flush()
        await hosts_nc.flush()
        if self.before is not None and not taken.planned:
            holder_before = self.before.holder
            ours = (kick.where(nc), kick.where(hosts_nc))
            for before in (self.before.connection(), self.before.hosts_connection()):
                if before is not None and before not in ours:
                    background.start_soon(functools.partial(self.kicker.kick, before,
                                                            holder=holder_before))  # fmt: skip
        await _say(nc, self.signing, "held", held)

        async def record_where() -> None:
            assert self.seat_kv is not None
            if self.on_bus is None:
                return  # not claimed yet: `_claim_bus` records where we are
            self.on_bus = await epochs.moved(self.seat_kv, mine=self.on_bus, at=kick.where(nc),
                                             hosts_at=kick.where(hosts_nc))  # fmt: skip

        def back_on_nats() -> None:
            parts.of(Fleet).forgive()  # beats lost while we were away are not theirs
            # ...and reports may have been lost too: `held` again asks every host for them.
            background.start_soon(attempt, "announce held again",
                                  _say(nc, self.signing, "held", held))  # fmt: skip
            # Maybe on another server now: the next holder must know where to kick.
            background.start_soon(attempt, "record where we are on the bus", record_where())

        # Either connection back: the hosts' carries the beats and reports that were lost.
        self.link.on_up = self.hosts_link.on_up = back_on_nats
        background.start_soon(self.lock.watch)
        assert self.seat_kv is not None
        background.start_soon(lambda: epochs.watch(self.seat_kv, epoch=held.epoch))
        if self.unclaimed is not None:
            background.start_soon(self._claim_bus, held.epoch)
        background.start_soon(
            lambda: pruning.keep_pruned(self.pool, epoch=held.epoch, kept=self.events)
        )
        background.start_soon(metrics.HELD.holding, parts.of(Fleet), self.pool)
        background.start_soon(self.budgets.keep_saying)
        background.start_soon(_step_down_without_bus, self.link, nc)
        background.start_soon(_step_down_without_bus, self.hosts_link, hosts_nc)

    async def _hand_over(
        self, *, held: SeatAnnounce, plans: anyio.CancelScope, background: TaskGroup
    ) -> bool:
        """Whether the seat is handed over: at the `handover` verb with no standby answering
        nor heard from since it began, it is kept (a standby cut off from the bus that still
        reaches the store would take the lock, then wait for the bus: no holder for as long as
        its cut lasts). A standby heard but slow to answer (a loaded machine) gets it."""
        nc = self.nc
        self.ready.set("handing-over", held.epoch)
        # The handover (docs/design.md, the seat): a standby joins the verb group first.
        answers = self.link.answers(self.nc)
        began = time.monotonic()
        successor = await handover.announce(nc, held, self.signing) if answers else None
        silent = not self.standbys.heard_since(began)
        if successor is None and silent and answers and self.stop.may_keep():
            log.warning("controller %s keeps the seat: no standby answered the handover",
                        self.me.instance)  # fmt: skip
            self.stop.kept()
            self.ready.set("holding", held.epoch)
            # A standby that joined the verb group and whose answer was lost leaves it again.
            background.start_soon(attempt, "announce held again",
                                  _say(nc, self.signing, "held", held))  # fmt: skip
            return False
        log.info("controller %s hands over the seat%s", self.me.instance,
                 f" to {successor}" if successor else " (no standby answered)")  # fmt: skip
        plans.cancel()  # every plan write is a fenced transaction: the next holder goes on
        await self.verbs.stop(drain=self.link.answers(self.nc),
                              hosts_drain=self.hosts_link.answers(self.hosts_nc))  # fmt: skip
        return True

    async def _release(self, *, fleet: Fleet, held: SeatAnnounce) -> None:
        nc, lock = self.nc, self.lock
        # Each step on its own deadline: a store or bus that is gone must not keep the lock.
        answers = self.link.answers(self.nc)
        hosts_answer = self.hosts_link.answers(self.hosts_nc)
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
                steps.start_soon(on_bus, self.verbs.stop(drain=answers, hosts_drain=hosts_answer))
                for sub in self.reports:
                    stopping = sub.drain() if hosts_answer else sub.unsubscribe()
                    steps.start_soon(on_bus, attempt(f"stop {sub.subject}", stopping))
                steps.start_soon(attempt, "flush heartbeats", fleet.flush())
                steps.start_soon(
                    attempt, "record release",
                    events.record(self.pool, "seat.released", epoch=held.epoch,
                                  holder=self.me.instance),
                )  # fmt: skip
            # A drain cut at its deadline: a slow callback, or a silent link? A round trip says.
            if unfinished and answers and not await attempt("reach NATS", nc.flush(1), within=1):
                self.link.unanswered()  # then neither announce nor drain at the close
            # Said before the lock goes, so the standby that gets it has heard it: its takeover
            # is known to be a handover, and the gap is measured from here.
            gone = msgspec.structs.replace(held, at=datetime.now(UTC))
            if self.link.answers(nc):
                await attempt("announce release", _announce_flushed(nc, self.signing, gone))
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
    """Raise BusLost once NATS has been gone for BUS_GRACE on this connection: as nats-py
    reports it (a closed connection), or as our own round trips find it (a silent link). Each
    of the holder's two connections has its own: a holder that hears verbs but no host (or
    hosts but no verb) is as cut off as one that hears nothing."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: link.round_trips(
            nc, every=ROUND_TRIP_EVERY, within=SILENT_AFTER, late=BUS_GRACE,
            lagging=lambda: metrics.LOOP_LAG.worst() > LAGGING,
        ))  # fmt: skip
        tg.start_soon(_unanswered, link)
        await link.down_for(BUS_GRACE)
        raise BusLost(f"lost NATS for more than {BUS_GRACE:g}s ({link.name}): gave up the seat")


async def _unanswered(link: bus.Link) -> None:
    await link.silent_for()
    raise BusLost(
        f"lost NATS for more than {SILENT_AFTER:g}s ({link.name}: our round trips had no "
        "answer): gave up the seat"
    )


async def _say(nc: Client, signing: Signing, event: str, what: SeatAnnounce) -> None:
    """Say a seat event, signed (mesh.auth.signing): hosts and controllers act on no other."""
    await signing.publish(nc, subjects.seat(event), wire.encode(what))
