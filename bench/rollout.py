"""Benchmark: plans rolled out by a real controller to a thousand simulated machines.

What it measures: how fast one controller takes a change through its three tiers. The pieces
are real: nats-server (JetStream), PostgreSQL and one controller process
(`python -m programs.cli controller run`) holding the seat. The machines are not: `--machines`
(default
1000) simulated hosts `sim-0001`, … live in this process, on one NATS connection, split over
tiers 0/1/2 by `--split` (default 1,9,90 percent). Each one does what a real host
(services/host) does on the wire and nothing else:

- registers through `mesh.ctl.host.<name>.register` (mesh.model.Register, beat interval
  `--beat-interval`, default 1 s) and beats on `mesh.host.<name>.beat` at that interval
  (the beats of all machines spread evenly over each interval);
- watches its key in the KV bucket `mesh-declarations` (one consumer over all the keys,
  demultiplexed by key, instead of a consumer per machine) and "applies instantly": for every
  new value it publishes mesh.model.Applied(ok=True) with the value's digest and epoch and
  every declared process running and healthy on `mesh.event.<name>.applied`.

The change: a tiny module (a `files` bundle, one process without a check, `[assign] tiers =
[0, 1, 2]`) pushed with the real command line (`mesh push DIR --json`), then `--plans` - 1 more
versions of it (default: v1, v2, v3), so every plan changes every machine. Each plan is followed
through the `status` verb (cheap: the planner's summary in memory) and, once it is over, read
whole with the `plan` verb. For each plan the script prints, from the plan's own timestamps
(the controller's clock): recorded -> started, started -> finished and machines per second,
each tier's span (its first step started -> its last step finished) and rate, and that span in
three parts, split where the tier's declarations reached the simulated hosts: "store" (the
tier started -> the first declaration arrived: the planner writes the steps and declarations to
PostgreSQL), "publish" (first -> last arrived: it puts them in the KV bucket) and "judge" (the
last arrived -> the last step finished: applied reports judged, steps written done). From
`/proc` it prints the CPU that the controller, nats-server, PostgreSQL (the postmaster and its
backends) and this process spent between the plan's start and finish, how many cores anything
else kept busy meanwhile ("others": other work on the machine, and the `mesh push` command
exiting), and what the controller spends idle with the fleet beating (measured for `--idle`
seconds before the first push). The aim (issue 5): >= 1,000 machines per second through the
controller. The script never fails on a timing.

    .venv/bin/python bench/rollout.py [--machines 1000] [--split 1,9,90] [--plans 3]
                                      [--beat-interval 1] [--idle 3] [--profile]
                                      [--deadline 600] [--nats 1] [--tls]

`--nats N` (N > 1) runs the nats-servers as one cluster, always TLS (`--tls`: one server with
TLS), as bench/verbs.py does: the controller connects to server n1, the simulated hosts to n2.
The controller makes its buckets with min(3, N) replicas (mesh.blobs.ensure); the script prints
the replicas, leader and peers of both streams.

`--profile` runs the controller under cProfile (`python -m cProfile -o FILE -m
programs.cli controller run`; it writes the profile when it stops, kept as
$TMPDIR/mesh-bench-controller.prof) and
prints its top functions at the end: the figures of a profiled run are slower, read them for
where the time goes, not for the rate.

Everything lives in a temporary folder; every child runs in its own session and is stopped in
a `finally`, so nothing is left running when the script ends or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import pstats
import signal
import statistics
import sys
import tempfile
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
import nats.errors
from common import (  # bench/common.py: what the benches share
    MODULE,
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
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from mesh import bus, wire
from mesh.blobs import BUNDLES, DECLARATIONS
from mesh.client.pages import every_page
from mesh.embedded.children import Child
from mesh.entry import ENTRY
from mesh.model import (
    Applied,
    Beat,
    Facts,
    PlanReply,
    PlanRequest,
    ProcessState,
    Register,
    RegisterReply,
    StatusReply,
)

AIM = 1000.0  # machines per second through the controller (issue 5)
FINAL = ("done", "failed", "reverted")
POLL_EVERY = 0.1  # following a plan through `status`
SAMPLE_EVERY = 0.05  # CPU samples from /proc
REQUEST_TIMEOUT = 30.0
DISTURBED = 0.15  # cores busy outside the measured processes beyond which a run is suspect
T = TypeVar("T")


# --- the simulated hosts ---------------------------------------------------------------------


class Sims:
    """`machines` simulated hosts on one NATS connection."""

    def __init__(self, nc: Client, tiers: dict[str, int], interval: float) -> None:
        self.nc = nc
        self.tiers = tiers  # name -> tier
        self.interval = interval
        self.registered: set[str] = set()  # the ones that beat
        self.received: dict[str, float] = {}  # name -> wall time its newest value arrived
        self.applied: dict[str, str] = {}  # name -> digest it reported applied
        self.values = 0
        self._decode = msgspec.json.Decoder(Envelope).decode

    async def register(self, guard: Guard, in_flight: int = 32) -> None:
        facts = Facts(os="linux", arch="x86_64", cpus=1, memory=1 << 30, mesh_version="bench")
        todo = iter(sorted(self.tiers.items()))

        async def worker() -> None:
            for name, tier in todo:
                guard.check()
                body = wire.encode(
                    Register(name=name, tier=tier, labels={}, facts=facts,
                             beat_interval=self.interval, pid=os.getpid())
                )  # fmt: skip
                data = await bus.request(
                    self.nc, f"mesh.ctl.host.{name}.register", body,
                    deadline=time.monotonic() + REQUEST_TIMEOUT,
                )  # fmt: skip
                reply = wire.decode_reply(data, RegisterReply)
                if reply.tier != tier:
                    raise BenchError(f"{name} registered in tier {reply.tier}, not {tier}")
                self.registered.add(name)

        async with asyncio.TaskGroup() as tg:
            for _ in range(min(in_flight, len(self.tiers))):
                tg.create_task(worker())

    async def beat(self) -> None:
        """Every registered machine beats once per interval; the beats are spread over ten
        slices of it. Started before the registrations, so that the first machines registered
        do not miss beats while the rest register (which takes more than three intervals on a
        busy machine, and the controller then takes them for down)."""
        names = sorted(self.tiers)
        slices = 10
        seq = 0
        while True:
            seq += 1
            start = time.monotonic()
            for k in range(slices):
                for name in names[k::slices]:
                    if name not in self.registered:
                        continue
                    beat = Beat(name=name, seq=seq, interval=self.interval)
                    await self.nc.publish(f"mesh.host.{name}.beat", wire.encode(beat))
                wake = start + (k + 1) * self.interval / slices
                await asyncio.sleep(max(0.0, wake - time.monotonic()))

    async def watch(self) -> None:
        """One push consumer over every key of `mesh-declarations`: the newest value of each
        key, then every new one, delivered to `_value`."""
        inbox = self.nc.new_inbox()
        await self.nc.subscribe(inbox, cb=self._value, pending_msgs_limit=1_000_000)
        await self.nc.jsm().add_consumer(
            f"KV_{DECLARATIONS}",
            config=ConsumerConfig(
                name="bench-sims",
                filter_subject=f"$KV.{DECLARATIONS}.>",
                deliver_subject=inbox,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=60.0,
                mem_storage=True,
                num_replicas=1,
            ),
        )

    async def _value(self, msg: Msg) -> None:
        if not msg.data:  # a delete or purge marker
            return
        env = self._decode(msg.data)
        if env.machine not in self.tiers:
            return
        if self.applied.get(env.machine) != env.digest:  # not a value put again
            self.received[env.machine] = time.time()
        self.values += 1
        applied = Applied(
            name=env.machine, digest=env.digest, epoch=env.epoch, ok=True,
            processes=[ProcessState(name=p, state="running", healthy=True, pid=1)
                       for p in env.declaration.processes],
        )  # fmt: skip
        await self.nc.publish(f"mesh.event.{env.machine}.applied", wire.encode(applied))
        self.applied[env.machine] = env.digest


# --- measuring -------------------------------------------------------------------------------


class Sampler:
    """CPU seconds of the measured processes, sampled against wall time, so the CPU of any
    interval (a plan's start to its finish, by the controller's clock) can be read off."""

    def __init__(self, pids: dict[str, list[int]], trees: dict[str, int]) -> None:
        self.pids = pids  # name -> pids (those processes alone, summed)
        self.trees = trees  # name -> pid (it and its children)
        self.times: list[float] = []
        self.samples: list[dict[str, float]] = []

    def sample(self) -> None:
        now = {name: cpu_of(pids) for name, pids in self.pids.items()}
        now.update({name: tree_cpu(pid) for name, pid in self.trees.items()})
        now["sims"] = time.process_time()
        now["machine"] = machine_busy_seconds()
        self.times.append(time.time())
        self.samples.append(now)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY)

    def at(self, t: float) -> dict[str, float]:
        """The counters at wall time `t`, interpolated between the samples around it."""
        i = bisect_left(self.times, t)
        if i == 0:
            return self.samples[0]
        if i == len(self.times):
            return self.samples[-1]
        t0, t1 = self.times[i - 1], self.times[i]
        a, b = self.samples[i - 1], self.samples[i]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return {k: a[k] + (b[k] - a[k]) * w for k in a}

    def between(self, start: float, end: float) -> dict[str, float]:
        a, b = self.at(start), self.at(end)
        return {k: b[k] - a[k] for k in a}


@dataclass
class TierFigures:
    tier: int
    machines: int
    seconds: float  # first step started -> last step finished
    # The tier's span in three parts, by when its declarations reached the simulated hosts:
    # started -> the first arrived (the planner stores the tier's steps and declarations),
    # first -> last arrived (it puts them in the KV), last arrived -> last step finished
    # (applied reports judged and the steps written done).
    store: float
    publish: float
    judge: float
    gap: float  # the tier before's last step finished -> this tier's first step started

    @property
    def rate(self) -> float:
        return self.machines / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class PlanFigures:
    version: int
    plan: PlanReply
    queued: float  # recorded -> started
    seconds: float  # started -> finished
    pushed: float  # the push command started -> finished
    tiers: list[TierFigures]
    cpu: dict[str, float]  # process -> CPU seconds between started and finished
    controller_push: float  # controller CPU seconds from the push command on to finished
    states: dict[str, int] = field(default_factory=dict)

    @property
    def machines(self) -> int:
        return len(self.plan.steps)

    @property
    def rate(self) -> float:
        return self.machines / self.seconds if self.seconds > 0 else float("inf")


# --- the module and the plans ----------------------------------------------------------------


async def ask(
    nc: Client, verb: str, body: msgspec.Struct | None, into: type[T], *, within: float = 30.0
) -> T:
    data = await bus.request(
        nc, f"mesh.ctl.{verb}", wire.encode(body) if body is not None else b"{}",
        deadline=time.monotonic() + within,
    )  # fmt: skip
    return wire.decode_reply(data, into)


async def follow(nc: Client, plan_id: int, guard: Guard) -> PlanReply:
    """Until the plan is over: `status` while it is in progress, the `plan` verb otherwise."""
    while True:
        guard.check()
        status = await ask(nc, "status", None, StatusReply)
        if status.plan is None or status.plan.id != plan_id:  # not started yet, or over
            plan = await every_page(lambda body: ask(nc, "plan", body, PlanReply),
                                    PlanRequest(id=plan_id))  # fmt: skip
            if plan.state in FINAL:
                return plan
        await asyncio.sleep(POLL_EVERY)


def figures(
    version: int, plan: PlanReply, sims: Sims, sampler: Sampler, pushed: tuple[float, float]
) -> PlanFigures:
    if plan.started is None or plan.finished is None:
        raise BenchError(f"plan {plan.id} is {plan.state} without start or finish times")
    started, finished = plan.started.timestamp(), plan.finished.timestamp()
    tiers = []
    before = started
    for t in sorted({s.tier for s in plan.steps}):
        steps = [s for s in plan.steps if s.tier == t]
        first = min(s.started.timestamp() for s in steps if s.started)
        last = max(s.finished.timestamp() for s in steps if s.finished)
        arrived = [sims.received.get(s.machine, float("nan")) for s in steps]
        tiers.append(
            TierFigures(
                tier=t, machines=len(steps), seconds=last - first, store=min(arrived) - first,
                publish=max(arrived) - min(arrived), judge=last - max(arrived),
                gap=first - before,
            )
        )  # fmt: skip
        before = last
    states: dict[str, int] = {}
    for s in plan.steps:
        states[s.state] = states.get(s.state, 0) + 1
    return PlanFigures(
        version=version, plan=plan, queued=started - plan.created.timestamp(),
        seconds=finished - started, pushed=pushed[1] - pushed[0], tiers=tiers,
        cpu=sampler.between(started, finished),
        controller_push=sampler.between(pushed[0], finished)["controller"], states=states,
    )  # fmt: skip


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Results:
    machines: int
    tiers: dict[int, int]
    streams: list[str]  # each bucket's stream: replicas, leader, peers
    idle: dict[str, float]  # cores, with the fleet beating and no plan
    plans: list[PlanFigures]
    profile: Path | None


async def start_controller(pieces: Pieces, nc: Client, profile: Path | None) -> Child:
    """The controller as in bench/verbs.py, optionally under cProfile."""
    if profile is None:
        return await pieces.controller(nc)
    argv = [sys.executable, "-P", "-m", "cProfile", "-o", str(profile), "-m", ENTRY,
            "controller", "run", "--instance", "bench-ctl"]  # fmt: skip
    child = await pieces.start("controller", argv)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pieces.guard.check()
        if not child.running:
            raise BenchError(f"the controller exited while starting; see {child.log}")
        try:
            status = await ask(nc, "status", None, StatusReply, within=1.0)
            if status.seat is not None:
                return child
        except (bus.NoAnswer, wire.RemoteError):
            pass
        await asyncio.sleep(0.1)
    raise BenchError(f"the controller did not take the seat within 60s; see {child.log}")


async def streams(nc: Client) -> list[str]:
    """The controller's two buckets as JetStream holds them: replicas, leader and peers."""
    lines = []
    for stream in (f"KV_{DECLARATIONS}", f"OBJ_{BUNDLES}"):
        info = await nc.jsm().stream_info(stream)
        where = "a lone server"
        if info.cluster is not None and info.cluster.name:
            peers = [
                f"{p.name}{'' if p.current else ' (not current)'}"
                for p in info.cluster.replicas or []
            ]
            where = f"leader {info.cluster.leader}, peers {', '.join(peers) or 'none'}"
        storage = getattr(info.config.storage, "value", info.config.storage) or "?"
        lines.append(
            f"{stream}: {info.config.num_replicas or 1} replica(s), {storage} storage, {where}"
        )
    return lines


async def bench(args: argparse.Namespace, pieces: Pieces) -> Results:
    tiers = spread(args.machines, args.split)
    counts = {t: sum(1 for v in tiers.values() if v == t) for t in range(3)}
    servers, pg = await pieces.servers_and_store()
    nc = await pieces.connect("bench sims")
    say(f"  the controller on {pieces.server_url}, the simulated hosts on {pieces.client_url}")
    tasks: list[asyncio.Task[None]] = []
    profile = pieces.folder / "controller.prof" if args.profile else None
    try:
        say("starting the controller" + (" under cProfile…" if profile else "…"))
        ctl = await start_controller(pieces, nc, profile)
        say(f"  controller pid {ctl.pid} holds the seat")
        buckets = await streams(nc)
        for line in buckets:
            say(f"  {line}")
        sims = Sims(nc, tiers, args.beat_interval)
        await sims.watch()
        say(
            f"registering {args.machines} simulated machines "
            f"(tier 0: {counts[0]}, tier 1: {counts[1]}, tier 2: {counts[2]})…"
        )
        t0 = time.perf_counter()
        tasks.append(asyncio.create_task(sims.beat()))
        await sims.register(pieces.guard)
        say(f"  registered in {time.perf_counter() - t0:.2f} s")
        sampler = Sampler(
            {"controller": [ctl.pid], "nats-server": [s.pid for s in servers]},
            {"postgres": pg.pid},
        )
        tasks.append(asyncio.create_task(sampler.run()))
        status = await ask(nc, "status", None, StatusReply)
        say(f"  status: {status.nodes.total} machines, {status.nodes.up} up")

        say(f"measuring the controller idle, the fleet beating, for {args.idle:g} s…")
        w0 = time.time()
        await asyncio.sleep(args.idle)
        w1 = time.time()
        idle = {k: v / (w1 - w0) for k, v in sampler.between(w0, w1).items()}

        module = pieces.folder / "module"
        results: list[PlanFigures] = []
        for version in range(1, args.plans + 1):
            write_module(module, version)
            say(f"pushing {MODULE} version {version}…")
            p0 = time.time()
            plan_id = await push(module, pieces.nats_url, pieces.folder / "logs", pieces.ca)
            say(f"  plan {plan_id}; following it…")
            plan = await follow(nc, plan_id, pieces.guard)
            p1 = time.time()
            await asyncio.sleep(2 * SAMPLE_EVERY)  # a sample after the finish, to read up to it
            f = figures(version, plan, sims, sampler, (p0, p1))
            say(f"  plan {plan_id} {plan.state}: {f.machines} machines in {f.seconds:.2f} s, "
                f"{f.rate:.0f} machines/s")  # fmt: skip
            if plan.state != "done":
                raise BenchError(f"plan {plan_id} ended {plan.state}: {plan.failure}")
            results.append(f)
            await asyncio.sleep(args.pause)
        return Results(args.machines, counts, buckets, idle, results, profile)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()


def report(r: Results, args: argparse.Namespace) -> None:
    say("")
    kind = f"a cluster of {args.nats}, TLS" if args.nats > 1 else "one"
    say(f"nats-servers: {kind}{', TLS' if args.nats == 1 and args.tls else ''}; buckets:")
    for line in r.streams:
        say(f"  {line}")
    say(
        f"machines: {r.machines} simulated (tier 0: {r.tiers[0]}, tier 1: {r.tiers[1]}, "
        f"tier 2: {r.tiers[2]}), beating every {args.beat_interval:g} s; {machine_line()}"
        + ("; the controller ran under cProfile" if r.profile else "")
    )
    say(
        "idle (no plan, the fleet beating), cores: "
        + ", ".join(f"{k} {r.idle[k]:.3f}" for k in ("controller", "nats-server", "postgres"))
    )
    for f in r.plans:
        p = f.plan
        say("")
        say(
            f"plan {p.id} (push v{f.version}): {p.state}, {f.machines} machines "
            f"({', '.join(f'{n} {s}' for s, n in sorted(f.states.items()))}); "
            f"recorded -> started {f.queued:.2f} s; started -> finished {f.seconds:.2f} s: "
            f"{f.rate:.0f} machines/s; the push command to the end {f.pushed:.2f} s"
        )
        for t in f.tiers:
            say(
                f"  tier {t.tier}: {t.machines:>5} machines in {t.seconds:5.2f} s "
                f"({t.rate:>5.0f} machines/s) = store {t.store:.2f} + publish {t.publish:.2f} "
                f"+ judge {t.judge:.2f} s; {t.gap:.2f} s after the tier before"
            )
        cores = {k: v / f.seconds for k, v in f.cpu.items()}
        ours = sum(cores[k] for k in ("controller", "nats-server", "postgres", "sims"))
        others = max(0.0, cores["machine"] - ours)
        say(
            f"  CPU from start to finish: controller {f.cpu['controller']:.2f} s "
            f"({cores['controller']:.2f} cores, {f.cpu['controller'] / f.machines * 1e3:.2f} ms "
            f"a machine); nats-server {cores['nats-server']:.2f}, "
            f"postgres {cores['postgres']:.2f}, simulated hosts {cores['sims']:.2f}, "
            f"others {others:.2f} cores"
        )
        say(f"  controller CPU from the push command on: {f.controller_push:.2f} s")
        if others > DISTURBED:
            say(f"  warning: other work kept {others:.2f} cores busy: the figures are disturbed")
    say("")
    header = f"{'plan':>4} {'machines':>8} {'seconds':>8} {'machines/s':>10} | " + " | ".join(
        f"tier {t} s, /s" for t in sorted(r.tiers)
    ) + " | controller CPU s"  # fmt: skip
    say(header)
    say("-" * len(header))
    for f in r.plans:
        tier_cells = " | ".join(f"{t.seconds:6.2f} {t.rate:>6.0f}" for t in f.tiers)
        say(
            f"{f.plan.id:>4} {f.machines:>8} {f.seconds:>8.2f} {f.rate:>10.0f} | {tier_cells} | "
            f"{f.cpu['controller']:>16.2f}"
        )
    if r.plans:
        rates = [f.rate for f in r.plans]
        verdict = "met" if statistics.median(rates) >= AIM else "NOT met"  # by the median
        say(
            f"aim: >= {AIM:.0f} machines per second through the controller: {verdict} "
            f"(median {statistics.median(rates):.0f}, {min(rates):.0f}-{max(rates):.0f} "
            "machines/s)"
        )
    if r.profile is not None:
        if r.profile.exists():
            out = io.StringIO()
            stats = pstats.Stats(str(r.profile), stream=out)
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)
            say(out.getvalue())
        else:
            say("the controller wrote no profile (did it stop cleanly?)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machines", type=int, default=1000, help="simulated machines (1000)")
    p.add_argument(
        "--split", default="1,9,90", help="percent of the machines in tiers 0,1,2 (1,9,90)"
    )
    p.add_argument("--plans", type=int, default=3, help="versions pushed, one plan each (3)")
    p.add_argument("--beat-interval", type=float, default=1.0, help="seconds between beats (1)")
    p.add_argument("--idle", type=float, default=3.0, help="seconds measured idle first (3)")
    p.add_argument("--pause", type=float, default=1.0, help="seconds between plans (1)")
    p.add_argument("--profile", action="store_true", help="run the controller under cProfile")
    p.add_argument("--top", type=int, default=25, help="functions shown with --profile (25)")
    p.add_argument("--deadline", type=float, default=600, help="seconds for the whole run")
    p.add_argument(
        "--nats", type=int, default=1, metavar="N", help="nats-servers; above 1 a TLS cluster (1)"
    )
    p.add_argument("--tls", action="store_true", help="TLS on a lone nats-server too")
    return p


async def run(args: argparse.Namespace) -> Results:
    guard = Guard(args.deadline)
    main_task = asyncio.current_task()
    assert main_task is not None

    def interrupt() -> None:
        if not guard.interrupted:
            main_task.cancel()
        guard.interrupted = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    with tempfile.TemporaryDirectory(prefix="mesh-bench-") as tmp:
        pieces = Pieces(Path(tmp), guard, servers=args.nats, tls=args.tls)
        try:
            async with asyncio.timeout(args.deadline):
                results = await bench(args, pieces)
        except (nats.errors.Error, wire.RemoteError, bus.NoAnswer) as e:
            raise BenchError(f"a request failed: {type(e).__name__}: {e}") from None
        except TimeoutError:
            raise BenchError(f"the run took longer than --deadline {args.deadline:g}s") from None
        except asyncio.CancelledError:
            if guard.interrupted:
                raise BenchError("interrupted") from None
            raise
        finally:
            say("stopping…")
            loop.remove_signal_handler(signal.SIGINT)
            await pieces.stop()
        if results.profile is not None:  # read it before the folder goes
            kept = Path(tempfile.gettempdir()) / "mesh-bench-controller.prof"
            if results.profile.exists():
                kept.write_bytes(results.profile.read_bytes())
            results.profile = kept
        return results


def main() -> None:
    args = parser().parse_args()
    try:
        args.split = [float(x) for x in args.split.split(",")]
    except ValueError:
        sys.exit("--split takes three percentages, e.g. 1,9,90")
    if len(args.split) != 3 or any(x < 0 for x in args.split) or sum(args.split) <= 0:
        sys.exit("--split takes three percentages, e.g. 1,9,90")
    if not 1 <= args.machines <= 100_000:
        sys.exit("--machines must be between 1 and 100000")
    if args.plans < 1 or args.beat_interval <= 0 or args.idle <= 0:
        sys.exit("--plans, --beat-interval and --idle must be positive")
    if not 1 <= args.nats <= 5:
        sys.exit("--nats must be between 1 and 5")
    os.environ.pop("MESH_CREDS", None)  # the bench's nats-server has no authorization block
    report(run_or_exit(run(args)), args)


if __name__ == "__main__":
    main()
