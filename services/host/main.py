"""`mesh host run`: register with the seat's holder, then beat until told to stop.

The host registers at start and again whenever a new controller announces that it holds the
seat (so a takeover never loses a machine), and publishes a heartbeat every interval on
`mesh.host.<name>.beat`. It answers its own `mesh.host.<name>.status`.
"""

import logging
import os
from datetime import UTC, datetime
from pathlib import Path

import anyio
from msgspec.structs import replace
from nats.aio.client import Client

from mesh import bus, origin, subjects, version, wire
from mesh import metrics as served_metrics
from mesh.auth.signing import Signing
from mesh.discovery import Discovery
from mesh.lifetime import stop_on_signals
from mesh.model import (
    Beat,
    ProcessesEvent,
    Register,
    SeatAnnounce,
    ToolsEvent,
)
from mesh.paths import open_path_to
from mesh.serving import Server, Stats
from services.host import containers, metrics, registration, successor, verbs
from services.host.apply import Applier
from services.host.facts import gather
from services.host.supervisor import Supervisor
from services.host.tools import ToolRuntime
from services.host.verbs import HostStatus

log = logging.getLogger("mesh.host")


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
    if root != Path("/"):
        root.mkdir(parents=True, exist_ok=True)
    state = root if root != Path("/") else Path("/var/lib/mesh")  # builds, bundles, logs
    state.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        open_path_to(state / "x")  # processes run as their accounts must reach their folders
    status = HostStatus(
        name=name,
        pid=os.getpid(),
        tier=tier,
        labels=labels or {},
        root=str(root),
        dev_mode=os.geteuid() != 0,  # accounts map to the current user
        registered=False,
        epoch=0,
        started=datetime.now(UTC),
        version=version.running(),
    )
    engine = await containers.probe()
    if engine:
        log.info("host %s: container engine %s", name, engine)
    else:
        log.info(
            "host %s: no container engine answers (%s): declarations with containers will "
            "fail here; everything else works", name, containers.SOCKET,
        )  # fmt: skip
    registering = Register(
        name=name,
        tier=tier,
        labels=labels or {},
        facts=gather(container_engine=engine),
        beat_interval=beat_interval,
        pid=os.getpid(),
        version=status.version,
    )
    link = bus.Link()
    signing = Signing.host(creds)  # the controllers' key: seat events and builds are theirs
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
    served: Server | None = None
    found: Discovery | None = None
    handing: list[successor.Started] = []  # the new agent, once it said it is ready
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signals, tg.cancel_scope)
            if metrics_on is not None:
                await tg.start(served_metrics.serve, metrics.REGISTRY, metrics_on, f"host {name}")

            async def report_processes() -> None:
                event = ProcessesEvent(name=name, processes=supervisor.states())
                await nc.publish(subjects.event(name, "processes"), wire.encode(event))

            supervisor = Supervisor(
                nc=nc, root=state, changed=lambda: tg.start_soon(report_processes)
            )
            tg.start_soon(supervisor.run)
            tools_changed = anyio.Event()

            def tools_change() -> None:
                nonlocal tools_changed
                tools_changed.set()
                tg.start_soon(report_processes)

            async def report_tools() -> None:
                event = ToolsEvent(name=name, servers=tools.reports())
                await nc.publish(subjects.event(name, "tools"), wire.encode(event))

            async def keep_reporting_tools() -> None:
                # One task, so reports go out in order; a burst of changes is one report.
                nonlocal tools_changed
                while True:
                    await tools_changed.wait()
                    tools_changed = anyio.Event()
                    await report_tools()

            tools = ToolRuntime(nc=nc, root=state, changed=tools_change)
            supervisor.tool_servers = tools.states
            tg.start_soon(tools.run)

            async def hand_over(key: str, bundle: Path) -> None:
                """Start the new agent; once it is ready, stop everything here (below, after
                the task group) and let it go on. Raises successor.Failed, changing nothing."""
                handing.append(await successor.start(key, bundle, relaunch or []))
                tg.cancel_scope.cancel()
                await anyio.sleep_forever()  # cancelled: the apply ends here, nothing saved

            applier = Applier(
                name=name, nc=nc, root=state, supervisor=supervisor, tools=tools, nats_url=nats_url,
                hand_over=hand_over if relaunch is not None else None,
            )  # fmt: skip
            metrics.PROCESSES.states = supervisor.states
            if applier.digest:  # what the last agent applied, adopted
                metrics.applied(applier.digest, applier.epoch)

            def current_status() -> HostStatus:
                status.applied, status.applied_epoch = applier.digest, applier.epoch
                status.processes = supervisor.states()
                return status

            stats = Stats(observe=metrics.VERB_ANSWERED)
            served = await verbs.serve(
                verbs.Host(
                    name=name,
                    root=state,
                    nc=nc,
                    supervisor=supervisor,
                    tools=tools,
                    status=current_status,
                    signing=signing,
                ),
                tasks=tg,
                stats=stats,
            )
            found = Discovery(
                nc, name=subjects.HOST_SERVICE, id=name, stats=stats,
                description=f"mesh's host agent on {name}",
                endpoints=lambda: served.endpoints if served else (),
                metadata=lambda: {"machine": name, "epoch": str(status.epoch),
                                  "applied": applier.digest or "", "mesh": status.version},
            )  # fmt: skip
            await found.start()
            # Subscribed before registering, so a takeover during registration is not missed.
            held = await nc.subscribe(subjects.seat("held"))
            # A host that applied before (a restart, a reboot) applies its declaration at once,
            # from the bucket: after a reboot the controller may be one of its own processes,
            # which no controller would start for it.
            early = heir is None and applier.digest is not None
            if early:
                tg.start_soon(applier.watch)
            # Beating from the start: a registration the controller wrote but whose answer
            # came too late for us (a storm of thousands) must not leave it judging us silent.
            tg.start_soon(_beat, nc, name, beat_interval)
            await registration.register(nc, lambda: replace(registering, applied=applier.digest),
                                        status)  # fmt: skip
            await report_processes()
            await report_tools()
            tg.start_soon(keep_reporting_tools)
            if heir is not None:
                heir.running()  # registered, serving, adopted: the old agent may go
            else:
                successor.notify_manager()  # under systemd: started (programs/units.py)
            if not early:
                tg.start_soon(applier.watch)

            async def report_again() -> None:
                await applier.report_again()
                await report_processes()
                await report_tools()

            # Reports published while a server died under us may be lost: say them again.
            link.on_up = lambda: tg.start_soon(report_again)
            async for msg in origin.arrivals(held):
                if not signing.genuine(msg):  # a forged `held` would set every host registering
                    origin.STRAYS.refused(held.subject, msg, "not signed by the controllers")
                    continue
                try:
                    announce = wire.decode(msg.data, SeatAnnounce)
                except wire.BadRequest:
                    continue
                if announce.epoch > status.epoch:  # a holder we have not registered with
                    await anyio.sleep(registration.delay(announce))  # spread the storm
                    await registration.register(
                        nc, lambda: replace(registering, applied=applier.digest), status,
                        at_least=announce.epoch,
                    )  # fmt: skip
                    await report_processes()
                    await report_tools()
                elif announce.epoch == status.epoch:
                    # Our holder, back on NATS after an outage of its own: what we reported
                    # meanwhile may not have reached it.
                    await report_again()
    finally:
        with anyio.CancelScope(shield=True):
            if found is not None:
                with anyio.move_on_after(3):
                    await found.stop()
            if served is not None:
                with anyio.move_on_after(3):  # verbs in flight are answered
                    await served.stop(drain=nc.is_connected)
            with anyio.move_on_after(3):
                await bus.close(nc)
    if handing:
        await successor.commit(handing[0], state)


async def _beat(nc: Client, name: str, interval: float) -> None:
    subject = subjects.host(name, "beat")
    seq = 0
    while True:
        await anyio.sleep(interval)  # the first after one interval: registered by then, mostly
        seq += 1
        await nc.publish(subject, wire.encode(Beat(name=name, seq=seq, interval=interval)))
