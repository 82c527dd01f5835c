"""The host's own verbs on mesh.host.<name>.<verb>: a fixed table, strict bodies, error replies.

status (this host: registration, applied declaration, processes), logs (a process's output from
an offset, for `mesh logs [-f]`), restart (one process), build (for the controller, on a
builder)."""

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import bus, subjects, wire
from mesh.model import (
    BuildReply,
    BuildRequest,
    LogsReply,
    LogsRequest,
    RestartReply,
    RestartRequest,
    StatusRequest,
)
from services.host import builds, logwriter
from services.host.supervisor import Supervisor

log = logging.getLogger(__name__)


class Host(msgspec.Struct):
    """What the verbs need of the host."""

    name: str
    root: Path  # where bundles, files, logs and state live
    nc: Client
    supervisor: Supervisor
    status: Callable[[], Any]


def _log_file(h: Host, process: str) -> Path:
    return h.root / "processes" / process / "logs" / "output.log"


async def status(h: Host, _: StatusRequest) -> Any:
    return h.status()


async def logs(h: Host, req: LogsRequest) -> LogsReply:
    path = _log_file(h, req.process)
    if req.process not in h.supervisor.running and not path.exists():
        raise wire.BadRequest(f"no process {req.process} on {h.name}", code="not_found")
    # Offsets count the whole output, across the rotated files (logwriter.py).
    offset, data = logwriter.read(path, req.offset, req.max)
    return LogsReply(process=req.process, offset=offset, data=data.decode(errors="replace"))


async def restart(h: Host, req: RestartRequest) -> RestartReply:
    if not await h.supervisor.restart(req.process):
        raise wire.BadRequest(f"no process {req.process} on {h.name}", code="not_found")
    return RestartReply(process=req.process, restarted=True)


async def build(h: Host, req: BuildRequest) -> BuildReply:
    return await builds.build(h.nc, req, root=h.root)


class Verb(NamedTuple):
    request: type
    handler: Callable[[Host, Any], Awaitable[Any]]
    limit: int = 4 * 1024  # bytes of body: these carry a name or two


VERBS: dict[str, Verb] = {
    "status": Verb(StatusRequest, status),
    "logs": Verb(LogsRequest, logs),
    "restart": Verb(RestartRequest, restart),
    # argv, paths and a key from a manifest of at most 256 KiB (the controller's push limit)
    "build": Verb(BuildRequest, build, limit=640 * 1024),
}


async def serve(h: Host) -> None:
    async def on_msg(msg: Msg) -> None:
        name = msg.subject.rsplit(".", 1)[-1]
        verb = VERBS.get(name)

        async def serve() -> Any:
            if verb is None:
                raise wire.BadRequest(
                    f"unknown host verb {name[:64]!r}; known: {', '.join(sorted(VERBS))}",
                    code="unknown_verb",
                )
            return await verb.handler(h, wire.decode(msg.data, verb.request, limit=verb.limit))

        await bus.answer(msg, serve, service="host")

    # One subscription per verb: a long build does not hold up status or logs.
    for name in VERBS:
        await h.nc.subscribe(subjects.host(h.name, name), cb=on_msg)
