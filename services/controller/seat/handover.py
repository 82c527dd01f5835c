"""The planned handover (docs/design.md, the seat): nothing unanswered while the seat changes hands.

1. The holder (on SIGTERM or the `handover` verb) publishes `mesh.seat.mesh-controller.handover`.
2. Each standby subscribes to the verb subjects in the `mesh-controller` queue group, flushes,
   and answers `ready`. From now on both receive verbs; the standby holds each one until it holds
   the seat (bounded by SEAT_WAIT), then serves it.
3. The holder, once a standby is ready (or after READY_WAIT without one), stops plan work,
   drains its subscriptions (the verbs it has are answered), waits for the slow verbs it runs,
   releases the lock and announces `released` with the time.
4. The standby's blocking lock call returns; it increments the epoch and serves what it held.

`VerbSubscriptions` is the one place the controller's verb subscriptions live (a
mesh.serving.Server), for standby and holder alike.
"""

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import bus, origin, subjects, wire
from mesh.auth.signing import Signing
from mesh.lifetime import first_of
from mesh.model import SeatAnnounce
from mesh.serving import Endpoint, Server, Stats
from services.controller.fleet.noisy import Budgets

log = logging.getLogger(__name__)

READY_WAIT = 2.0  # how long a holder waits for a standby to say it is subscribed
SEAT_WAIT = 30.0  # how long a verb received before the seat is ours waits for it: longer
# than the worst handover (ready wait, plan stop, drain, slow verbs' 4 s, lock release)
EARLY_FOR = 15.0  # a standby that subscribed but never got the seat unsubscribes after this


class VerbSubscriptions:
    """The `mesh-controller` queue-group subscriptions to controller verbs and host requests:
    the operators' verbs on the controller's connection, the hosts' requests on the hosts' own
    (`hosts_nc`, with their beats and reports: a host's flood never makes nats-server drop the
    connection the verbs come on), each within its machine's budget (noisy.py) before it is
    decoded. Until `serve(...)` is called, a message waits (in its own task) for it."""

    def __init__(
        self,
        *,
        nc: Client,
        tasks: TaskGroup,
        endpoints: Sequence[Endpoint],
        stats: Stats,
        overloaded: Callable[[], str | None] | None = None,
        hosts_nc: Client | None = None,
        host_endpoints: Sequence[Endpoint] = (),
        budgets: Budgets | None = None,
    ) -> None:
        self._nc = nc
        self._tasks = tasks
        self._server = Server(nc=nc, endpoints=endpoints, service="controller", stats=stats,
                              overloaded=overloaded)  # fmt: skip
        self._hosts = Server(nc=hosts_nc or nc, endpoints=host_endpoints, service="controller",
                             stats=stats, overloaded=overloaded)  # fmt: skip
        self._budgets = budgets
        self._holder: Any = None
        self._fresh: Callable[[], bool] = lambda: True
        self._ready = anyio.Event()
        self._elsewhere = anyio.Event()  # another controller took the seat: pass verbs on
        self.passed_on = 0  # requests sent on to the group again, over this object's life

    @property
    def active(self) -> bool:
        return self._server.active or self._hosts.active

    @property
    def since(self) -> float | None:
        return self._server.since

    async def subscribe(self) -> None:
        await self._server.subscribe(self._on_verb)
        await self._hosts.subscribe(self._on_host_request)
        if self._budgets is not None:  # checked as they are parsed (mesh.bus.admit)
            for sub in self._hosts.subscriptions():
                bus.admit(sub, self._budgets.admits("requests"))

    def serve(
        self, *, holder: Any, tasks: TaskGroup, fresh: Callable[[], bool] = lambda: True
    ) -> None:
        """Answer with `holder` from now on, its slow verbs in `tasks`, while `fresh()` says
        the seat is still ours."""
        self._server.serve(holder, tasks=tasks)
        self._hosts.serve(holder, tasks=tasks)
        self._holder = holder
        self._fresh = fresh
        self._ready.set()

    async def _on_verb(self, endpoint: Endpoint, msg: Msg) -> None:
        await self._route(self._server, endpoint, msg, None)

    async def _on_host_request(self, endpoint: Endpoint, msg: Msg) -> None:
        budgets = self._budgets
        if budgets is None:
            await self._route(self._hosts, endpoint, msg, None)
            return
        # Within its machine's requests in flight (admitted as it was parsed): one more may
        # come once this one is answered.
        machine = subjects.ctl_host_machine(msg.subject)
        await self._route(self._hosts, endpoint, msg, lambda: budgets.answered(machine))

    async def _route(
        self, server: Server, endpoint: Endpoint, msg: Msg, done: Callable[[], None] | None
    ) -> None:
        """Answer `msg` (or hold it until the seat is ours, or pass it on); `done()` once it
        is answered or passed on."""
        handed = False  # whether what answers it calls `done`
        try:
            if self._holder is not None:
                if not self._fresh():  # woken from a pause: the seat may have moved on
                    await self._pass_on(msg)
                    return
                handed = True
                await server.answer(endpoint, msg, done)
                return
            if self._elsewhere.is_set():
                await self._pass_on(msg)
                return
            try:
                # The event as it is now: `leave` starts a new one once it is done, and the
                # task may first run after that.
                self._tasks.start_soon(self._later, server, endpoint, msg, self._elsewhere, done)
                handed = True
            except RuntimeError:  # stopping: whoever holds the seat answers it
                await self._pass_on(msg)
        finally:
            if not handed and done is not None:
                done()

    async def _later(
        self, server: Server, endpoint: Endpoint, msg: Msg, elsewhere: anyio.Event,
        done: Callable[[], None] | None,
    ) -> None:  # fmt: skip
        handed = False
        try:
            try:
                with anyio.move_on_after(SEAT_WAIT):
                    await first_of(self._ready, elsewhere)
            except anyio.get_cancelled_exc_class():
                # This standby stops without having left the group in time (a second signal,
                # a leave past its deadline): the request still goes to whoever holds the seat.
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await self._pass_on(msg)
                raise
            if self._holder is None and elsewhere.is_set():
                await self._pass_on(msg)
                return
            if self._holder is None:

                async def unavailable() -> None:
                    raise wire.BadRequest(
                        "no controller holds the seat yet; try again", code="unavailable"
                    )

                await bus.answer(msg, unavailable)
                return
            handed = True
            await server.answer(endpoint, msg, done)
        finally:
            if not handed and done is not None:
                done()

    async def _pass_on(self, msg: Msg) -> None:
        """Send a request we hold on to the group again, with its reply subject: the holder
        answers the client directly (we have left the group, so it cannot come back to us)."""
        self.passed_on += 1
        await self._nc.publish(msg.subject, msg.data, reply=msg.reply)

    async def leave(self) -> int:
        """Another controller holds the seat (or this one stops): leave the group and pass on
        what we hold; how many requests were passed on."""
        before = self.passed_on
        self._elsewhere.set()
        await self.stop(drain=True)  # what is still queued for us goes through on_message
        self._elsewhere = anyio.Event()
        await anyio.lowlevel.checkpoint()  # the held requests woken by `_elsewhere` go first
        return self.passed_on - before

    async def stop(self, *, drain: bool, hosts_drain: bool | None = None) -> bool:
        """Drain (answer what is in flight) or, without a connection, just unsubscribe: the
        verbs as `drain` says, the hosts' requests as `hosts_drain` (as `drain` when None: the
        hosts' connection answers or not on its own); False if any subscription ran out of
        time or failed."""
        stopped: list[bool] = []

        async def stop(server: Server, drain: bool) -> None:
            stopped.append(await server.stop(drain=drain))

        async with anyio.create_task_group() as tg:  # at once: a cut link costs one deadline
            tg.start_soon(stop, self._server, drain)
            tg.start_soon(stop, self._hosts, drain if hosts_drain is None else hosts_drain)
        return all(stopped)


async def announce(nc: Client, me: SeatAnnounce, signing: Signing) -> str | None:
    """Holder: say a handover starts; the standby that is ready to take the seat, if any."""
    ready = await nc.subscribe(subjects.seat("ready"))
    try:
        await signing.publish(nc, subjects.seat("handover"), wire.encode(me))
        await nc.flush()
        with anyio.move_on_after(READY_WAIT):
            async for msg in origin.arrivals(ready):
                if not signing.genuine(msg):
                    origin.STRAYS.refused(ready.subject, msg, "not signed by the controllers")
                    continue
                try:
                    return wire.decode(msg.data, SeatAnnounce).instance
                except wire.BadRequest:
                    return "?"
        return None
    finally:
        await ready.unsubscribe()


async def stand_ready(
    nc: Client, me: SeatAnnounce, verbs: VerbSubscriptions, signing: Signing
) -> None:
    """Standby: on each `handover`, join the verb queue group and say so. When another standby
    takes the seat (its `held`), or none does within EARLY_FOR, leave the group again, passing
    on the requests held meanwhile. Cancelled from outside once the seat is ours."""
    seat = await nc.subscribe(subjects.seat("*"))
    try:
        async with anyio.create_task_group() as tg:
            async for msg in origin.arrivals(seat):
                event = subjects.last(msg.subject)
                if event not in ("handover", "held"):
                    continue
                other = signing.announcement(msg, subscribed=seat.subject)
                if other is None:
                    continue
                if event == "held" and other.instance != me.instance and verbs.active:
                    passed = await verbs.leave()
                    log.info("controller %s: %s holds the seat; left the verb group, %d "
                             "request(s) passed on to it", me.instance, other.instance,
                             passed)  # fmt: skip
                elif event == "handover" and not verbs.active:
                    await verbs.subscribe()
                    await signing.publish(nc, subjects.seat("ready"), wire.encode(me))
                    log.info("controller %s: %s hands over; subscribed to verbs, ready",
                             me.instance, other.instance)  # fmt: skip
                    # A deadline of its own: a `held` we missed (or a holder that died before
                    # sending it) must not leave us in the group, holding every verb that
                    # lands here for SEAT_WAIT.
                    tg.start_soon(_leave_if_not_seated, me, verbs, verbs.since)
    finally:
        await seat.unsubscribe()


async def _leave_if_not_seated(
    me: SeatAnnounce, verbs: VerbSubscriptions, since: float | None
) -> None:
    """Leave the verb group EARLY_FOR after joining it (at `since`), unless we left already
    (and maybe joined again: that join has its own deadline) or the seat came first (then
    `stand_ready` and this with it are cancelled)."""
    await anyio.sleep(max(0.0, (since or time.monotonic()) + EARLY_FOR - time.monotonic()))
    if verbs.active and verbs.since == since:
        passed = await verbs.leave()
        log.info("controller %s: the seat did not come within %gs; left the verb group, %d "
                 "request(s) passed on", me.instance, EARLY_FOR, passed)  # fmt: skip
