"""`mesh host run`: the host agent's lifetime, as wiring of its named tasks.

In order: connect to NATS (a new version of the agent first waits for the old one to let go:
services/host/successor.py), serve the host's verbs, follow the seat (registration.py: `held`
heard from before the first registration), apply the machine's declaration (apply.py), beat
and report (reporting.py), register with the seat's holder, and run until told to stop. The
agent's tasks: the signal handler, the metrics endpoint, the supervisor, the tool runtime, the
applier's watch, the beat, the tools reporter and the seat's follower; verbs run in tasks of
their own. Stopping leaves the processes running (the next agent adopts them).
"""

import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import anyio
import msgspec
from anyio.abc import TaskGroup
from msgspec.structs import replace
from nats.aio.client import Client

from mesh import bus, loop, subjects, version
from mesh import metrics as served_metrics
from mesh.auth.signing import Signing
from mesh.discovery import Discovery
from mesh.lifetime import stop_on_signals
from mesh.model import Register
from mesh.paths import open_path_to
from mesh.serving import Server, Stats
from services.host import (
    containers,
    limits,
    metrics,
    registration,
    reporting,
    successor,
    verbs,
)
from services.host.apply import Applier
from services.host.facts import gather
from services.host.reporting import Reports
from services.host.supervisor import Supervisor
from services.host.tools import ToolRuntime
from services.host.verbs import HostStatus

log = logging.getLogger("mesh.host")


class Agent(msgspec.Struct):
    """What every part of this agent's run shares: who and where it is, and its link to NATS."""

    name: str
    nc: Client
    link: bus.Link
    state: Path  # builds, bundles, logs, state
    status: HostStatus  # what the `status` verb says, kept current by registration
    registering: Register  # the registration, less what is applied (it changes)
    signing: Signing  # the controllers' key: seat events and builds are theirs
    nats_url: str  # told to processes (MESH_NATS_URL)
    cgroups: limits.Cgroups  # where its processes' cgroups go, what it can enforce


class Parts(msgspec.Struct):
    """The parts that run the machine, once built."""

    supervisor: Supervisor
    tools: ToolRuntime
    applier: Applier
    reports: Reports
    handing: successor.Handing | None  # None: this agent cannot hand itself over


async def run(
    *,
    name: str,
    nats_url: str,
    tier: int | None = None,
    labels: dict[str, str] | None = None,
    root: Path | None = None,
    beat_interval: float = 1.0,
    creds: str | None = None,
    relaunch: list[str] | None = None,
    successor_fd: int | None = None,
    metrics_on: served_metrics.Listen | None = None,
) -> None:
    """`relaunch`: the arguments this agent was started with, given to a new version of it.
    `successor_fd`: this agent is that new version; the old one waits on this socket
    (services/host/successor.py)."""
    root = (root or Path("/")).resolve()
    state = _state_folder(root)
    status = HostStatus(
        name=name, pid=os.getpid(), tier=tier, labels=labels or {}, root=str(root),
        dev_mode=os.geteuid() != 0,  # accounts map to the current user
        registered=False, epoch=0, started=datetime.now(UTC), version=version.running(),
    )  # fmt: skip
    if loop.set_aside:
        log.info("host %s: %s", name, loop.set_aside)
    cgroups = limits.probe(machine=name, state=state)
    facts = gather(container_engine=await _container_engine(name), cgroups=cgroups)
    registering = Register(
        name=name, tier=tier, labels=labels or {}, beat_interval=beat_interval, pid=os.getpid(),
        facts=facts, version=status.version,
    )  # fmt: skip
    link = bus.Link()
    signing = Signing.host(creds)
    nc = await bus.connect(nats_url, name=f"mesh-host {name}", creds=creds, link=link)
    heir = successor.Successor(successor_fd) if successor_fd is not None else None
    if heir is not None:
        try:  # connected: say so, and wait until the old agent has let go of the machine
            await heir.ready_then_wait()
        except successor.Failed:
            await bus.close(nc)
            raise
        log.info("host %s: the old agent let go: taking the machine over", name)
    successor.pid_file(state).write_text(f"{os.getpid()}\n")
    agent = Agent(name=name, nc=nc, link=link, state=state, status=status,
                  registering=registering, signing=signing, nats_url=nats_url,
                  cgroups=cgroups)  # fmt: skip
    try:
        handed = await _serve_the_machine(
            agent, heir=heir, relaunch=relaunch, metrics_on=metrics_on, beat_interval=beat_interval
        )
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(3):
            await bus.close(nc)
        limits.release(cgroups)  # the folders its processes left (those running stay)
    if handed is not None:
        await successor.commit(handed, state)


def _state_folder(root: Path) -> Path:
    """Where the agent keeps its builds, bundles, logs and state, under the machine's `root`
    (`/`, or a dev host's own folder)."""
    if root != Path("/"):
        root.mkdir(parents=True, exist_ok=True)
    state = root if root != Path("/") else Path("/var/lib/mesh")  # builds, bundles, logs
    state.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        open_path_to(state / "x")  # processes run as their accounts must reach their folders
    return state


async def _container_engine(name: str) -> str:
    engine = await containers.probe()
    if engine:
        log.info("host %s: container engine %s", name, engine)
    else:
        log.info(
            "host %s: no container engine answers (%s): declarations with containers will "
            "fail here; everything else works", name, containers.SOCKET,
        )  # fmt: skip
    return engine


async def _serve_the_machine(
    a: Agent,
    *,
    heir: successor.Successor | None,
    relaunch: list[str] | None,
    metrics_on: served_metrics.Listen | None,
    beat_interval: float,
) -> successor.Started | None:
    """The agent's tasks, started in their order, until a signal or a handover to a new agent
    stops them; the new agent, if the apply started one (the caller lets it go on)."""
    served: Server | None = None
    found: Discovery | None = None
    handing: successor.Handing | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope)
            if metrics_on is not None:
                await tg.start(served_metrics.serve, metrics.REGISTRY, metrics_on, f"host {a.name}")
            parts = _parts(a, tasks=tg, relaunch=relaunch)
            handing = parts.handing
            served = await _serve_verbs(a, parts, tasks=tg)
            found = _discovery(a, parts.applier, served)
            await found.start()
            # Subscribed before registering, so a takeover during registration is not missed.
            held = await a.nc.subscribe(subjects.seat("held"))
            # A host that applied before (a restart, a reboot) applies its declaration at once,
            # from the bucket: after a reboot the controller may be one of its own processes,
            # which no controller would start for it.
            early = heir is None and parts.applier.digest is not None
            if early:
                tg.start_soon(parts.applier.watch)
            # Beating from the start (reporting.beat says why).
            tg.start_soon(lambda: reporting.beat(a.nc, name=a.name, interval=beat_interval))
            current = _registration(a.registering, parts.applier)
            await registration.register(a.nc, current, a.status)
            await parts.reports.both()
            tg.start_soon(parts.reports.keep_sending_tools)
            tg.start_soon(parts.reports.keep_telling_usage)
            if heir is not None:
                heir.running()  # registered, serving, adopted: the old agent may go
            else:
                successor.notify_manager()  # under systemd: started (programs/units.py)
            if not early:
                tg.start_soon(parts.applier.watch)
            # Reports published while a server died under us may be lost: say them again.
            a.link.on_up = lambda: tg.start_soon(parts.reports.again)
            await registration.follow(a.nc, held, current=current, status=a.status,
                                      signing=a.signing, reports=parts.reports)  # fmt: skip
    finally:
        with anyio.CancelScope(shield=True):
            if found is not None:
                with anyio.move_on_after(3):
                    await found.stop()
            if served is not None:
                with anyio.move_on_after(3):  # verbs in flight are answered
                    await served.stop(drain=a.nc.is_connected)
    return handing.started if handing is not None else None


def _parts(a: Agent, *, tasks: TaskGroup, relaunch: list[str] | None) -> Parts:
    """The supervisor and the tool runtime (their tasks started in `tasks`), the applier, and
    the reports of what they do."""
    reports = Reports(nc=a.nc, name=a.name, tasks=tasks)
    supervisor = Supervisor(nc=a.nc, root=a.state, changed=reports.processes_changed)
    tasks.start_soon(supervisor.run)
    tools = ToolRuntime(nc=a.nc, root=a.state, changed=reports.tools_changed)
    supervisor.tool_servers = tools.states
    tasks.start_soon(tools.run)
    handing = successor.Handing(relaunch, tasks.cancel_scope) if relaunch is not None else None
    applier = Applier(
        name=a.name, nc=a.nc, root=a.state, supervisor=supervisor, tools=tools,
        nats_url=a.nats_url, hand_over=handing, cgroups=a.cgroups,
    )  # fmt: skip
    reports.tell_of(supervisor=supervisor, tools=tools, applier=applier)
    metrics.PROCESSES.states = supervisor.states
    metrics.PROCESSES.cpu_seconds = supervisor.cpu_seconds
    if applier.digest:  # what the last agent applied, adopted
        metrics.applied(applier.digest, applier.epoch)
    return Parts(supervisor=supervisor, tools=tools, applier=applier, reports=reports,
                 handing=handing)  # fmt: skip


async def _serve_verbs(a: Agent, parts: Parts, *, tasks: TaskGroup) -> Server:
    """The host's verbs, their tasks in `tasks`."""
    status = a.status

    def current_status() -> HostStatus:
        status.applied, status.applied_epoch = parts.applier.digest, parts.applier.epoch
        status.processes = parts.supervisor.states()
        return status

    host = verbs.Host(name=a.name, root=a.state, nc=a.nc, supervisor=parts.supervisor,
                      tools=parts.tools, status=current_status, signing=a.signing)  # fmt: skip
    return await verbs.serve(host, tasks=tasks, stats=Stats(observe=metrics.VERB_ANSWERED))


def _discovery(a: Agent, applier: Applier, served: Server) -> Discovery:
    """The host's answers to service discovery (`$SRV`), counting what `served` answers."""
    status = a.status
    return Discovery(
        a.nc, name=subjects.HOST_SERVICE, id=a.name, stats=served.stats,
        description=f"mesh's host agent on {a.name}",
        endpoints=lambda: served.endpoints,
        metadata=lambda: {"machine": a.name, "epoch": str(status.epoch),
                          "applied": applier.digest or "", "mesh": status.version},
    )  # fmt: skip


def _registration(base: Register, applier: Applier) -> Callable[[], Register]:
    """What a registration says when it is sent: each attempt says what is applied now."""
    return lambda: replace(base, applied=applier.digest)
