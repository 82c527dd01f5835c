"""One way to serve verbs, for the controller and hosts alike.

A `Verb` is a typed request, a typed reply, a body limit and a handler. An `Endpoint` is a
subject (wildcards allowed), an optional queue group and a fixed table of verbs keyed by the
subject's last token: nothing is dispatched by a name taken from a message (Salt
CVE-2020-11651), the token is only ever a key into the table. A `Server` holds one subscription
per endpoint, routes each request (decode strictly with the verb's Struct and limit, call the
handler, answer through `mesh.bus.answer`, which never raises) and drains them on stop.

The shape is nats-py's `nats.micro` (an endpoint has a name, a subject, a queue group and a
handler), so registering these as a micro service is a small step; but micro stops its endpoints
by unsubscribing, which drops requests in flight, and a handover must drain (docs/design.md).
So the service protocol is answered beside this (mesh/discovery.py), from the `Stats` every
answer is counted in here: the one place verbs are counted, for discovery and for metrics.
"""

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh import bus, origin, subjects, wire
from mesh.errors import reason

log = logging.getLogger(__name__)

C = TypeVar("C")  # what the handler is given besides the request (the service, a caller)
Q = TypeVar("Q")  # the request
R = TypeVar("R")  # the reply

STOP_WITHIN = 3.0  # each subscription's drain: a bus that is gone must not hold a stop up
BUSY_LOG_EVERY = 10.0  # seconds between log lines about `busy` refusals of one bound
TURN_EVERY = 0.005  # seconds a subscription may hold the event loop with queued requests


@dataclass(frozen=True, eq=False)
class Bound:
    """Verbs that share a bound run each in its own task, at most `in_flight` at once. Past
    that a request waits up to `wait` seconds for a slot (0: none) and is then answered `busy`:
    more in flight would only queue inside the service, holding memory and callers' time."""

    what: str  # named in the busy reply: "slow verbs", "host requests"
    in_flight: int
    wait: float = 0.0


@dataclass(frozen=True)
class Verb(Generic[C, Q, R]):
    request: type[Q]
    reply: type[R]
    handler: Callable[[C, Q], Awaitable[R]]
    limit: int = wire.MAX_BODY  # bytes of body, refused `too_large` before decoding
    bound: Bound | None = None  # None: answered in the subscription's callback, in order
    # What a reply too large for the bus tells the caller to do (mesh.bus.answer); a verb that
    # pages (mesh/paging.py) says how to ask for a smaller page.
    too_large: str = "ask for less"


P = TypeVar("P")


class Parts:
    """What a service serves its verbs from, one object of each type: a verb table names the
    method that serves each verb (`Changes.push`), and the part is found here by its class."""

    def __init__(self, *parts: object) -> None:
        self._by = {type(p): p for p in parts}
        if len(self._by) != len(parts):
            raise ValueError("two parts of one type")

    def of(self, kind: type[P]) -> P:
        part = self._by.get(kind)
        if part is None:
            raise LookupError(f"no {kind.__name__} among the parts served")
        return part  # type: ignore[return-value]


def _as_is(served: Any, subject: str) -> Any:
    return served


UNKNOWN = "(unknown)"  # the verb of a request for a name no table holds: counted, not named


@dataclass
class VerbStats:
    """One verb's answers, as a micro endpoint's stats count them."""

    requests: int = 0
    errors: int = 0  # answered with an error reply (any code, `busy` included)
    processing_ns: int = 0  # from the request arriving to its reply
    last_error: str = ""  # the last error reply's code


@dataclass
class Stats:
    """Every verb's answers over the service's life (across a controller's holds), keyed by
    endpoint and verb; `observe(verb, outcome, seconds)` is called for each (metrics)."""

    observe: Callable[[str, str, float], None] | None = None
    verbs: dict[tuple[str, str], VerbStats] = field(default_factory=dict)

    def record(self, endpoint: str, verb: str, outcome: str | None, started_ns: int) -> None:
        if outcome is None:  # a publish: nobody asked, nothing answered
            return
        took = time.perf_counter_ns() - started_ns
        stats = self.verbs.get((endpoint, verb))
        if stats is None:  # not setdefault: that would make one on every request
            stats = self.verbs[endpoint, verb] = VerbStats()
        stats.requests += 1
        stats.processing_ns += took
        if outcome != "ok":
            stats.errors += 1
            stats.last_error = outcome
        if self.observe is not None:
            self.observe(verb, outcome, took / 1e9)

    def of(self, endpoint: str, verb: str) -> VerbStats:
        return self.verbs.get((endpoint, verb)) or VerbStats()


@dataclass(frozen=True)
class Endpoint:
    """One subscription: `verbs` keyed by the subject's last token. `caller(served, subject)`
    is what the handlers get (the service itself by default); it may refuse with BadRequest,
    answered before the verb is looked up."""

    name: str  # as a micro endpoint's name
    subject: str
    verbs: Mapping[str, Verb[Any, Any, Any]]
    queue: str | None = None
    caller: Callable[[Any, str], Any] = _as_is
    what: str = "verb"  # "unknown verb 'x'", "unknown host verb 'x'"
    # Whether the controllers signed a request (mesh.auth.signing): for what a host obeys
    # from them only (builds); None for verbs anyone the server lets publish may ask.
    genuine: Callable[[Msg], bool] | None = None
    # nats-py's pending limits of its subscription, (messages, bytes): past them what comes is
    # dropped (and said, counted); None: nats-py's own (512Ki messages, 128 MiB).
    pending: tuple[int, int] | None = None


Deliver = Callable[[Endpoint, Msg], Awaitable[None]]


@dataclass
class Server:
    """The subscriptions of a set of endpoints on one connection, the one place they live.
    `serve(served, tasks=...)` says what handlers are given and where bounded verbs run;
    `subscribe(deliver)` lets a caller hold messages before routing them (a standby waiting
    for the seat); `stop` drains."""

    nc: Client
    endpoints: Sequence[Endpoint]
    service: str  # "controller", "host": named in `internal` and `unavailable` replies
    stats: Stats = field(default_factory=Stats)  # given by the service: it outlives a Server
    since: float | None = None  # when the subscriptions were flushed (time.monotonic)
    # Why the service is too busy to take any request now (None: it is not): every request is
    # then answered `busy` before it is decoded (the controller sheds when its event loop runs
    # late, so the seat's own pings stay on time).
    overloaded: Callable[[], str | None] | None = None
    _subs: dict[str, Subscription] = field(default_factory=dict)  # by endpoint name
    _served: Any = None
    _tasks: TaskGroup | None = None
    _limiters: dict[Bound, anyio.CapacityLimiter] = field(default_factory=dict)
    _busy: dict[str, tuple[int, float]] = field(default_factory=dict)  # refusals not yet logged

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def subscriptions(self) -> list[Subscription]:
        """The endpoints' subscriptions, as they are now."""
        return list(self._subs.values())

    def serve(self, served: Any, *, tasks: TaskGroup) -> None:
        self._served = served
        self._tasks = tasks

    async def subscribe(self, deliver: Deliver | None = None) -> None:
        """Subscribe every endpoint not subscribed yet: one cancelled half-way (a standby
        that got the seat while it was joining the verb group) is completed by the next call."""
        missing = [e for e in self.endpoints if e.name not in self._subs]
        if not missing:
            return
        route = deliver or self.answer
        for endpoint in missing:
            limits: dict[str, int] = {}
            if endpoint.pending is not None:
                limits = {"pending_msgs_limit": endpoint.pending[0],
                          "pending_bytes_limit": endpoint.pending[1]}  # fmt: skip
            self._subs[endpoint.name] = await self.nc.subscribe(
                endpoint.subject, queue=endpoint.queue or "", cb=_callback(route, endpoint),
                **limits,
            )  # fmt: skip
        await self.nc.flush()
        self.since = time.monotonic()

    async def stop(self, *, drain: bool) -> bool:
        """Drain (answer what is in flight) or, without a connection, just unsubscribe; False
        if any of them ran out of time or failed."""
        subs, self._subs = self._subs, {}
        failed: list[str] = []

        async def stop(name: str, sub: Subscription) -> None:
            try:
                with anyio.fail_after(STOP_WITHIN):
                    await (sub.drain() if drain else sub.unsubscribe())
            except Exception as e:
                failed.append(name)
                log.warning("could not stop the %s subscription: %s", name, reason(e))

        async with anyio.create_task_group() as tg:  # at once: a cut link costs one deadline
            for name, sub in subs.items():
                tg.start_soon(stop, name, sub)
        return not failed

    async def answer(
        self, endpoint: Endpoint, msg: Msg, done: Callable[[], None] | None = None
    ) -> None:
        """Route one request of `endpoint` and answer it (now, or from a bounded verb's task);
        `done()` once it is answered, whatever the answer (a caller counting what is in flight)."""
        if done is None:
            await self._answer(endpoint, msg, None)
            return
        handed = False
        try:
            handed = await self._answer(endpoint, msg, done)
        finally:
            if not handed:
                done()

    async def _answer(self, endpoint: Endpoint, msg: Msg, done: Callable[[], None] | None) -> bool:
        """`answer`; True when the answer was handed to a task, which calls `done`."""
        started = time.perf_counter_ns()
        name = subjects.last(msg.subject)
        verb = endpoint.verbs.get(name)
        served = self._served
        counted = name if verb is not None else UNKNOWN

        # (Annotations as strings: a nested def evaluates its annotations at every request.)
        async def serve() -> "Any":
            caller = endpoint.caller(served, msg.subject)
            if verb is None:
                known = ", ".join(sorted(endpoint.verbs))
                raise wire.BadRequest(
                    f"unknown {endpoint.what} {name[:64]!r}; known: {known}", code="unknown_verb"
                )
            return await verb.handler(caller, wire.decode(msg.data, verb.request, limit=verb.limit))

        shed = self.overloaded() if self.overloaded is not None and verb is not None else None
        if shed is not None:  # cheaply, before any work: what keeps time must keep it
            self._refused(shed, name)
            self.stats.record(endpoint.name, counted, await self._busy_reply(msg, shed), started)
            return False
        hint = verb.too_large if verb is not None else "ask for less"
        if verb is None or verb.bound is None or self._tasks is None:
            # Answered here, no task nor closure more: `status` and the other quick verbs are
            # most of what is asked, and each allocation shows in its rate (bench/verbs.py).
            outcome = await bus.answer(msg, serve, service=self.service, hint=hint)
            self.stats.record(endpoint.name, counted, outcome, started)
            return False

        async def answer(serve: "Callable[[], Awaitable[Any]]") -> None:
            outcome = await bus.answer(msg, serve, service=self.service, hint=hint)
            self.stats.record(endpoint.name, counted, outcome, started)

        bound = verb.bound
        limiter = self._limiters.get(bound)
        if limiter is None:
            limiter = self._limiters[bound] = anyio.CapacityLimiter(bound.in_flight)
        slot = object()  # borrows one of the bound's slots; given back when answered
        got = False
        if bound.wait > 0:
            # Waiting here holds the next requests in the subscription's buffer, in order.
            with anyio.move_on_after(bound.wait):
                await limiter.acquire_on_behalf_of(slot)
                got = True
        else:
            try:
                limiter.acquire_on_behalf_of_nowait(slot)
                got = True
            except anyio.WouldBlock:
                pass
        if not got:
            why = f"{bound.in_flight} {bound.what} in flight"
            self._refused(why, name)
            self.stats.record(endpoint.name, counted, await self._busy_reply(msg, why), started)
            return False
        try:
            self._tasks.start_soon(self._answer_then_release, limiter, slot, answer, serve, done)
            return True
        except RuntimeError:  # stopping: the task group is closed; answer here instead
            limiter.release_on_behalf_of(slot)
        await answer(serve)
        return False

    def _refused(self, why: str, verb: str) -> None:
        """Log a `busy` refusal: the first of a burst, then a count at most every BUSY_LOG_EVERY
        seconds (a storm refuses thousands a second; its log must not cost as much)."""
        now = time.monotonic()
        count, since = self._busy.get(why, (0, float("-inf")))
        if now - since >= BUSY_LOG_EVERY:
            more = f" (and {count} more since the last said)" if count else ""
            log.warning("busy: refused %s (%s)%s", verb[:64], why, more)
            self._busy[why] = (0, now)
        else:
            self._busy[why] = (count + 1, since)

    async def _busy_reply(self, msg: Msg, why: str) -> str | None:
        async def busy() -> Any:
            raise wire.BadRequest(f"the {self.service} is busy ({why}); try again", code="busy")

        return await bus.answer(msg, busy, service=self.service)

    async def _answer_then_release(
        self,
        limiter: anyio.CapacityLimiter,
        slot: object,
        answer: Callable[[Callable[[], Awaitable[Any]]], Awaitable[None]],
        serve: Callable[[], Awaitable[Any]],
        done: Callable[[], None] | None,
    ) -> None:
        try:
            await answer(serve)
        finally:
            limiter.release_on_behalf_of(slot)
            if done is not None:
                done()


class Turns:
    """One subscription's turns of the event loop. nats-py hands a subscription's messages over
    one after another without letting the loop turn while more are queued: a storm of ten
    thousand registrations, each only started, held every other subscription (`status`, the
    seat's pings) for seconds (bench/scale.py's cold start), and a host's flood of beats did
    the same. So a callback lets the loop turn every TURN_EVERY seconds."""

    def __init__(self) -> None:
        self._turned = time.monotonic()  # when this subscription last had the loop back

    async def take(self) -> None:
        if time.monotonic() - self._turned > TURN_EVERY:
            await anyio.lowlevel.checkpoint()
            # Counted from when the loop came back, not from when it was let go: a turn that
            # itself took longer than TURN_EVERY (a host's flood read on another connection)
            # must not make every message after it wait for a whole turn of its own, which
            # left `status` queued for seconds behind 500 others at a few ms each.
            self._turned = time.monotonic()


def _callback(route: Deliver, endpoint: Endpoint) -> Callable[[Msg], Awaitable[None]]:
    """What reaches the endpoint's route: requests someone made on its own subjects (never a
    JetStream delivery aimed here, nor an answer reflected here: mesh/origin.py), signed where
    the endpoint asks for it. Anything else is dropped unanswered, and said."""

    match = origin.matcher(endpoint.subject)
    turns = Turns()

    async def on_message(msg: Msg) -> None:
        await turns.take()
        if not origin.expected(endpoint.subject, msg, match):
            return
        if not origin.asked(msg):
            origin.STRAYS.refused(endpoint.subject, msg, "not a request (its reply is no inbox)")
            return
        if endpoint.genuine is not None and not endpoint.genuine(msg):
            origin.STRAYS.refused(endpoint.subject, msg, "not signed by the controllers")
            return
        await route(endpoint, msg)

    return on_message
