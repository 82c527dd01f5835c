"""Benchmark: one controller and thousands of machines, each behaving as a real host on the wire.

What it measures, for each `--machines` N (default 1000,3000,10000), on fresh pieces each time:
a real nats-server (JetStream), PostgreSQL, two controller processes (one holds the seat, one
stands by) and N simulated hosts in `--sim-procs` processes of their own (this script, run as
`bench/scale.py --sims FILE`). A simulated host does on the wire what services/host does:

- it watches its own key of `mesh-declarations` through a consumer of its own, made as the
  host makes it (services/host/watch.py: a named consumer per machine filtered on its key, the
  server's idle heartbeat every 2 s, delivered to a subject of its own), and for every new value
  publishes `applied` with every process running and healthy; the server's work is every
  host's, but one subscription of the process hears all its hosts' deliveries and heartbeats
  (a host's own task each would make the simulator, not the controller, what is measured);
- it registers through `mesh.ctl.host.<name>.register` at start and again when a holder with a
  newer epoch says `held`, spreading that registration as a real host does
  (services/host/registration.py), on a subscription to `held` of its own;
- it beats on `mesh.host.<name>.beat` every `--beat-interval` (1 s).

The hosts of one process share `--connections` NATS connections (a real host has one of its
own: the server's cost per connection is not what this measures; its cost per consumer is).

Reported per N: registration from cold (all registered; how many `status` shows up after 1, 5
and 10 s), the CPU (cores) and memory (RSS) of the controller, nats-server, PostgreSQL and the
simulated hosts while the fleet beats idle, the holder's event-loop lag (its metrics), `status`
p50/p99 while the fleet beats, `mesh --json nodes` for the whole fleet, a three-tier plan's
machines per second, and the takeover after `kill -9` of the holder: when verbs are answered
again, when every machine has registered with the new holder, how many are up after 1, 5 and
10 s, and how many were ever reported down. Then a flood of verbs at the holder for
`--flood` seconds, and whether it kept its seat. Everything lives in a temporary folder; every
child runs in its own session and is stopped in a `finally`. The script never fails on a
timing; the aims of issue 17 are printed beside the figures.

`--nats 3` runs the same on a TLS cluster of three nats-servers (as `mesh dev up --nats 3`
makes it: the buckets with three replicas, whose writes the servers fsync in batches, where a
lone server fsyncs every put); the simulated hosts' connections spread over the servers.

    .venv/bin/python bench/scale.py [--machines 1000,3000,10000] [--sim-procs CORES]
                                    [--connections 50] [--idle 10] [--flood 10] [--nats 1]
                                    [--sync-interval always]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import msgspec
import nats.errors
from common import (  # bench/common.py: what the benches share
    BenchError,
    Envelope,
    Guard,
    Pieces,
    cpu_of,
    machine_busy_seconds,
    machine_line,
    push,
    run_or_exit,
    say,
    spread,
    tree_cpu,
    write_module,
)
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import bus, wire
from mesh.blobs import DECLARATIONS
from mesh.embedded import ports
from mesh.embedded.children import Child
from mesh.entry import command
from mesh.model import (
    Applied,
    Beat,
    Facts,
    ProcessState,
    Register,
    SeatAnnounce,
    StatusReply,
)
from services.host import registration, watch
from services.host.verbs import HostStatus

REQUEST_TIMEOUT = 30.0
SAMPLE_EVERY = 0.25
AIMS = {
    "up_after_takeover_s": 10.0,  # every machine shown up within 10 s of a takeover
    "controller_idle_cores": 0.5,
    "status_p99_ms": 20.0,
    "plan_rate": 2000.0,  # machines per second through three tiers
}


# --- the simulated hosts (a process of their own) ---------------------------------------------


FACTS = Facts(os="linux", arch="x86_64", cpus=1, memory=1 << 30, mesh_version="bench")


@dataclass
class Sim:
    name: str
    tier: int
    nc: Client
    epoch: int = 0  # the epoch of the holder it last registered with
    started: bool = False  # booted: it beats from then on
    registered_at: float = 0.0  # wall time
    applied: str | None = None


@dataclass
class SimStats:
    registrations: int = 0
    by_epoch: dict[int, int] = field(default_factory=dict)  # epoch -> hosts registered with it
    last_at: dict[int, float] = field(default_factory=dict)  # epoch -> wall time of the last
    values: int = 0
    # Wall times of the first and the last declaration heard since asked to reset: with the
    # plan's steps (sent, judged) they say which side of the wire sets a plan's pace.
    heard_first: float = 0.0
    heard_last: float = 0.0
    applied: dict[str, int] = field(default_factory=dict)  # digest -> hosts that applied it
    heartbeats: int = 0  # the watch consumers' idle heartbeats heard
    watch_retries: int = 0  # consumer creations that failed and were tried again
    watch_error: str = ""  # why the last one failed
    # The most this process's beat loop ran behind its schedule since asked to reset (a
    # machine whose beats come more than 2 intervals late is down, whoever is to blame)
    beat_late_max: float = 0.0


class SimProcess:
    """The simulated hosts of one process."""

    def __init__(
        self, *, hosts: dict[str, int], conns: list[Client], interval: float, index: int
    ) -> None:
        self.sims = [
            Sim(name=name, tier=tier, nc=conns[i % len(conns)])
            for i, (name, tier) in enumerate(sorted(hosts.items()))
        ]
        self.by_name = {sim.name: sim for sim in self.sims}
        self.conns = conns
        self.deliver = f"bench.sims.{index}.deliver"  # + .<name>: one host's consumer
        self.creating = asyncio.Semaphore(256)  # consumer creations in flight
        self.interval = interval
        self.stats = SimStats()
        self._decode = msgspec.json.Decoder(Envelope).decode

    async def register(self, sim: Sim, *, at_least: int = 0) -> None:
        """The host's own registration (services/host/registration.py), retries and all."""
        status = HostStatus(
            name=sim.name, pid=os.getpid(), tier=sim.tier, labels={}, root="/", dev_mode=True,
            registered=False, epoch=sim.epoch, started=datetime.now(UTC), version="bench",
        )  # fmt: skip

        def current() -> Register:
            return Register(name=sim.name, tier=sim.tier, labels={}, facts=FACTS,
                            beat_interval=self.interval, pid=os.getpid(), applied=sim.applied,
                            version="bench")  # fmt: skip

        await registration.register(sim.nc, current, status, at_least=at_least)
        reply_epoch = status.epoch
        old = sim.epoch
        if old:
            self.stats.by_epoch[old] -= 1
        sim.epoch = reply_epoch
        sim.registered_at = time.time()
        self.stats.registrations += 1
        self.stats.by_epoch[reply_epoch] = self.stats.by_epoch.get(reply_epoch, 0) + 1
        self.stats.last_at[reply_epoch] = sim.registered_at

    async def held(self, sim: Sim) -> None:
        sub = await sim.nc.subscribe("mesh.seat.mesh-controller.held")
        async for msg in sub.messages:
            try:
                announce = wire.decode(msg.data, SeatAnnounce)
            except wire.BadRequest:
                continue
            if announce.epoch > sim.epoch:
                await asyncio.sleep(registration.delay(announce))
                await self.register(sim, at_least=announce.epoch)

    async def watch(self, sim: Sim) -> None:
        """The consumer a host makes on its own key (services/host/watch.py's, same config),
        delivered to a subject of its own. The server's cost is every host's; only the client
        side is lighter: a callback per delivery (`_delivered`), where a host's watch is a
        generator that waits on each message with a deadline (10,000 of those would make this
        process, not the controller, what the bench measures)."""
        deliver = f"{self.deliver}.{sim.name}"

        # A subscription of its own, as a host has (nats-server delivered nothing to a
        # wildcard subscription over several hosts' deliver subjects).
        async def delivered(msg: Msg) -> None:
            await self._delivered(sim, msg)

        await sim.nc.subscribe(deliver, cb=delivered)
        while True:
            try:
                async with self.creating:  # as hosts booting over a moment, not all at once
                    await sim.nc.jsm().add_consumer(
                        f"KV_{DECLARATIONS}", config=watch.consumer(sim.name, deliver=deliver)
                    )
                return
            except (nats.errors.Error, OSError) as e:
                self.stats.watch_retries += 1
                self.stats.watch_error = f"{type(e).__name__}: {e}"[:200]
                await asyncio.sleep(watch.RETRY)

    async def _delivered(self, sim: Sim, msg: Msg) -> None:
        if not msg.data:  # the consumer's idle heartbeat (or a delete marker)
            self.stats.heartbeats += 1
            return
        env = self._decode(msg.data)
        self.stats.values += 1
        now = time.time()
        self.stats.heard_first = self.stats.heard_first or now
        self.stats.heard_last = now
        if sim.applied is not None:
            self.stats.applied[sim.applied] -= 1
        sim.applied = env.digest
        self.stats.applied[env.digest] = self.stats.applied.get(env.digest, 0) + 1
        applied = Applied(
            name=sim.name, digest=env.digest, epoch=env.epoch, ok=True,
            processes=[ProcessState(name=p, state="running", healthy=True, pid=1)
                       for p in env.declaration.processes],
        )  # fmt: skip
        await sim.nc.publish(f"mesh.event.{sim.name}.applied", wire.encode(applied))

    async def beat(self) -> None:
        """Every host that has started beats once per interval, spread over ten slices of
        it (a host beats from its start, registered or not: services/host/main.py)."""
        slices, seq = 10, 0
        while True:
            seq += 1
            start = time.monotonic()
            for k in range(slices):
                for sim in self.sims[k::slices]:
                    if sim.started:
                        beat = Beat(name=sim.name, seq=seq, interval=self.interval)
                        await sim.nc.publish(f"mesh.host.{sim.name}.beat", wire.encode(beat))
                wake = start + (k + 1) * self.interval / slices
                late = time.monotonic() - wake
                self.stats.beat_late_max = max(self.stats.beat_late_max, late)
                await asyncio.sleep(max(0.0, -late))

    async def boot(self, sim: Sim, after: float) -> None:
        """One host starting `after` seconds into the ramp, in services/host/main.py's order:
        hear `held`, beat, register, and only then watch its declaration (a host that never
        applied makes its consumer once registered: ten thousand consumers made while the
        fleet registers would load nats-server with work no real cold start asks of it)."""
        await asyncio.sleep(after)
        sim.started = True
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.held(sim))
            await self.register(sim)
            tg.create_task(self.watch(sim))

    async def run(self, ramp: float) -> None:
        n = len(self.sims)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.beat())
            for i, sim in enumerate(self.sims):
                tg.create_task(self.boot(sim, ramp * i / max(1, n)))


async def sims_main(args: argparse.Namespace) -> None:
    """`bench/scale.py --sims FILE`: the hosts FILE lists ({"name": tier}), until SIGTERM;
    their counters answered on `bench.sims.<index>.stats`."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    hosts = json.loads(Path(args.sims).read_text())
    conns = [
        await bus.connect(args.sims_url, name=f"bench sims {args.sims_index}.{c}", reconnect=True)
        for c in range(args.connections)
    ]
    proc = SimProcess(hosts=hosts, conns=conns, interval=args.beat_interval,
                      index=args.sims_index)  # fmt: skip

    async def answer(msg: Msg) -> None:
        await msg.respond(msgspec.json.encode(proc.stats))
        if msg.data == b"reset":
            proc.stats.beat_late_max = 0.0
            proc.stats.heard_first = proc.stats.heard_last = 0.0

    await conns[0].subscribe(f"bench.sims.{args.sims_index}.stats", cb=answer)
    await conns[0].flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = asyncio.create_task(proc.run(args.ramp))
    runner.add_done_callback(lambda _: stop.set())  # a failure ends the process: the bench sees
    await stop.wait()
    if runner.done() and not runner.cancelled() and runner.exception() is not None:
        traceback.print_exception(runner.exception())
        os._exit(1)
    runner.cancel()
    # Ten thousand watches stop on their own deadlines, and a connection to a server that is
    # gone may not close promptly: give them a moment, then go.
    await asyncio.wait([runner], timeout=5)
    for nc in conns:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 1)
    os._exit(0)


# --- measuring --------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def status(nc: Client, within: float = 5.0) -> StatusReply:
    data = await bus.request(nc, "mesh.ctl.status", b"{}", deadline=time.monotonic() + within)
    return wire.decode_reply(data, StatusReply)


async def scrape(url: str, name: str, having: str = "") -> float | None:
    """One sample's value from a Prometheus text page (the controller's --metrics); with
    `having`, the sum of the samples whose labels hold it (`verb="register"`)."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return None
    writer.write(f"GET /metrics HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    text = (await reader.read()).decode(errors="replace")
    writer.close()
    found = None
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if not having:
                return float(line.rsplit(" ", 1)[1])
            if having in line.split("}", 1)[0]:
                found = (found or 0.0) + float(line.rsplit(" ", 1)[1])
    return found


@dataclass
class Probe:
    """`status` asked every SAMPLE_EVERY with a deadline of STATUS_WITHIN, one at a time, while
    something happens: how many were asked, how many not answered in time (or `busy`), and
    the slowest answer."""

    asked: int = 0
    unanswered: int = 0
    worst_s: float = 0.0

    def text(self) -> str:
        return f"{self.worst_s * 1000:.0f} ms, {self.unanswered}/{self.asked} late"


STATUS_WITHIN = 1.0  # issue 32: `status` answered within 1 s throughout


async def probe_status(nc: Client, found: Probe) -> None:
    """Fill `found` until cancelled."""
    while True:
        t0 = time.monotonic()
        found.asked += 1
        try:
            msg = await nc.request("mesh.ctl.status", b"{}", timeout=STATUS_WITHIN)
            took = time.monotonic() - t0
            if msg.data.startswith(b'{"error":'):
                found.unanswered += 1
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            took = time.monotonic() - t0
            found.unanswered += 1
        found.worst_s = max(found.worst_s, took)
        await asyncio.sleep(max(0.0, SAMPLE_EVERY - took))


@dataclass
class Figures:
    machines: int
    cold_registered_s: float = float("nan")
    cold_up: dict[int, int] = field(default_factory=dict)  # seconds after start -> up
    cold_status: Probe | None = None  # `status` asked every SAMPLE_EVERY while the fleet comes
    cold_sims_late_s: float = float("nan")  # the simulator's own beat loop, behind
    cold_asked: tuple[float | None, float | None] = (None, None)  # registrations asked, busy
    idle_cores: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    loop_lag_ms: float | None = None  # the holder's worst event-loop lag while idle
    status_ms: tuple[float, float] = (float("nan"), float("nan"))  # p50, p99
    status_errors: int = 0
    nodes_s: float = float("nan")
    nodes_note: str = ""
    plan_rate: float = float("nan")
    plan_s: float = float("nan")
    plan_note: str = ""
    takeover_answered_s: float = float("nan")
    takeover_registered_s: float = float("nan")
    takeover_up: dict[int, int] = field(default_factory=dict)
    takeover_status: Probe | None = None  # from the new holder's first answer on
    down_events: int = 0
    takeover_sims_late_s: float = float("nan")  # the simulator's own beat loop, behind
    flood_requests: int = 0
    flood_busy: int = 0
    flood_seat_kept: bool | None = None
    flood_lag_ms: float | None = None
    seat_takeovers: int = 0


class Run:
    """One N: its pieces, its simulated hosts, its figures."""

    def __init__(self, args: argparse.Namespace, pieces: Pieces, n: int) -> None:
        self.args = args
        self.pieces = pieces
        self.n = n
        self.f = Figures(machines=n)
        self.nc: Client | None = None
        self.controllers: dict[str, Child] = {}
        self.metrics: dict[str, str] = {}
        self.sims: list[Child] = []
        self.pg: Child | None = None
        self.servers: list[Child] = []

    async def start(self) -> None:
        p = self.pieces
        self.servers = await p.nats()
        self.pg = await p.postgres()
        self.nc = await p.connect("bench")
        for name in ("ctl-a", "ctl-b"):
            port = ports.free_port()
            self.metrics[name] = f"http://127.0.0.1:{port}/metrics"
            argv = command(
                "controller", "run", "--instance", name, "--metrics", f"127.0.0.1:{port}"
            )
            self.controllers[name] = await p.start(name, argv)
            await self.until(f"{name} answers", self._holds if name == "ctl-a" else self._standby)

    async def _holds(self) -> bool:
        try:
            return (await status(self.nc, 1)).seat is not None  # type: ignore[arg-type]
        except (bus.NoAnswer, wire.RemoteError):
            return False

    async def _standby(self) -> bool:
        try:
            return bool((await status(self.nc, 1)).standbys)  # type: ignore[arg-type]
        except (bus.NoAnswer, wire.RemoteError):
            return False

    async def until(self, what: str, probe, within: float = 60.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            self.pieces.guard.check()
            if await probe():
                return
            await asyncio.sleep(0.1)
        raise BenchError(f"{what}: not within {within:g} s")

    async def start_sims(self) -> None:
        tiers = spread(self.n, [1, 9, 90])
        names = sorted(tiers)
        procs = self.args.sim_procs
        for k in range(procs):
            part = {name: tiers[name] for name in names[k::procs]}
            listing = self.pieces.folder / f"sims-{k}.json"
            listing.write_text(json.dumps(part))
            argv = [sys.executable, str(Path(__file__).resolve()), "--sims", str(listing),
                    # every server, each connection to one of them (a cluster's hosts spread)
                    "--sims-url", self.pieces.nats_url, "--sims-index", str(k),
                    "--connections", str(self.args.connections),
                    "--beat-interval", str(self.args.beat_interval),
                    "--ramp", str(self.args.ramp)]  # fmt: skip
            self.sims.append(await self.pieces.start(f"sims-{k}", argv))

    async def sim_stats(self, *, reset: bool = False) -> list[SimStats]:
        """Each simulator process's counters; `reset`: its beat lateness starts again after."""
        assert self.nc is not None
        found = []
        for k in range(len(self.sims)):
            try:
                msg = await self.nc.request(f"bench.sims.{k}.stats", b"reset" if reset else b"",
                                            timeout=5)  # fmt: skip
                found.append(msgspec.json.decode(msg.data, type=SimStats))
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                found.append(SimStats())
        return found

    async def registered_with(self, epoch: int) -> int:
        return sum(s.by_epoch.get(epoch, 0) for s in await self.sim_stats())

    async def up_over(self, t0: float, marks: tuple[int, ...]) -> dict[int, int]:
        """How many machines `status` shows up at each mark (seconds after t0)."""
        found: dict[int, int] = {}
        for mark in marks:
            await asyncio.sleep(max(0.0, t0 + mark - time.monotonic()))
            try:
                found[mark] = (await status(self.nc, 2)).nodes.up  # type: ignore[arg-type]
            except (bus.NoAnswer, wire.RemoteError):
                found[mark] = -1
        return found

    def pids(self) -> dict[str, list[int]]:
        return {
            "controller": [self.controllers["ctl-a"].pid],
            "nats-server": [s.pid for s in self.servers],
            "sims": [c.pid for c in self.sims],
        }

    def cpu(self) -> dict[str, float]:
        now = {name: cpu_of(pids) for name, pids in self.pids().items()}
        assert self.pg is not None
        now["postgres"] = tree_cpu(self.pg.pid)
        now["bench"] = time.process_time()
        now["machine"] = machine_busy_seconds()
        return now

    async def epoch(self) -> int:
        s = await status(self.nc)  # type: ignore[arg-type]
        return s.seat.epoch if s.seat else 0

    async def db(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.pieces.database_url)

    # --- the phases ---

    async def cold(self) -> None:
        epoch = await self.epoch()
        assert self.nc is not None
        t0 = time.monotonic()
        await self.start_sims()
        ups = asyncio.create_task(self.up_over(t0, (1, 5, 10)))
        self.f.cold_status = Probe()
        probing = asyncio.create_task(probe_status(self.nc, self.f.cold_status))
        try:
            while await self.registered_with(epoch) < self.n:
                self.pieces.guard.check()
                for child in self.sims:
                    if not child.running:
                        raise BenchError(f"{child.name} exited; its log ends:\n{child.tail()}")
                await asyncio.sleep(0.1)
            self.f.cold_registered_s = time.monotonic() - t0
            self.f.cold_up = await ups
        finally:
            ups.cancel()
            probing.cancel()
        self.f.cold_sims_late_s = max(st.beat_late_max for st in await self.sim_stats(reset=True))
        # How many times the fleet asked to register (each host once, were it answered in time)
        ctl = self.metrics["ctl-a"]
        self.f.cold_asked = (
            await scrape(ctl, "mesh_verb_requests_total", 'verb="register"'),
            await scrape(ctl, "mesh_verb_requests_total", 'verb="register",outcome="busy"'),
        )
        say(f"  registrations asked meanwhile (busy): {_asked(self.f.cold_asked)}")
        say(f"  registered from cold in {self.f.cold_registered_s:.1f} s; up after 1/5/10 s: "
            f"{self._ups(self.f.cold_up)}; status meanwhile: worst {self.f.cold_status.text()}"
            f"; the simulated hosts' beats ran up to {self.f.cold_sims_late_s:.2f} s late"
        )  # fmt: skip
        # every machine up before the idle measurement
        await self.until("every machine up", self._all_up, within=60)

    async def _all_up(self) -> bool:
        try:
            return (await status(self.nc, 2)).nodes.up == self.n  # type: ignore[arg-type]
        except (bus.NoAnswer, wire.RemoteError):
            return False

    def _ups(self, ups: dict[int, int]) -> str:
        return " / ".join(f"{ups.get(m, -1)}" for m in (1, 5, 10)) + f" of {self.n}"

    async def idle(self) -> None:
        a = self.cpu()
        w0 = time.monotonic()
        await asyncio.sleep(self.args.idle)
        b = self.cpu()
        seconds = time.monotonic() - w0
        self.f.idle_cores = {k: (b[k] - a[k]) / seconds for k in a}
        assert self.pg is not None
        self.f.rss_mib = {
            "controller": rss_bytes(self.controllers["ctl-a"].pid) / 2**20,
            "nats-server": sum(rss_bytes(s.pid) for s in self.servers) / 2**20,
            "sims": sum(rss_bytes(c.pid) for c in self.sims) / 2**20,
        }
        self.f.loop_lag_ms = await self._lag("ctl-a")
        c = self.f.idle_cores
        say(f"  idle, cores: controller {c['controller']:.3f}, nats-server {c['nats-server']:.3f}, "
            f"postgres {c['postgres']:.3f}, simulated hosts {c['sims']:.3f}; RSS MiB: "
            + ", ".join(f"{k} {v:.0f}" for k, v in self.f.rss_mib.items()))  # fmt: skip

    async def _lag(self, ctl: str) -> float | None:
        lag = await scrape(self.metrics[ctl], "mesh_event_loop_lag_max_seconds")
        return lag * 1000 if lag is not None else None

    async def status_latency(self) -> None:
        assert self.nc is not None
        took: list[float] = []
        errors = 0
        for _ in range(self.args.status_requests):
            t0 = time.perf_counter()
            try:
                await status(self.nc, 5)
            except (bus.NoAnswer, wire.RemoteError):
                errors += 1
                continue
            took.append(time.perf_counter() - t0)
        self.f.status_ms = (percentile(took, 50) * 1000, percentile(took, 99) * 1000)
        self.f.status_errors = errors
        say(f"  status while the fleet beats: p50 {self.f.status_ms[0]:.2f} ms, "
            f"p99 {self.f.status_ms[1]:.2f} ms, {errors} errors")  # fmt: skip

    async def nodes(self) -> None:
        argv = command("--json", "nodes", "--nats-url", self.pieces.client_url, "--timeout", "60")
        if self.pieces.ca:
            argv += ["--ca", self.pieces.ca]
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        self.f.nodes_s = time.perf_counter() - t0
        if proc.returncode != 0:
            self.f.nodes_note = err.decode().strip().splitlines()[-1][:160]
        else:
            listed = len(json.loads(out)["nodes"])
            self.f.nodes_note = f"{listed} machines, {len(out) / 2**20:.1f} MiB"
        say(f"  mesh --json nodes: {self.f.nodes_s:.2f} s ({self.f.nodes_note})")

    async def plan(self) -> None:
        module = write_module(self.pieces.folder / "module", 1)
        await self.sim_stats(reset=True)
        plan_id = await push(
            module, self.pieces.client_url, self.pieces.folder / "logs", self.pieces.ca
        )
        before, t_before = self.cpu(), time.monotonic()
        conn = await self.db()
        try:
            deadline = time.monotonic() + 300
            while True:
                self.pieces.guard.check()
                row = await conn.fetchrow(
                    "SELECT state, started, finished, error FROM plans WHERE id = $1", plan_id
                )
                if row and row["state"] in ("done", "failed", "reverted"):
                    after, t_after = self.cpu(), time.monotonic()
                    break
                if time.monotonic() > deadline:
                    raise BenchError(f"plan {plan_id} did not end within 300 s")
                await asyncio.sleep(0.1)
            steps = await conn.fetchval(
                "SELECT count(*) FROM plan_steps WHERE plan_id = $1", plan_id
            )
            tiers = await conn.fetch(
                "SELECT tier, count(*) AS n, min(started) AS sent, max(finished) AS judged"
                " FROM plan_steps WHERE plan_id = $1 GROUP BY tier ORDER BY tier",
                plan_id,
            )
        finally:
            await conn.close()
        self.f.plan_s = (row["finished"] - row["started"]).total_seconds()
        self.f.plan_rate = steps / self.f.plan_s if self.f.plan_s > 0 else float("inf")
        self.f.plan_note = f"plan {plan_id} {row['state']}, {steps} machines"
        if row["state"] != "done":
            stats = await self.sim_stats()
            values = sum(st.values for st in stats)
            retries = sum(st.watch_retries for st in stats)
            why = next((st.watch_error for st in stats if st.watch_error), "")
            why += f"; {sum(st.heartbeats for st in stats)} heartbeats"
            self.f.plan_note += (f": {row['error']} (the simulated hosts heard {values} values;"
                                 f" {retries} watch creations retried: {why})")  # fmt: skip
        say(f"  three-tier plan: {self.f.plan_note} in {self.f.plan_s:.2f} s, "
            f"{self.f.plan_rate:.0f} machines/s")  # fmt: skip
        # Where the last tier's time went: the holder sending (its first step started), the
        # fleet hearing (the simulators' first and last declaration), the holder judging.
        heard = [st for st in await self.sim_stats() if st.heard_last]
        if tiers and heard:
            t0 = row["started"].timestamp()
            last = tiers[-1]
            first_heard = min(st.heard_first for st in heard) - t0
            last_heard = max(st.heard_last for st in heard) - t0
            say(f"  plan timeline, s after it started: tier {last['tier']} ({last['n']} machines)"
                f" sent from {last['sent'].timestamp() - t0:.2f}; the fleet heard declarations"
                f" from {first_heard:.2f} to {last_heard:.2f}; the tier judged done at"
                f" {last['judged'].timestamp() - t0:.2f}")  # fmt: skip
        # Whether the machine, rather than one piece, sets that pace: each piece's cores from
        # the push's answer (the plan under way) to the plan's end.
        seconds = t_after - t_before
        cores = ", ".join(f"{k} {(after[k] - before[k]) / seconds:.2f}" for k in before)
        say(f"  plan, cores over its last {seconds:.1f} s: {cores} (of {os.cpu_count()})")

    async def takeover(self) -> None:
        before = await self.epoch()
        conn = await self.db()
        try:
            downs0 = await conn.fetchval("SELECT count(*) FROM events WHERE kind = 'machine.down'")
        finally:
            await conn.close()
        holder = self.controllers["ctl-a"]
        await self.sim_stats(reset=True)
        t0 = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        ups = asyncio.create_task(self.up_over(t0, (1, 5, 10)))
        while True:
            self.pieces.guard.check()
            try:
                s = await status(self.nc, 1)  # type: ignore[arg-type]
                if s.seat is not None and s.seat.epoch > before:
                    break
            except (bus.NoAnswer, wire.RemoteError):
                pass
            if time.monotonic() - t0 > 60:
                raise BenchError("no controller took the seat within 60 s of the kill")
        self.f.takeover_answered_s = time.monotonic() - t0
        epoch = s.seat.epoch
        self.f.takeover_status = Probe()
        probing = asyncio.create_task(probe_status(self.nc, self.f.takeover_status))
        try:
            while await self.registered_with(epoch) < self.n:
                self.pieces.guard.check()
                if time.monotonic() - t0 > 120:
                    break
                await asyncio.sleep(0.1)
            else:
                self.f.takeover_registered_s = time.monotonic() - t0
        finally:
            probing.cancel()
        self.f.takeover_up = await ups
        await asyncio.sleep(max(0.0, t0 + 15 - time.monotonic()))
        conn = await self.db()
        try:
            self.f.down_events = (
                await conn.fetchval("SELECT count(*) FROM events WHERE kind = 'machine.down'")
                - downs0
            )
        finally:
            await conn.close()
        self.f.takeover_sims_late_s = max(st.beat_late_max for st in await self.sim_stats())
        say(f"  takeover after kill -9: answered in {self.f.takeover_answered_s:.2f} s, "
            f"all re-registered in {self.f.takeover_registered_s:.1f} s, up after 1/5/10 s: "
            f"{self._ups(self.f.takeover_up)}, reported down: {self.f.down_events}; the "
            f"simulated hosts' beats ran up to {self.f.takeover_sims_late_s:.2f} s late "
            "(down past 2 s)")  # fmt: skip
        # the killed controller stands by again, for the flood's holder to keep its seat from
        self.controllers["ctl-a-again"] = await self.pieces.start(
            "ctl-a-again",
            command("controller", "run", "--instance", "ctl-a2"),
        )

    async def flood(self) -> None:
        """`--flood` seconds of 128 verbs in flight (`status`, and `nodes` first pages) from
        another connection: the holder must keep its seat (no new epoch)."""
        before = await self.epoch()
        holder = "ctl-b"
        nc = await self.pieces.connect("bench flood")
        requests = busy = 0
        end = time.monotonic() + self.args.flood
        lag_before = await self._lag(holder)

        async def worker(k: int) -> None:
            nonlocal requests, busy
            subject = "mesh.ctl.nodes" if k % 4 == 0 else "mesh.ctl.status"
            body = b'{"limit": 500}' if k % 4 == 0 else b"{}"
            while time.monotonic() < end:
                try:
                    msg = await nc.request(subject, body, timeout=5)
                    requests += 1
                    busy += msg.data.startswith(b'{"error":{"code":"busy"')
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    await asyncio.sleep(0.05)

        try:
            await asyncio.gather(*(worker(k) for k in range(128)))
        finally:
            await nc.close()
        after = await self.epoch()
        self.f.flood_requests, self.f.flood_busy = requests, busy
        self.f.flood_seat_kept = after == before
        self.f.flood_lag_ms = await self._lag(holder)
        del lag_before
        say(f"  flood of verbs for {self.args.flood:g} s: {requests} answered ({busy} busy), "
            f"seat {'kept' if self.f.flood_seat_kept else 'LOST'} (epoch {before} -> {after}), "
            f"worst loop lag {self.f.flood_lag_ms} ms")  # fmt: skip
        conn = await self.db()
        try:
            self.f.seat_takeovers = await conn.fetchval(
                "SELECT count(*) FROM events WHERE kind = 'seat.taken'"
            )
        finally:
            await conn.close()

    async def stop_sims(self) -> None:
        for child in self.sims:
            await child.stop(sig=signal.SIGTERM, timeout=10)


async def one(args: argparse.Namespace, n: int) -> Figures:
    say(f"\n=== {n} machines ===")
    guard = Guard(args.deadline)
    with tempfile.TemporaryDirectory(prefix="mesh-bench-scale-") as tmp:
        pieces = Pieces(Path(tmp), guard, servers=args.nats, sync_interval=args.sync_interval)
        run = Run(args, pieces, n)
        try:
            await run.start()
            await run.cold()
            await run.idle()
            await run.status_latency()
            await run.nodes()
            await run.plan()
            await run.takeover()
            if args.flood > 0:
                await run.flood()
        finally:
            if run.nc is not None:
                await run.nc.close()
            await run.stop_sims()
            await pieces.stop()
            if args.logs is not None:  # before the temporary folder goes
                shutil.copytree(pieces.folder / "logs", args.logs / str(n), dirs_exist_ok=True)
        return run.f


def _marks(ups: dict[int, int]) -> str:
    return "/".join(str(ups.get(m, "?")) for m in (1, 5, 10))


def _asked(asked: tuple[float | None, float | None]) -> str:
    total, busy = asked
    return "?" if total is None else f"{total:.0f} ({busy or 0:.0f})"


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


def report(all_figures: list[Figures], args: argparse.Namespace) -> None:
    say("")
    servers = f"a TLS cluster of {args.nats} nats-servers" if args.nats > 1 else "one nats-server"
    servers += f", sync_interval {args.sync_interval}"
    say(f"{machine_line()}; {servers}; simulated hosts in "
        f"{args.sim_procs} process(es), {args.connections} connections each, beating every "
        f"{args.beat_interval:g} s")  # fmt: skip
    rows = [
        ("registered from cold, s", lambda f: f"{f.cold_registered_s:.1f}"),
        ("up 1/5/10 s after start", lambda f: _marks(f.cold_up)),
        ("cold: status worst, late", lambda f: f.cold_status.text() if f.cold_status else "-"),
        ("sims' beats late (cold), s", lambda f: f"{f.cold_sims_late_s:.2f}"),
        ("cold: registrations asked (busy)", lambda f: _asked(f.cold_asked)),
        ("controller idle, cores", lambda f: f"{f.idle_cores.get('controller', 0):.3f}"),
        ("nats-server idle, cores", lambda f: f"{f.idle_cores.get('nats-server', 0):.3f}"),
        ("postgres idle, cores", lambda f: f"{f.idle_cores.get('postgres', 0):.3f}"),
        ("simulated hosts, cores", lambda f: f"{f.idle_cores.get('sims', 0):.3f}"),
        ("controller RSS, MiB", lambda f: f"{f.rss_mib.get('controller', 0):.0f}"),
        ("nats-server RSS, MiB", lambda f: f"{f.rss_mib.get('nats-server', 0):.0f}"),
        ("holder loop lag max, ms", lambda f: _ms(f.loop_lag_ms)),
        ("status p50 / p99, ms", lambda f: f"{f.status_ms[0]:.2f} / {f.status_ms[1]:.2f}"),
        ("mesh --json nodes, s", lambda f: f"{f.nodes_s:.2f}"),
        ("three-tier plan, machines/s", lambda f: f"{f.plan_rate:.0f}"),
        ("takeover: answered, s", lambda f: f"{f.takeover_answered_s:.2f}"),
        ("takeover: all registered, s", lambda f: f"{f.takeover_registered_s:.1f}"),
        ("takeover: up 1/5/10 s", lambda f: _marks(f.takeover_up)),
        ("takeover: status worst, late",
         lambda f: f.takeover_status.text() if f.takeover_status else "-"),
        ("reported down (takeover)", lambda f: str(f.down_events)),
        ("sims' beats late (takeover), s", lambda f: f"{f.takeover_sims_late_s:.2f}"),
        ("flood: answered (busy)", lambda f: f"{f.flood_requests} ({f.flood_busy})"),
        ("flood: seat kept", lambda f: {None: "-", True: "yes", False: "NO"}[f.flood_seat_kept]),
        ("seat taken, times", lambda f: str(f.seat_takeovers)),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    say(f"{'':{width}} | " + " | ".join(f"{f.machines:>10}" for f in all_figures))
    say("-" * (width + 13 * len(all_figures) + 2))
    for label, cell in rows:
        say(f"{label:{width}} | " + " | ".join(f"{cell(f):>10}" for f in all_figures))
    for f in all_figures:
        if f.nodes_note:
            say(f"nodes at {f.machines}: {f.nodes_note}")
        if f.plan_note:
            say(f"plan at {f.machines}: {f.plan_note}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machines", default="1000,3000,10000", help="N, comma-separated")
    p.add_argument(
        "--sim-procs", type=int, default=os.cpu_count() or 1,
        help="processes of simulated hosts (one a core: with one, the simulator's own beats "
        "ran 5.7 s late in a cold start of 10,000 under load, 1.8 s with two)",
    )  # fmt: skip
    p.add_argument("--connections", type=int, default=50, help="NATS connections a process (50)")
    p.add_argument(
        "--nats", type=int, default=1,
        help="nats-servers: 1, or a TLS cluster of N, as mesh dev up --nats N makes (1)",
    )  # fmt: skip
    p.add_argument(
        "--sync-interval", default="always",
        help="JetStream's fsync interval: mesh runs 'always'; another (e.g. 2m, the server's "
        "default) only to measure what a lone server's fsync of every put costs the plan",
    )  # fmt: skip
    p.add_argument("--beat-interval", type=float, default=1.0, help="seconds between beats (1)")
    p.add_argument("--ramp", type=float, default=0.0, help="seconds over which hosts start (0)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds measured idle (10)")
    p.add_argument("--status-requests", type=int, default=2000, help="sequential status (2000)")
    p.add_argument("--flood", type=float, default=10.0, help="seconds of verb flood (10; 0: none)")
    p.add_argument("--deadline", type=float, default=1800, help="seconds for one N")
    p.add_argument("--logs", type=Path, default=None, help="keep every piece's log in DIR/N/")
    # the simulated hosts' own process
    p.add_argument("--sims", help=argparse.SUPPRESS)
    p.add_argument("--sims-url", help=argparse.SUPPRESS)
    p.add_argument("--sims-index", type=int, default=0, help=argparse.SUPPRESS)
    return p


async def run_all(args: argparse.Namespace) -> list[Figures]:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # cancelled, the finally stops every child
        loop.add_signal_handler(sig, main_task.cancel)
    found = []
    try:
        for n in args.machine_counts:
            found.append(await one(args, n))
    except asyncio.CancelledError:
        raise BenchError("interrupted") from None
    return found


def main() -> None:
    args = parser().parse_args()
    if args.sims:
        asyncio.run(sims_main(args))
        return
    try:
        args.machine_counts = [int(x) for x in args.machines.split(",")]
    except ValueError:
        sys.exit("--machines takes numbers, comma-separated, e.g. 1000,3000,10000")
    if any(not 1 <= n <= 100_000 for n in args.machine_counts):
        sys.exit("--machines: each between 1 and 100000")
    if args.sim_procs < 1 or args.connections < 1:
        sys.exit("--sim-procs and --connections must be at least 1")
    os.environ.pop("MESH_CREDS", None)  # the bench's nats-server has no authorization block
    random.seed()
    report(run_or_exit(run_all(args)), args)


if __name__ == "__main__":
    main()
