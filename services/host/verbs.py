"""The host's own verbs on mesh.host.<name>.<verb>: a fixed table served through mesh/serving.py.

status (this host: registration, applied declaration, processes), logs (a process's output from
an offset, for `mesh logs [-f]`), restart (one process or tool server), tool (call a tool of one
of its tool servers), build (for the controller, on a builder)."""

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client

from mesh import paging, subjects, wire
from mesh.auth.signing import Signing
from mesh.model import (
    BuildReply,
    BuildRequest,
    LogsReply,
    LogsRequest,
    ProcessState,
    RestartReply,
    RestartRequest,
    StatusRequest,
    ToolCallReply,
    ToolCallRequest,
)
from mesh.serving import Bound, Endpoint, Server, Stats, Verb
from services.host import builder, logwriter
from services.host.supervisor import Supervisor
from services.host.tools import ToolRuntime


class HostStatus(msgspec.Struct):
    """The `status` verb's reply."""

    name: str
    pid: int
    tier: int | None
    labels: dict[str, str]
    root: str
    dev_mode: bool  # no root rights: accounts map to the current user
    registered: bool
    epoch: int
    started: datetime
    applied: str | None = None  # digest of the declaration applied
    applied_epoch: int = 0
    processes: list[ProcessState] = []
    version: str = ""  # this agent's running mesh (mesh/version.py)


class Host(msgspec.Struct):
    """What the verbs need of the host."""

    name: str
    root: Path  # where bundles, files, logs and state live
    nc: Client
    supervisor: Supervisor
    tools: ToolRuntime
    status: Callable[[], HostStatus]
    signing: Signing = Signing()  # the controllers' key: a build is done only when they ask


LOOK_EVERY = 0.1  # seconds between looks at a followed log, on this machine


def _log_file(h: Host, process: str, *, prepare: bool = False) -> Path:
    return h.root / "processes" / process / "logs" / ("prepare.log" if prepare else "output.log")


def _start(path: Path, req: LogsRequest) -> int | None:
    """Where a read starts: the offset asked, where the last `tail` lines or the lines since a
    time start, or None (the last `max` bytes)."""
    if req.offset is not None:
        return req.offset
    if req.tail is not None:  # at most the last `max` bytes of them
        return max(logwriter.tail_offset(path, req.tail), logwriter.end(path) - req.max)
    if req.since is not None:
        return logwriter.since(path, req.since)
    return None


async def status(h: Host, _: StatusRequest) -> HostStatus:
    return h.status()


async def logs(h: Host, req: LogsRequest) -> LogsReply:
    path = _log_file(h, req.process, prepare=req.prepare)
    known = req.process in h.supervisor.running or req.process in h.tools.servers
    if not known and not _log_file(h, req.process).exists():
        raise wire.BadRequest(f"no process {req.process} on {h.name}", code="not_found")
    # Offsets count the whole output, across the rotated files (logwriter.py).
    start = await anyio.to_thread.run_sync(_start, path, req)  # a look back reads files
    offset, data = logwriter.read(path, start, req.max)
    # A follower's request waits here for new output: the file is this machine's, so looking
    # at it often costs nothing on the bus; the reply goes the moment there is something.
    deadline = time.monotonic() + req.wait
    while not data and time.monotonic() < deadline:
        await anyio.sleep(LOOK_EVERY)
        offset, data = logwriter.read(path, offset, req.max)
    room = paging.room(paging.budget(h.nc.max_payload), LogsReply(req.process, offset, ""))
    return _fitting(req, offset, data, room=room)


def _fitting(req: LogsRequest, offset: int, data: bytes, *, room: int) -> LogsReply:
    """The reply, its data cut to what fits the bus: up to 512 KiB of output may be three times
    that as JSON (a byte that is no UTF-8 is 3, a control character 6). A read from an offset
    keeps its first bytes (the next read goes on from where these end), the tail its last."""
    text = data.decode(errors="replace")
    if paging.encoded_size(text) <= room:
        return LogsReply(process=req.process, offset=offset, data=text)
    tail = req.offset is None and req.since is None  # the last bytes, not the first

    def part(n: int) -> bytes:
        return data[len(data) - n :] if tail else data[:n]

    def fits(n: int) -> bool:
        return paging.encoded_size(part(n).decode(errors="replace")) <= room

    n = paging.largest(len(data), fits)
    return LogsReply(
        process=req.process, offset=offset if tail else offset - len(data) + n,
        data=part(n).decode(errors="replace"),
    )  # fmt: skip


async def restart(h: Host, req: RestartRequest) -> RestartReply:
    if not await h.supervisor.restart(req.process) and not await h.tools.restart(req.process):
        raise wire.BadRequest(f"no process {req.process} on {h.name}", code="not_found")
    return RestartReply(process=req.process, restarted=True)


async def tool(h: Host, req: ToolCallRequest) -> ToolCallReply:
    result = await h.tools.call(req.server, req.tool, req.arguments, timeout=req.timeout)
    return ToolCallReply(
        machine=h.name, server=req.server, tool=req.tool, content=result.get("content") or [],
        is_error=result.get("isError") is True, structured_content=result.get("structuredContent"),
    )  # fmt: skip


async def build(h: Host, req: BuildRequest) -> BuildReply:
    return await builder.build(h.nc, req, root=h.root)


_SMALL = 4 * 1024  # bytes of body: these carry a name or two
_TOOL_BODY = 256 * 1024  # a tool call's arguments
TOOL_CALLS = 64  # tool calls in flight on one host

VERBS: dict[str, Verb] = {
    "status": Verb(StatusRequest, HostStatus, status, limit=_SMALL),
    # Each in its own task: followers wait in theirs (LogsRequest.wait) without holding up
    # anyone else's read.
    "logs": Verb(LogsRequest, LogsReply, logs, limit=_SMALL, bound=Bound("log reads", 64)),
    "restart": Verb(RestartRequest, RestartReply, restart, limit=_SMALL),
    # Each in its own task, at most TOOL_CALLS at once (a flood is answered `busy`): a call
    # waits for its tool server, up to the server's timeout.
    "tool": Verb(
        ToolCallRequest,
        ToolCallReply,
        tool,
        limit=_TOOL_BODY,
        bound=Bound("tool calls", TOOL_CALLS),
    ),
    # argv, paths and a key from a manifest of at most 256 KiB (the controller's push limit)
    "build": Verb(BuildRequest, BuildReply, build, limit=640 * 1024),
}


# What a host does only when the controllers ask (signed by them): operators' verbs are
# scoped by the server's permissions alone (mesh.auth.policy).
SIGNED = frozenset({"build"})


async def serve(h: Host, *, tasks: TaskGroup, stats: Stats) -> Server:
    """Subscribe to this host's verbs, counted in `stats`; the caller stops (drains) the
    returned Server."""
    # One subscription per verb: a long build does not hold up status or logs.
    server = Server(
        nc=h.nc,
        endpoints=[
            Endpoint(
                name,
                subjects.host(h.name, name),
                {name: verb},
                what="host verb",
                genuine=h.signing.genuine if name in SIGNED else None,
            )
            for name, verb in VERBS.items()
        ],
        service="host",
        stats=stats,
    )
    server.serve(h, tasks=tasks)
    await server.subscribe()
    return server
