"""`mesh mcp`: an MCP server (stdio, or streamable HTTP on loopback) that offers every tool of
the fleet to an MCP client and forwards each call over the bus to the machine that runs it;
beside them, the fleet's own verbs (`mesh_status`, `mesh_assign`, ...: fleet.py), as the
operator of its credentials. A role that may not call the machines' tools is not offered them.

Built with the `mcp` package's low-level server. A tool is named `<machine>.<server>.<tool>`
(`node-2.files.read`): machine and server names have no dots, so the first two dots split a
name back unambiguously. MCP names are `[A-Za-z0-9._-]`, at most 128 characters; a tool whose
full name cannot be written so is left out, with a warning on stderr. Only tools of machines
that are up and of tool servers that are ready are listed; the list is asked of the controller
again (the `tools` verb) at most once a second, at each `tools/list`, and whenever a host
reports its tools (`mesh.event.*.tools`) or every WATCH_EVERY seconds: when what would be
listed changed, every client is told (`notifications/tools/list_changed`). A call goes to the
machine's host (`mesh.host.<name>.tool`, as `mesh tool call` does); whatever keeps it from a
result (an unknown tool, a server that is not ready, a timeout, a machine that does not answer,
credentials that may not call tools) is an MCP tool error (`isError`) saying so; so is a name
whose machine, server or tool is not a name (`*`, `>`), refused before anything is sent.
"""

import ipaddress
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import anyio
import mcp.types as types
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.stdio import stdio_server
from nats.aio.client import Client

from mesh import bus, subjects
from mesh.client.asking import VerbFailed, connected
from mesh.client.tools import CALL_TIMEOUT, ToolCallFailed, call_tool, check_call, fleet_tools
from mesh.errors import MeshError
from mesh.metrics import Listen
from mesh.model import ToolEntry
from mesh.names import InvalidName
from programs.mcp.fleet import VERBS, FleetVerbs

log = logging.getLogger("mesh.mcp")

LIST_EVERY = 1.0  # seconds a listing of the fleet's tools is reused
WATCH_EVERY = 5.0  # seconds between looks at the fleet's tools without a report (machines down)
LIST_TIMEOUT = 5.0
MCP_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")  # MCP's tool names (SEP-986)


class McpError(MeshError):
    """`mesh mcp` cannot start (where it would listen)."""


def mcp_name(entry: ToolEntry) -> str | None:
    name = f"{entry.machine}.{entry.server}.{entry.name}"
    return name if MCP_NAME.fullmatch(name) else None


def split(name: str) -> tuple[str, str, str] | None:
    parts = name.split(".", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 and all(parts) else None


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)],
                                is_error=True)  # fmt: skip


class FleetTools:
    """The fleet's tools as the controller lists them, and calls to them over the bus."""

    def __init__(self, nc: Client, *, url: str, verbs: FleetVerbs) -> None:
        self._nc = nc
        self._url = url
        self._verbs = verbs  # the fleet's own verbs (fleet.py), listed and called beside
        self._listed: dict[str, ToolEntry] = {}
        self._at = -LIST_EVERY
        self._listing = anyio.Lock()
        self._warned: set[str] = set()
        self._calls: list[tuple[str, anyio.CancelScope]] = []  # (subject, scope) in flight
        self._sessions: set[Any] = set()  # clients that listed, told when the list changes
        self._shown: frozenset[str] = frozenset()  # the names the clients were last given

    def denied(self, action: str) -> None:
        """The server refused a publish of ours: the call it belongs to ends `forbidden`."""
        for subject, scope in self._calls:
            if action.endswith(subject):
                scope.cancel()

    async def tools(self) -> dict[str, ToolEntry]:
        async with self._listing:
            if time.monotonic() - self._at >= LIST_EVERY:
                listed: dict[str, ToolEntry] = {}
                for entry in await fleet_tools(self._nc, url=self._url, timeout=LIST_TIMEOUT):
                    name = mcp_name(entry)
                    if name is None:
                        full = f"{entry.machine}.{entry.server}.{entry.name}"
                        if full not in self._warned:
                            self._warned.add(full)
                            log.warning("tool %r left out: not an MCP tool name "
                                        "([A-Za-z0-9._-], at most 128)", full[:200])  # fmt: skip
                        continue
                    listed[name] = entry
                self._listed, self._at = listed, time.monotonic()
            return self._listed

    async def _offered(self) -> dict[str, ToolEntry]:
        """The tools that can be called now, by these credentials (none: a role that may not
        call a machine's tools)."""
        if not await self._verbs.may_call_tools():
            return {}
        found = await self.tools()
        return {n: e for n, e in sorted(found.items()) if e.up and e.state == "ready"}

    async def list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        self._sessions.add(ctx.session)
        try:
            found = await self._offered()
        except VerbFailed as e:
            log.warning("could not list the fleet's tools: %s", e)
            found = {}
        self._shown = frozenset(found)
        return types.ListToolsResult(
            tools=await self._verbs.tools()
            + [
                types.Tool(
                    name=name,
                    description=f"{e.description} (tool {e.name} of tool server {e.server} on "
                    f"machine {e.machine})",
                    input_schema=e.input_schema or {"type": "object"},
                )
                for name, e in found.items()
            ]
        )

    async def watch(self) -> None:
        """Tell the clients when the tools they would be listed change: looked at after each
        host's tools report (a moment later, so a burst is one look) and every WATCH_EVERY s."""
        reported = anyio.Event()

        async def heard(_: Any) -> None:
            reported.set()

        await self._nc.subscribe(subjects.event("*", "tools"), cb=heard)
        while True:
            with anyio.move_on_after(WATCH_EVERY):
                await reported.wait()
                await anyio.sleep(0.5)
            reported = anyio.Event()
            if not self._sessions:
                continue
            try:
                now = frozenset(await self._offered())
            except VerbFailed:
                continue
            if now == self._shown:
                continue
            self._shown = now
            for session in list(self._sessions):
                try:
                    with anyio.fail_after(5):
                        await session.send_tool_list_changed()
                except Exception:  # a client gone: not told again
                    self._sessions.discard(session)

    async def call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name in VERBS:
            return await self._verbs.call(params.name, params.arguments)
        where = split(params.name)
        if where is None:
            return _error(f"{params.name!r} is not a tool of the fleet (MACHINE.SERVER.TOOL)")
        machine, server, tool = where
        # Before anything goes on the bus (the listing included): `*` or `>` as a machine would
        # be a wildcard in the call's subject.
        try:
            check_call(machine=machine, server=server, tool=tool)
        except InvalidName as e:
            return _error(f"{params.name[:200]!r} is not a tool of the fleet: {e}")
        try:
            known = (await self.tools()).get(params.name)
        except VerbFailed:
            known = None
        timeout = known.timeout if known is not None else CALL_TIMEOUT
        subject = subjects.host(machine, "tool")
        with anyio.CancelScope() as scope:
            self._calls.append((subject, scope))
            try:
                reply = await call_tool(
                    self._nc, machine=machine, server=server, tool=tool,
                    arguments=dict(params.arguments or {}), timeout=timeout,
                )  # fmt: skip
            except ToolCallFailed as e:
                return _error(str(e))
            finally:
                self._calls.remove((subject, scope))
        if scope.cancelled_caught:
            return _error(f"forbidden: these credentials may not call tools (NATS refused "
                          f"to let them publish to {subject}); a tools or admin operator's "
                          "may")  # fmt: skip
        result: dict[str, Any] = {"content": reply.content, "isError": reply.is_error}
        if reply.structured_content is not None:
            result["structuredContent"] = reply.structured_content
        try:
            return types.CallToolResult.model_validate(result)
        except ValueError as e:
            return _error(f"{machine} {server}.{tool} answered with a result MCP does not "
                          f"take: {str(e).splitlines()[0]}")  # fmt: skip


def server(fleet: FleetTools) -> Server:
    return Server(
        "mesh",
        version="1",
        instructions="A mesh fleet: its own verbs as the operator of these credentials "
        "(mesh_status, mesh_nodes, mesh_plan, mesh_assign, ...), and the tools of every machine, "
        "named MACHINE.SERVER.TOOL, each call run on that machine.",
        on_list_tools=fleet.list_tools,
        on_call_tool=fleet.call_tool,
    )


def options(mcp: Server) -> Any:
    return mcp.create_initialization_options(NotificationOptions(tools_changed=True))


def _loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


async def serve(*, url: str, creds: str | None, http: Listen | None = None) -> None:
    """Serve until stdin ends (stdio) or until interrupted (HTTP)."""
    logging.getLogger("mcp").setLevel(logging.WARNING)  # a line per request otherwise
    if http is not None and not _loopback(http[0]):
        raise McpError(f"--http: {http[0]} is not a loopback address: mesh mcp has no "
                       "authentication of its own, so it listens on loopback only")  # fmt: skip
    # Fail at once, in one line, when NATS cannot be reached or refuses the credentials; then
    # serve on a connection of our own that rides over NATS restarts.
    async with connected(url=url, creds=creds, what="mcp"):
        pass
    refused: list[Callable[[str], None]] = []  # the fleet's, once it exists
    nc = await bus.connect(
        url, name="mesh mcp", creds=creds, denied=lambda action: [f(action) for f in refused]
    )
    try:
        fleet = FleetTools(nc, url=url, verbs=FleetVerbs(url=url, creds=creds))
        refused.append(fleet.denied)
        mcp = server(fleet)
        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.watch)
            if http is None:
                await _stdio(mcp)
            else:
                await _http(mcp, http)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await bus.close(nc)


async def _stdio(mcp: Server) -> None:
    async with stdio_server() as (read, write):
        await mcp.run(read, write, options(mcp))


async def _http(mcp: Server, listen: Listen) -> None:
    import uvicorn

    addr, port = listen
    app = mcp.streamable_http_app(host=addr)
    # SIGTERM is uvicorn's to handle here: its graceful shutdown is bounded so that, with the
    # bounded close of NATS after it, `mesh mcp` exits within mesh.lifetime.STOP_WITHIN.
    config = uvicorn.Config(app, host=addr, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=5)  # fmt: skip
    log.info("mesh mcp: streamable HTTP on http://%s:%d/mcp", addr, port)
    await uvicorn.Server(config).serve()
