"""What this host tells the holder without being asked (the holder hears it in
services/controller/fleet/reports.py): a beat every interval, from the agent's start; its processes
(`mesh.event.<name>.processes`) whenever one changes; its tool servers and their tools
(`mesh.event.<name>.tools`), one report at a time; and all of it again when it may have been
lost (NATS came back under us, or our holder came back after an outage of its own).

The `applied` report of each apply is the applier's (services/host/apply.py); `again` asks it
to say its last one again too.
"""

import os

import anyio
from anyio.abc import TaskGroup
from nats.aio.client import Client

from mesh import subjects, wire
from mesh.model import Beat, ProcessesEvent, ToolsEvent
from services.host.apply import Applier
from services.host.supervisor import Supervisor
from services.host.tools import ToolRuntime

USAGE_EVERY = float(os.environ.get("MESH_USAGE_EVERY", 5.0))


async def beat(nc: Client, *, name: str, interval: float) -> None:
    """Beat every `interval` from the agent's start, registered or not: a registration the
    controller wrote but whose answer came too late for us (a storm of thousands) must not leave
    it judging us silent."""
    subject = subjects.host(name, "beat")
    seq = 0
    while True:
        await anyio.sleep(interval)  # the first after one interval: registered by then, mostly
        seq += 1
        await nc.publish(subject, wire.encode(Beat(name=name, seq=seq, interval=interval)))


class Reports:
    """This host's `processes` and `tools` reports. Built before the parts it reports on (their
    change callbacks are its `processes_changed` and `tools_changed`), and told of them with
    `tell_of` once they exist; a change before that is reported with the first reports."""

    def __init__(self, *, nc: Client, name: str, tasks: TaskGroup) -> None:
        self._nc = nc
        self._name = name
        self._tasks = tasks  # where each processes report is sent from
        self._tools_changed = anyio.Event()
        self._supervisor: Supervisor | None = None
        self._tools: ToolRuntime | None = None
        self._applier: Applier | None = None

    def tell_of(self, *, supervisor: Supervisor, tools: ToolRuntime, applier: Applier) -> None:
        self._supervisor, self._tools, self._applier = supervisor, tools, applier

    def processes_changed(self) -> None:
        """The supervisor's callback: a process changed state."""
        self._tasks.start_soon(self.processes)

    def tools_changed(self) -> None:
        """The tool runtime's callback: a tool server changed (it is a process too)."""
        self._tools_changed.set()
        self._tasks.start_soon(self.processes)

    async def processes(self) -> None:
        if self._supervisor is None:
            return
        event = ProcessesEvent(name=self._name, processes=self._supervisor.states())
        await self._nc.publish(subjects.event(self._name, "processes"), wire.encode(event))

    async def keep_telling_usage(self) -> None:
        """What each process uses changes all the time, unlike its state: the processes report
        again every USAGE_EVERY seconds while any runs (`nodes --json`: memory, cpu)."""
        while True:
            await anyio.sleep(USAGE_EVERY)
            if self._supervisor is not None and any(
                s.instance is not None for s in self._supervisor.running.values()
            ):
                await self.processes()

    async def tools(self) -> None:
        if self._tools is None:
            return
        event = ToolsEvent(name=self._name, servers=self._tools.reports())
        await self._nc.publish(subjects.event(self._name, "tools"), wire.encode(event))

    async def both(self) -> None:
        """Processes, then tools: what a holder is told after this host registered with it."""
        await self.processes()
        await self.tools()

    async def keep_sending_tools(self) -> None:
        """The tools reporter: one task, so reports go out in order; a burst of changes is one
        report."""
        while True:
            await self._tools_changed.wait()
            self._tools_changed = anyio.Event()
            await self.tools()

    async def again(self) -> None:
        """Everything again, the last `applied` first: reports published while a server died
        under us, or while our holder was away, may be lost."""
        if self._applier is not None:
            await self._applier.report_again()
        await self.both()
