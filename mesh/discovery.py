"""NATS service discovery: the `$SRV` protocol of nats.micro, answered beside mesh/serving.py.

`nats micro ls|info|stats` (and anything else that speaks the protocol) sends a request to
`$SRV.<PING|INFO|STATS>`, `$SRV.<VERB>.<name>` or `$SRV.<VERB>.<name>.<id>` and gathers every
reply. The replies here are nats.micro's (`io.nats.micro.v1.ping_response`, `info_response`,
`stats_response`, the same fields), built by hand rather than by registering the verbs with
`nats.micro.Service`: micro stops its endpoints by unsubscribing, which drops requests in
flight, and the seat's handover relies on draining them (docs/design.md). So the verbs stay
served by mesh/serving.py, and a `Discovery` lists them as endpoints (name, subject, queue
group) with the counts serving.Stats keeps (requests, errors, processing time).

Names: the controller is `mesh-controller` (its id: the instance name), a host `mesh-host` (its
id: the machine name), so `$SRV.INFO.mesh-host.node-2` asks one host. Who may ask is in
mesh/auth/policy.py (docs/security.md).
"""

import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib import metadata as dist
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh import origin, subjects, wire
from mesh.serving import Endpoint, Stats

log = logging.getLogger(__name__)

PING_TYPE = "io.nats.micro.v1.ping_response"
INFO_TYPE = "io.nats.micro.v1.info_response"
STATS_TYPE = "io.nats.micro.v1.stats_response"


class Ping(msgspec.Struct):
    type: str
    name: str
    id: str
    version: str
    metadata: dict[str, str]


class EndpointInfo(msgspec.Struct):
    name: str
    subject: str
    queue_group: str
    metadata: dict[str, str] | None = None


class Info(msgspec.Struct):
    type: str
    name: str
    id: str
    version: str
    description: str
    endpoints: list[EndpointInfo]
    metadata: dict[str, str]


class EndpointStats(msgspec.Struct):
    name: str
    subject: str
    queue_group: str
    num_requests: int
    num_errors: int
    last_error: str
    processing_time: int  # nanoseconds, in total
    average_processing_time: int  # nanoseconds
    data: Any = None


class StatsReply(msgspec.Struct):
    type: str
    name: str
    id: str
    version: str
    started: str  # RFC 3339 in UTC, as micro writes it
    endpoints: list[EndpointStats]
    metadata: dict[str, str]


def version() -> str:
    """The mesh's package version: micro wants semantic versioning (`0.1.0`); which code runs
    (a bundle's digest) is in the metadata."""
    try:
        return dist.version("mesh")
    except dist.PackageNotFoundError:
        return "0.0.0"


def listed(endpoints: Sequence[Endpoint]) -> list[tuple[Endpoint, str, str]]:
    """Each verb as a micro endpoint: (its serving Endpoint, its name, its own subject: the
    endpoint's subject with the verb as the last token)."""
    return [
        (e, verb, f"{e.subject.rsplit('.', 1)[0]}.{verb}") for e in endpoints for verb in e.verbs
    ]


class Discovery:
    """Answers `$SRV.*` for one service instance. `endpoints()` and `metadata()` are read at
    each request: a controller lists its verbs only while it holds the seat."""

    def __init__(
        self,
        nc: Client,
        *,
        name: str,
        id: str,
        description: str,
        stats: Stats,
        endpoints: Callable[[], Sequence[Endpoint]],
        metadata: Callable[[], dict[str, str]],
    ) -> None:
        self._nc = nc
        self.name = name
        self.id = id
        self.description = description
        self._stats = stats
        self._endpoints = endpoints
        self._metadata = metadata
        self._version = version()
        self._started = datetime.now(UTC)
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        """Subscribe to the nine subjects (three verbs: for all, for this name, for this id)."""
        answers = {"PING": self.ping, "INFO": self.info, "STATS": self.stats}
        for verb, reply in answers.items():
            for subject in (
                subjects.srv(verb),
                subjects.srv(verb, self.name),
                subjects.srv(verb, self.name, self.id),
            ):
                self._subs.append(await origin.subscribe(self._nc, subject, cb=_answering(reply)))
        await self._nc.flush()
        log.info("%s %s answers service discovery ($SRV)", self.name, self.id)

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as e:  # a connection already gone: nothing left to stop
                log.debug("could not unsubscribe %s: %s", sub.subject, e)

    def ping(self) -> Ping:
        return Ping(type=PING_TYPE, name=self.name, id=self.id, version=self._version,
                    metadata=self._metadata())  # fmt: skip

    def info(self) -> Info:
        return Info(
            type=INFO_TYPE, name=self.name, id=self.id, version=self._version,
            description=self.description, metadata=self._metadata(),
            endpoints=[
                EndpointInfo(name=verb, subject=subject, queue_group=e.queue or "")
                for e, verb, subject in listed(self._endpoints())
            ],
        )  # fmt: skip

    def stats(self) -> StatsReply:
        endpoints = []
        for e, verb, subject in listed(self._endpoints()):
            s = self._stats.of(e.name, verb)
            endpoints.append(EndpointStats(
                name=verb, subject=subject, queue_group=e.queue or "", num_requests=s.requests,
                num_errors=s.errors, last_error=s.last_error, processing_time=s.processing_ns,
                average_processing_time=s.processing_ns // s.requests if s.requests else 0,
            ))  # fmt: skip
        return StatsReply(
            type=STATS_TYPE, name=self.name, id=self.id, version=self._version,
            started=self._started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
            endpoints=endpoints, metadata=self._metadata(),
        )  # fmt: skip


def _answering(reply: Callable[[], msgspec.Struct]) -> Callable[[Msg], Any]:
    async def on_message(msg: Msg) -> None:
        if not origin.asked(msg):  # answered to inboxes only: never reflected (mesh/origin.py)
            return
        try:
            await msg.respond(wire.encode(reply()))
        except Exception as e:  # one asker's trouble must not take the service down
            log.warning("could not answer %s: %s: %s", msg.subject, type(e).__name__, e)

    return on_message
