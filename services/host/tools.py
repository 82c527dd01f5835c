"""The node's tool runtime: every tool server a declaration names ([tool.NAME]) launched,
spoken to in MCP over stdio, restarted when it dies, and its tools reported and called.

A tool server is supervised as a process is (supervisor.Supervised: its account, its own
process group, no shell, its bundle's folder, its files in ROOT/processes/NAME/files, restarts
with backoff 1 s doubling to 30 s), with three differences: its stdin and stdout are pipes to
this host (the MCP stdio transport, mcpstdio.py) and only its stderr goes to its log
(`mesh logs MACHINE NAME`); it is healthy ("ready") once it has answered `initialize` and
listed its tools, and a server that answers badly is killed and started again; and it cannot be
adopted by a next host (its pipes end with this one), so a host that stops stops its tool
servers, and one that starts kills any a previous host left (ROOT/state/tools.json) before it
starts them again.

A changed tool server is swapped start-first: the new version starts beside the old, calls go
to the old until the new one is ready, then to the new, and the old is stopped once its calls
in flight have ended. A new version that never gets ready is stopped and the old one keeps
serving (the apply reports why).
"""

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client

from mesh import wire
from mesh.model import ProcessState, ToolInfo, ToolServerReport, ToolServerStatus
from mesh.modules.compose import DTool
from mesh.modules.gate import duration
from services.host import processes
from services.host.mcpstdio import CallError, Closed, ProtocolError, Session
from services.host.processes import Instance
from services.host.supervisor import Launch, Supervised, on_trial, retire

log = logging.getLogger(__name__)

READY_WITHIN = 30.0  # initialize and tools/list answered within this, or the server is broken
SWAP_WITHIN = 60.0  # a new version not ready within this is stopped; the old keeps serving
MAX_RESULT = 768 * 1024  # bytes of one call's result: a reply must fit a NATS message (1 MiB)
MAX_DESCRIPTION = 2048  # characters of a tool's description in reports (cut beyond)
MAX_SCHEMA = 16 * 1024  # bytes of a tool's input schema in reports (the tool is left out beyond)
MAX_REPORT = 512 * 1024  # bytes of all of a host's tools in one report
_CALLABLE = re.compile(r"[^\x00-\x1f\x7f]{1,128}")  # a name a call can carry (ToolCallRequest)


class ToolFailed(wire.BadRequest):
    """A call that cannot be answered with a result: the code says what the caller can do."""


class ToolServer(Supervised):
    """One tool server: the process, and its MCP session while it runs."""

    piped = True

    def __init__(
        self, launch: Launch, *, nc: Client, changed: Callable[[], None], ready_within: float
    ) -> None:
        super().__init__(launch, nc=nc, changed=changed)
        self.ready_within = ready_within
        self.session: Session | None = None  # while it is ready
        self._session: Session | None = None  # while it runs
        self.why = ""  # why this instance is not ready, when it answered badly
        self.tools: dict[str, dict[str, Any]] = {}  # name -> as tools/list gave it
        self.notes = ""  # what was left out of its tools, if anything
        self.in_flight = 0
        self._idle = anyio.Event()  # set whenever no call is in flight
        self._idle.set()

    @property
    def tool(self) -> DTool:
        assert isinstance(self.launch.decl, DTool)
        return self.launch.decl

    def _healthy_at_start(self) -> bool:
        return False  # ready once it has answered initialize and tools/list

    def _policy(self) -> str:
        return "always"  # a tool server is there to be called

    def _exited(self, code: int | None) -> None:
        if self.session is not None and self.session.closed is None:
            # what its calls in flight fail with
            self.session.closed = "it exited" + ("" if code is None else f" with code {code}")

    async def _alongside(self, adopted: bool) -> None:
        """The MCP session, for as long as the process runs. A server that answers badly is
        killed: the supervisor starts it again, with backoff."""
        assert self.pipes is not None and self.instance is not None
        pipes, pid = self.pipes, self.instance.pid
        self.why = ""
        relist = anyio.Event()

        def list_changed() -> None:
            relist.set()

        session = Session(stdin=pipes.stdin, stdout=pipes.stdout, on_list_changed=list_changed)
        self._session = session
        broken: str | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(session.run)
                with anyio.fail_after(self.ready_within):
                    await session.initialize(timeout=self.ready_within)
                    await self._list(session)
                self.session = session
                log.info("tool server %s is ready (%s, %d tools)", self.launch.name,
                         session.server.get("name", "?"), len(self.tools))  # fmt: skip
                self._set("running", healthy=True)
                while True:
                    await relist.wait()
                    relist = anyio.Event()
                    with anyio.fail_after(self.ready_within):
                        await self._list(session)
                    self._changed()
        except* Closed:
            broken = ""  # it exited (the supervisor says how) or closed its stdout
        except* ProtocolError as group:
            broken = str(group.exceptions[0])
        except* TimeoutError:
            broken = f"it did not answer initialize and tools/list within {self.ready_within:g}s"
        except* Exception as group:  # whatever a server does must not take the host down
            e = group.exceptions[0]
            log.error("tool server %s: its session failed", self.launch.name, exc_info=e)
            broken = f"its session failed ({type(e).__name__}: {e})"
        finally:
            self.session = None
            with anyio.CancelScope(shield=True):
                await session.end_input()
            os.close(pipes.stdout)
            self.pipes = None
        if broken is not None and not self._stopping:
            if broken:
                self.why = f"does not speak MCP: {broken}"
                log.warning("tool server %s %s: killing it", self.launch.name, self.why)
            self._set("running", healthy=False, error=self.why or "it closed its stdout")
            processes.kill_group(pid)  # the supervisor sees it exit and starts it again
        await anyio.sleep_forever()  # cancelled once it has exited

    async def _list(self, session: Session) -> None:
        listed = await session.list_tools(timeout=self.ready_within)
        self.tools = {t["name"]: t for t in listed}

    async def stop(self) -> None:
        self._stopping = True
        if self._session is not None:  # MCP's way first: the end of its stdin, then SIGTERM
            await self._session.end_input()
        await super().stop()

    @property
    def problem(self) -> str:
        """Why it is not ready, in words ("" when it is)."""
        return "" if self.healthy else (self.why or self.last_error)

    def report(self) -> ProcessState:
        state = super().report()
        return msgspec.structs.replace(state, tool=True, error=self.problem[:256])

    def condition(self) -> ToolServerStatus:
        """What a caller can expect: `ready` once healthy; `starting` while it runs but has not
        listed its tools (or answered badly and is about to be killed); else as the process is
        (a tool server is always restarted: it never stays `exited`)."""
        if self.healthy:
            return "ready"
        match self.state:
            case "starting" | "running":
                return "starting"
            case "exited":
                return "stopped"
            case "restarting":
                return "backoff"  # waiting to be started again
            case state:
                return state

    async def call(self, tool: str, arguments: dict[str, Any], *, timeout: float) -> Any:
        session = self.session
        if session is None or not self.healthy:
            why = f": {self.problem}" if self.problem else ""
            raise ToolFailed(
                f"tool server {self.launch.name} is {self.condition()}{why}", code="unavailable"
            )
        if tool not in self.tools:
            known = ", ".join(sorted(self.tools)[:20]) or "none"
            raise ToolFailed(f"tool server {self.launch.name} has no tool {tool!r} (it has: "
                             f"{known})", code="not_found")  # fmt: skip
        if self.in_flight == 0:
            self._idle = anyio.Event()
        self.in_flight += 1
        try:
            return await session.call_tool(tool, arguments, timeout=timeout)
        except CallError as e:
            if e.timeout:
                raise ToolFailed(f"{self.launch.name}.{tool} did not answer within {timeout:g}s",
                                 code="timeout") from None  # fmt: skip
            raise ToolFailed(f"tool server {self.launch.name} refused the call: {e}") from None
        except ProtocolError as e:
            raise ToolFailed(f"tool server {self.launch.name} stopped during the call: {e}",
                             code="unavailable") from None  # fmt: skip
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def drained(self, within: float) -> None:
        """Until no call is in flight (at most `within` seconds)."""
        with anyio.move_on_after(within):
            await self._idle.wait()


def _describe(server: ToolServer, budget: list[int]) -> ToolServerReport:
    """What a report says of one server, its tools bounded (each, and all of a host's)."""
    tools: list[ToolInfo] = []
    left_out: list[str] = []
    for name, t in sorted(server.tools.items()):
        schema = t.get("inputSchema")
        if not isinstance(schema, dict):
            schema = {"type": "object"}
        size = len(msgspec.json.encode(schema))
        description = t.get("description")
        description = description if isinstance(description, str) else ""
        if len(description) > MAX_DESCRIPTION:
            description = description[: MAX_DESCRIPTION - 1] + "…"
        if not _CALLABLE.fullmatch(name):
            left_out.append(f"{name[:40]!r}: not a name a call can carry")
            continue
        if size > MAX_SCHEMA:
            left_out.append(f"{name}: its input schema is {size} bytes, at most {MAX_SCHEMA}")
            continue
        cost = size + len(description.encode()) + len(name) + 64
        if cost > budget[0]:
            left_out.append(f"{name}: past the {MAX_REPORT}-byte report of this host's tools")
            continue
        budget[0] -= cost
        tools.append(ToolInfo(name=name, description=description, input_schema=schema))
    notes = "; ".join(left_out)
    error = server.problem
    if notes:
        error = f"{error}; left out: {notes}" if error else f"left out: {notes}"
    return ToolServerReport(
        name=server.launch.name, state=server.condition(), error=error[:1024], tools=tools,
        timeout=duration(server.tool.timeout),
    )  # fmt: skip


class ToolRuntime:
    """Every tool server of this machine's declaration, run and called."""

    def __init__(
        self, *, nc: Client, root: Path, changed: Callable[[], None],
        ready_within: float = READY_WITHIN,
    ) -> None:  # fmt: skip
        self._nc = nc
        self._ready_within = ready_within
        self._state = root / "state" / "tools.json"
        self._changed = changed
        self.servers: dict[str, ToolServer] = {}
        self._trials: dict[str, ToolServer] = {}  # new versions, until ready
        self._tg: TaskGroup | None = None
        self._ready = anyio.Event()
        self._one_change = anyio.Lock()

    async def run(self) -> None:
        """Own the servers' tasks until cancelled; then stop every server (its pipes end with
        this host: no next host could adopt it)."""
        await self._stop_left()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._ready.set()
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                for server in [*self.servers.values(), *self._trials.values()]:
                    await server.stop()
                self._save()

    async def _stop_left(self) -> None:
        """Tool servers a previous host left running (it was killed): their stdin and stdout
        were its pipes, so they are stopped; reconcile starts them again."""
        try:
            left = msgspec.json.decode(self._state.read_bytes(), type=dict[str, Instance])
        except (OSError, msgspec.DecodeError):
            return
        for name, instance in left.items():
            instance = msgspec.structs.replace(instance, child=False)
            if processes.alive(instance):
                log.info("tool server %s (pid %d) was a previous host's: stopping it", name,
                         instance.pid)  # fmt: skip
                await retire(instance, timeout=5)
        self._state.unlink(missing_ok=True)

    def _save(self) -> None:
        current = {
            name: s.instance
            for name, s in [
                *self.servers.items(),
                *((f"{n}~new", s) for n, s in self._trials.items()),
            ]
            if s.instance is not None
        }
        self._state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(current))
        tmp.replace(self._state)

    def _on_change(self) -> None:
        self._save()
        self._changed()

    def _start(self, launch: Launch) -> ToolServer:
        assert self._tg is not None, "the tool runtime is not running"
        server = ToolServer(
            launch, nc=self._nc, changed=self._on_change, ready_within=self._ready_within
        )
        self._tg.start_soon(server.run)
        return server

    async def reconcile(
        self, launches: dict[str, Launch], *, interrupt: anyio.Event | None = None
    ) -> list[str]:
        """Make the running tool servers match `launches`; the problems, in words."""
        await self._ready.wait()
        async with self._one_change:
            problems: list[str] = []
            for name in sorted(set(self.servers) - set(launches)):
                log.info("tool server %s is no longer declared: stopping it", name)
                await self.servers.pop(name).stop()
            for name, launch in sorted(launches.items()):
                current = self.servers.get(name)
                if current is None:
                    self.servers[name] = self._start(launch)
                elif current.launch.spec != launch.spec:
                    problem = await self._swap(name, current, launch, interrupt or anyio.Event())
                    if problem:
                        problems.append(problem)
            self._on_change()
            return problems

    async def _swap(
        self, name: str, old: ToolServer, launch: Launch, interrupt: anyio.Event
    ) -> str | None:
        log.info("tool server %s: new version, started beside the old one", name)
        new = self._trials[name] = self._start(launch)
        try:
            await on_trial(new, within=SWAP_WITHIN, interrupt=interrupt)
        finally:
            self._trials.pop(name, None)
        if not new.healthy:
            why = f"the new version of tool server {name} was not ready within {SWAP_WITHIN:g}s"
            if interrupt.is_set():
                why = f"a newer declaration came before the new version of {name} was ready"
            elif new.problem:
                why += f": {new.problem}"
            log.warning("%s; the old version keeps serving", why)
            return why
        self.servers[name] = new  # calls from now on go to the new version
        await old.drained(duration(old.tool.timeout))
        await old.stop()
        return None

    def states(self) -> list[ProcessState]:
        """The tool servers as processes (`tool` set), and any new version on trial."""
        trials = [
            msgspec.structs.replace(s.report(), trial=True) for _, s in sorted(self._trials.items())
        ]
        return [s.report() for _, s in sorted(self.servers.items())] + trials

    def reports(self) -> list[ToolServerReport]:
        budget = [MAX_REPORT]
        return [_describe(s, budget) for _, s in sorted(self.servers.items())]

    async def call(
        self, server: str, tool: str, arguments: dict[str, Any], *, timeout: float | None
    ) -> dict[str, Any]:
        """The result of one call (a CallToolResult as a dict), or ToolFailed."""
        found = self.servers.get(server)
        if found is None:
            known = ", ".join(sorted(self.servers)) or "none"
            raise ToolFailed(f"no tool server {server} here (known: {known})", code="not_found")
        limit = duration(found.tool.timeout)
        result = await found.call(tool, arguments, timeout=min(timeout or limit, limit))
        if not isinstance(result, dict) or not isinstance(result.get("content", []), list):
            raise ToolFailed(
                f"tool server {server} answered tools/call with something that is not a "
                f"CallToolResult: {result!r:.80}", code="unavailable",
            )  # fmt: skip
        size = len(msgspec.json.encode(result))
        if size > MAX_RESULT:
            raise ToolFailed(f"the result of {server}.{tool} is {size} bytes, more than a reply "
                             f"carries ({MAX_RESULT})", code="too_large")  # fmt: skip
        return result

    async def restart(self, name: str) -> bool:
        async with self._one_change:
            s = self.servers.get(name)
            if s is None:
                return False
            await s.stop()
            self.servers[name] = self._start(s.launch)
            self._on_change()
            return True
