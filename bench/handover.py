"""Benchmark: `status` verbs at a steady rate while the seat changes hands.

The pieces are real: nats-server (no auth, as the tests run it), PostgreSQL (embedded, from
mesh.embedded) and two controller processes (`python -m mesh controller run --instance ctl-a`),
one holding the seat and one standing by. A client sends `status` (`mesh.ctl.status`, body
`{}`) open-loop at `--rate` requests a second: request i is due at start + i/rate and is sent
then (late, not dropped, when the client falls behind), once, with its own `--timeout`;
nothing is retried. Every request is recorded: when it was due and sent, when and how it ended
(a reply, an error reply, no responders, a timeout) and which holder and epoch answered.

Three scenarios, each `--runs` times, in this order:

1. `handover`: a request on `mesh.ctl.handover` (what `mesh handover` sends); the standby takes
   the seat, the old holder stands by again.
2. `sigterm`: SIGTERM to the holder; the standby takes the seat, the old holder exits (exit code
   checked); a fresh controller is started to stand by for the next run.
3. `sigkill`: SIGKILL to the holder; the standby, blocked on the seat's advisory lock, gets it
   when PostgreSQL sees the dead session; a fresh controller is started to stand by.

Each run sends `--before` seconds of requests, then the event, then goes on until the new
holder answers and `--after` seconds more, and waits for every outstanding request. It prints
requests sent, failed (error replies and no responders), timed out, p50/p99/max latency of the
answered requests (from the moment each was sent), the longest gap with no answer (the longest
interval between two consecutive successful replies arriving), the time from the event to the
first answer from the new holder (a reply whose seat.epoch is higher) and a timeline of the
seat's own announcements on `mesh.seat.mesh-controller.*` (handover, ready, released, held),
as this client heard them, relative to the event; "cores" is how many cores the whole machine
kept busy during the run (the bench's own pieces included) and "cpu wait" the share of the
run in which some runnable task waited for a CPU (/proc/pressure/cpu): high values mean the
figures include queueing for the CPU behind other work. With `--log-ms` the controllers log
with millisecond timestamps and their "hands over", "released" and "holds the seat" lines join
the timeline (the last one comes after the new epoch is written, before the fleet is loaded
and the seat announced `held`).
Then a summary per scenario and the issue's aims: (a) planned handover: zero failed and timed
out, max latency under 250 ms; (b) SIGKILL: first answer within 1 s of the kill. It never
fails on a timing (see docs/performance.md).

    .venv/bin/python bench/handover.py [--rate 500] [--runs 3] [--timeout 2] [--before 1]
                                       [--after 2] [--scenarios handover,sigterm,sigkill]
                                       [--log-ms] [--keep] [--deadline 900]

Everything lives in a temporary folder (`--keep` keeps it, with the controllers' logs); every
child runs in its own session and is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.client import __version__ as nats_py_version
from nats.aio.msg import Msg

from mesh import subjects, wire
from mesh.embedded import natsd, ports, postgres
from mesh.embedded.children import Child, spawn
from mesh.model import HandoverReply, SeatAnnounce, StatusReply

STATUS_SUBJECT = "mesh.ctl.status"
HANDOVER_SUBJECT = "mesh.ctl.handover"
SCENARIOS = ("handover", "sigterm", "sigkill")
AIM_PLANNED_MAX = 0.250  # (a) max latency through a planned handover, seconds
AIM_KILL_FIRST = 1.0  # (b) first answer after a SIGKILL, seconds

# --log-ms: `python -m mesh` with millisecond log timestamps (mesh's own are whole seconds);
# main()'s logging.basicConfig then does nothing, the root logger having its handler already.
LOG_MS_WRAPPER = (
    "import logging, runpy; logging.basicConfig(level=logging.INFO, "
    "format='%(asctime)s.%(msecs)03d %(name)s: %(message)s', datefmt='%H:%M:%S'); "
    "runpy.run_module('mesh', run_name='__main__', alter_sys=True)"
)
# What the controllers log around a handover: (pattern, the name the timeline gives it).
LOG_EVENTS = (
    (re.compile(r"controller (\S+) hands over the seat"), "log: hands over"),
    (re.compile(r"controller (\S+) released the seat"), "log: released"),
    (re.compile(r"controller (\S+) holds the seat"), "log: took the seat"),
)
LOG_WINDOW = 3.0  # seconds after the event: this run's lines, not the previous run's
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) (.*)$")


def say(line: str = "") -> None:
    print(line, flush=True)


class BenchError(Exception):
    """The run cannot go on; the message says why."""


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def machine_busy_seconds() -> float:
    """CPU time all cores spent busy (not idle, not waiting on I/O), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_stall_seconds() -> float | None:
    """Seconds in which some runnable task waited for a CPU (/proc/pressure/cpu, "some"), or
    None without pressure stall information."""
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
    except OSError:
        return None
    return int(some[-1].removeprefix("total=")) / 1e6


# --- the load: open-loop status requests ---------------------------------------------------


class _Seat(msgspec.Struct):
    holder: str
    epoch: int


class _Handover(msgspec.Struct):
    gap_ms: float | None = None


class _Status(msgspec.Struct):
    """What the load reads of a status reply (or of an error reply)."""

    seat: _Seat | None = None
    handover: _Handover | None = None
    error: dict | None = None


@dataclass
class Request:
    due: float  # perf_counter
    sent: float = 0.0
    ended: float = 0.0  # when the reply, error or timeout came back to this client
    outcome: str = ""  # ok, error, no responders, timeout
    holder: str = ""
    epoch: int = 0
    gap_ms: float | None = None  # the answering holder's own figure for its planned takeover

    @property
    def latency(self) -> float:
        return self.ended - self.sent


class Load:
    """Open-loop `status` requests at `rate` a second until `stop()`; each sent once."""

    def __init__(self, nc: Client, rate: float, timeout: float) -> None:
        self.nc = nc
        self.interval = 1.0 / rate
        self.timeout = timeout
        self.requests: list[Request] = []
        self.started = 0.0
        self.stopped = 0.0
        self._stop = asyncio.Event()
        self.first_new: Request | None = None  # the first reply (by arrival) from a new epoch
        self.new_epoch_above = -1  # replies with an epoch above this count as the new holder
        self.new_holder = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        self.started = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            i = 0
            while not self._stop.is_set():
                due = self.started + i * self.interval
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                    if self._stop.is_set():
                        break
                request = Request(due=due)
                self.requests.append(request)
                tg.create_task(self._one(request))
                i += 1
            self.stopped = time.perf_counter()

    async def _one(self, r: Request) -> None:
        r.sent = time.perf_counter()
        try:
            msg = await self.nc.request(STATUS_SUBJECT, b"{}", timeout=self.timeout)
        except nats.errors.NoRespondersError:
            r.ended, r.outcome = time.perf_counter(), "no responders"
            return
        except nats.errors.TimeoutError:
            r.ended, r.outcome = time.perf_counter(), "timeout"
            return
        r.ended = time.perf_counter()
        try:
            reply = msgspec.json.decode(msg.data, type=_Status)
        except msgspec.DecodeError:
            r.outcome = "error"
            return
        if reply.error is not None or reply.seat is None:
            r.outcome = "error"
            return
        r.outcome, r.holder, r.epoch = "ok", reply.seat.holder, reply.seat.epoch
        if reply.handover is not None:
            r.gap_ms = reply.handover.gap_ms
        if r.epoch > self.new_epoch_above >= 0 and (
            self.first_new is None or r.ended < self.first_new.ended
        ):
            self.first_new = r
            self.new_holder.set()


# --- one run and its figures ---------------------------------------------------------------


@dataclass
class Run:
    scenario: str
    index: int
    old: str
    new: str
    epoch_before: int
    event_at: float  # perf_counter of the event (the handover request sent, the signal sent)
    event_wall: float  # time.time() of the event, for the controllers' log timestamps
    requests: list[Request]
    seat_events: list[tuple[float, str, str]]  # (perf_counter, event, instance)
    busy_cores: float  # the whole machine, during the run
    cpu_wait: float | None  # the share of the run in which some task waited for a CPU
    log_events: list[tuple[float, str, str]] = field(default_factory=list)  # (after, event, who)
    exit_after: float | None = None  # sigterm: the old holder's exit, after the event
    exit_code: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def answered(self) -> list[Request]:
        return [r for r in self.requests if r.outcome == "ok"]

    def count(self, *outcomes: str) -> int:
        return sum(r.outcome in outcomes for r in self.requests)

    def percentile(self, q: float) -> float:
        ordered = sorted(r.latency for r in self.answered)
        index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
        return ordered[index]

    @property
    def max_latency(self) -> float:
        return max(r.latency for r in self.answered)

    @property
    def longest_gap(self) -> tuple[float, float]:
        """The longest interval between two consecutive successful replies arriving, and when
        it began (after the event)."""
        arrivals = sorted(r.ended for r in self.answered)
        gaps = [(b - a, a - self.event_at) for a, b in itertools.pairwise(arrivals)]
        return max(gaps) if gaps else (0.0, 0.0)

    @property
    def first_new(self) -> Request | None:
        new = [r for r in self.answered if r.epoch > self.epoch_before]
        return min(new, key=lambda r: r.ended) if new else None

    @property
    def switch(self) -> float | None:
        """From the event to the first answer from the new holder."""
        first = self.first_new
        return None if first is None else first.ended - self.event_at

    @property
    def late_sends(self) -> float:
        """How far behind its schedule this client sent a request, at worst."""
        return max(r.sent - r.due for r in self.requests)

    def timeline(self) -> str:
        heard = [(at - self.event_at, ev, inst) for at, ev, inst in self.seat_events]
        both = sorted(heard + self.log_events)
        parts = [f"{ev} {inst} {'+' if after >= 0 else ''}{ms(after)}" for after, ev, inst in both]
        if self.switch is not None:
            parts.append(f"first answer +{ms(self.switch)}")
        if self.exit_after is not None:
            parts.append(f"old holder exited +{ms(self.exit_after)} (code {self.exit_code})")
        return ", ".join(parts)


HEADER = (
    f"{'scenario':<9} {'run':>3} {'old -> new':<16} {'sent':>6} {'failed':>6} {'timeout':>7} "
    f"{'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'gap ms':>7} {'first ms':>8} {'cores':>5} "
    f"{'cpu wait':>8}"
)


def row(r: Run) -> str:
    gap, _ = r.longest_gap
    return (
        f"{r.scenario:<9} {r.index:>3} {r.old + ' -> ' + r.new:<16} {len(r.requests):>6} "
        f"{r.count('error', 'no responders'):>6} {r.count('timeout'):>7} "
        f"{ms(r.percentile(50)):>7} {ms(r.percentile(99)):>7} {ms(r.max_latency):>7} "
        f"{ms(gap):>7} {ms(r.switch):>8} {r.busy_cores:>5.2f} "
        f"{'-' if r.cpu_wait is None else f'{r.cpu_wait:.0%}':>8}"
    )


def describe(r: Run) -> str:
    gap, gap_at = r.longest_gap
    lines = [
        f"  longest gap {ms(gap)} ms from +{ms(gap_at)} ms; client at worst "
        f"{ms(r.late_sends)} ms behind its schedule",
        f"  timeline (ms after the {'request' if r.scenario == 'handover' else r.scenario}): "
        + r.timeline(),
    ]
    first = r.first_new
    if first is not None and first.gap_ms is not None:
        lines.append(f"  the new holder's own figure: handed over after {first.gap_ms} ms")
    failed = [x for x in r.requests if x.outcome not in ("ok",)]
    if failed:
        kinds = sorted({x.outcome for x in failed})
        span = f"{ms(failed[0].sent - r.event_at)} .. {ms(failed[-1].sent - r.event_at)}"
        lines.append(f"  not answered: {len(failed)} ({', '.join(kinds)}), sent +{span} ms")
    lines.extend(f"  note: {n}" for n in r.notes)
    return "\n".join(lines)


def from_log(child: Child, event_wall: float) -> list[tuple[float, str, str]]:
    """The handover's lines in a controller's log (--log-ms), as (seconds after the event,
    event, instance), for those from just before it to LOG_WINDOW after."""
    day = datetime.fromtimestamp(event_wall)
    found = []
    for line in child.log.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        h, mi, sec, milli, text = m.groups()
        at = day.replace(hour=int(h), minute=int(mi), second=int(sec), microsecond=0)
        after = at.timestamp() + int(milli) / 1000 - event_wall
        if not -0.5 < after < LOG_WINDOW:
            continue
        for pattern, event in LOG_EVENTS:
            if hit := pattern.search(text):
                found.append((after, event, hit.group(1)))
    return found


# --- the pieces ----------------------------------------------------------------------------


async def _port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


class Pieces:
    """nats-server, PostgreSQL and the controllers, stopped in reverse order."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.children: list[Child] = []
        self.controllers: dict[str, Child] = {}
        self.nats_url = ""
        self.database_url = ""
        self.log_ms = False
        self._named = 0

    async def nats(self) -> Child:
        port = ports.free_port()
        conf = natsd.write_config(self.folder / "nats", port=port, name="bench")
        child = await spawn("nats-server", natsd.argv(conf), log=self.folder / "logs" / "nats.log")
        self.children.append(child)
        await until("nats-server to listen", lambda: _port_open(port), within=20, child=child)
        self.nats_url = f"nats://127.0.0.1:{port}"
        return child

    async def postgres(self) -> Child:
        try:
            child, self.database_url = await postgres.start(
                self.folder / "pg", log=self.folder / "logs" / "postgres.log", database="mesh"
            )
        except postgres.PostgresFailed as e:
            raise BenchError(str(e)) from None
        self.children.append(child)
        return child

    async def controller(self) -> str:
        """Start a controller named ctl-a, ctl-b, … and return its name."""
        n = self._named
        self._named += 1
        name = f"ctl-{chr(ord('a') + n)}" if n < 26 else f"ctl-{n}"
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1", MESH_NATS_URL=self.nats_url, MESH_DATABASE_URL=self.database_url
        )
        mesh = ["-c", LOG_MS_WRAPPER] if self.log_ms else ["-m", "mesh"]
        argv = [sys.executable, *mesh, "controller", "run", "--instance", name]
        child = await spawn(name, argv, log=self.folder / "logs" / f"{name}.log", env=env)
        self.children.append(child)
        self.controllers[name] = child
        return name

    async def stop(self) -> None:
        for child in reversed(self.children):  # controllers, postgres, nats-server
            sig = signal.SIGINT if child.name == "postgres" else signal.SIGTERM
            await child.stop(sig=sig, timeout=15)


async def until(
    what: str,
    probe: Callable[[], Awaitable[object]],
    *,
    within: float,
    child: Child | None = None,
    pieces: Pieces | None = None,
) -> object:
    """Poll `probe` every 0.1 s until it returns something true; fail if a child exits."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for c in [child] if child else list(pieces.controllers.values()) if pieces else []:
            if not c.running and not c.stopping:
                raise BenchError(f"{c.name} exited while waiting for {what}; {c.log}:\n{c.tail()}")
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.1)
    raise BenchError(f"timed out waiting for {what}")


async def status(nc: Client) -> StatusReply | None:
    try:
        msg = await nc.request(STATUS_SUBJECT, b"{}", timeout=1)
        return wire.decode_reply(msg.data, StatusReply)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, wire.RemoteError):
        return None


# --- the scenarios -------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, pieces: Pieces, ctl: Client, load_nc: Client):
        self.args = args
        self.pieces = pieces
        self.ctl = ctl  # the bench's own connection: status probes, the handover request
        self.load_nc = load_nc  # the load's connection, nothing else on it
        self.seat_events: list[tuple[float, str, str]] = []

    async def listen(self) -> None:
        async def heard(msg: Msg) -> None:
            at = time.perf_counter()
            event = msg.subject.rsplit(".", 1)[-1]
            if event == "standby":
                return  # every second from every standby: noise here
            try:
                instance = msgspec.json.decode(msg.data, type=SeatAnnounce).instance
            except msgspec.DecodeError:
                instance = "?"
            self.seat_events.append((at, event, instance))

        await self.ctl.subscribe(subjects.SEAT_EVENTS, cb=heard)
        await self.ctl.flush()

    async def seated(self) -> tuple[str, int, str]:
        """Wait until one running controller holds the seat and exactly one other stands by;
        then (holder, epoch, standby)."""
        running = {n for n, c in self.pieces.controllers.items() if c.running}

        async def probe() -> tuple[str, int, str] | None:
            s = await status(self.ctl)
            if s is None or s.seat is None or s.seat.holder not in running:
                return None
            standbys = [x.instance for x in s.standbys]
            if len(standbys) != 1 or standbys[0] not in running:
                return None
            return s.seat.holder, s.seat.epoch, standbys[0]

        found = await until(
            "a holder and one standby", probe, within=60, pieces=self.pieces
        )  # the standby announces itself every second; give it one more to block on the lock
        await asyncio.sleep(1.0)
        assert isinstance(found, tuple)
        return found

    async def run(self, scenario: str, index: int) -> Run:
        args = self.args
        old, epoch, standby = await self.seated()
        load = Load(self.load_nc, args.rate, args.timeout)
        load.new_epoch_above = epoch
        self.seat_events.clear()
        busy, stalled = machine_busy_seconds(), cpu_stall_seconds()
        loading = asyncio.create_task(load.run())
        notes: list[str] = []
        exited: list[float] = []  # when the old holder's process ended (sigterm, sigkill)
        exiting: asyncio.Task[int] | None = None
        try:
            await asyncio.sleep(args.before)
            child = self.pieces.controllers[old]
            event_at, event_wall = time.perf_counter(), time.time()
            if scenario == "handover":
                msg = await self.ctl.request(HANDOVER_SUBJECT, b"{}", timeout=5)
                reply = wire.decode_reply(msg.data, HandoverReply)
                notes.append(f"handover reply after {ms(time.perf_counter() - event_at)} ms: "
                             f"{reply.message}")  # fmt: skip
            else:
                os.kill(child.pid, signal.SIGTERM if scenario == "sigterm" else signal.SIGKILL)
                exiting = asyncio.create_task(child.proc.wait())
                exiting.add_done_callback(lambda _: exited.append(time.perf_counter()))
            try:
                await asyncio.wait_for(load.new_holder.wait(), timeout=30)
            except TimeoutError:
                raise BenchError(f"{scenario}: no answer from a new holder within 30 s") from None
            await asyncio.sleep(args.after)
        finally:
            load.stop()
            await loading  # every request sent has ended (answered or timed out) by now
        seconds = load.stopped - load.started
        busy_cores = (machine_busy_seconds() - busy) / seconds
        stalled_now = cpu_stall_seconds()
        cpu_wait = (
            None if stalled is None or stalled_now is None else (stalled_now - stalled) / seconds
        )
        new = load.first_new.holder if load.first_new else "?"
        run = Run(
            scenario=scenario, index=index, old=old, new=new, epoch_before=epoch,
            event_at=event_at, event_wall=event_wall, requests=load.requests,
            seat_events=list(self.seat_events),
            busy_cores=busy_cores, cpu_wait=cpu_wait, notes=notes,
        )  # fmt: skip
        if new != standby:
            run.notes.append(f"the new holder is {new}, not the standby {standby}")
        if self.args.log_ms:
            for name in (old, new):
                if name in self.pieces.controllers:
                    run.log_events += from_log(self.pieces.controllers[name], event_wall)
        if exiting is not None:  # the old holder is gone (or going): wait, start a fresh one
            try:
                code = await asyncio.wait_for(exiting, timeout=30)
            except TimeoutError:
                raise BenchError(f"{old} did not exit within 30 s of {scenario}") from None
            await asyncio.sleep(0)  # the done callback
            run.exit_after, run.exit_code = exited[0] - event_at, code
            child.stopping = True  # gone on purpose
            await self.pieces.controller()
        return run


async def bench(args: argparse.Namespace, pieces: Pieces) -> list[Run]:
    say("starting nats-server…")
    natsd_child = await pieces.nats()
    say(f"  nats-server on {pieces.nats_url} (pid {natsd_child.pid})")
    say("starting PostgreSQL…")
    pg = await pieces.postgres()
    say(f"  postgres pid {pg.pid}")
    ctl = await nats.connect(pieces.nats_url, name="bench control", allow_reconnect=False)
    load_nc = await nats.connect(pieces.nats_url, name="bench load", allow_reconnect=False)
    try:
        b = Bench(args, pieces, ctl, load_nc)
        await b.listen()
        say("starting two controllers…")
        first = await pieces.controller()

        async def holds() -> bool:
            s = await status(ctl)
            return s is not None and s.seat is not None

        await until(f"{first} to hold the seat", holds, within=60, pieces=pieces)
        await pieces.controller()
        holder, epoch, standby = await b.seated()
        say(f"  {holder} holds the seat (epoch {epoch}), {standby} stands by")
        say(f"warming up: {args.rate:g} status/s for 2 s…")
        warm = Load(load_nc, args.rate, args.timeout)
        warming = asyncio.create_task(warm.run())
        await asyncio.sleep(2)
        warm.stop()
        await warming
        if any(r.outcome != "ok" for r in warm.requests):
            say("  note: some warm-up requests were not answered")

        runs: list[Run] = []
        say()
        say(HEADER)
        say("-" * len(HEADER))
        for scenario in args.scenarios:
            for i in range(1, args.runs + 1):
                r = await b.run(scenario, i)
                runs.append(r)
                say(row(r))
                say(describe(r))
        return runs
    finally:
        await load_nc.close()
        await ctl.close()


# --- the summary ---------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    """min / median / max, in ms."""
    if not values:
        return "-"
    return f"{ms(min(values))} / {ms(statistics.median(values))} / {ms(max(values))}"


def summary(runs: list[Run], args: argparse.Namespace) -> None:
    say()
    say(
        f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, nats-py "
        f"{nats_py_version}, load average {os.getloadavg()[0]:.2f}; rate {args.rate:g}/s, "
        f"timeout {args.timeout:g} s"
    )
    say()
    say("summary (min / median / max over runs, ms; counts are totals):")
    for scenario in args.scenarios:
        these = [r for r in runs if r.scenario == scenario]
        if not these:
            continue
        sent = sum(len(r.requests) for r in these)
        failed = sum(r.count("error", "no responders") for r in these)
        timed_out = sum(r.count("timeout") for r in these)
        say(
            f"  {scenario:<9} {len(these)} runs, {sent} sent, {failed} failed, "
            f"{timed_out} timed out; p99 {spread([r.percentile(99) for r in these])}; "
            f"max latency {spread([r.max_latency for r in these])}; longest gap "
            f"{spread([r.longest_gap[0] for r in these])}; first answer from the new holder "
            f"{spread([r.switch for r in these if r.switch is not None])}"
        )
    planned = [r for r in runs if r.scenario in ("handover", "sigterm")]
    if planned:
        bad = sum(r.count("error", "no responders", "timeout") for r in planned)
        worst = max(r.max_latency for r in planned)
        met = bad == 0 and worst < AIM_PLANNED_MAX
        say(
            f"aim (a) planned handover: zero failed or timed out, max latency under "
            f"{AIM_PLANNED_MAX * 1000:.0f} ms: {'met' if met else 'NOT met'} "
            f"({bad} not answered, worst max latency {ms(worst)} ms)"
        )
    killed = [r for r in runs if r.scenario == "sigkill"]
    if killed:
        worst = max((r.switch or float("inf")) for r in killed)
        met = worst < AIM_KILL_FIRST
        say(
            f"aim (b) SIGKILL: first answer within {AIM_KILL_FIRST:g} s of the kill: "
            f"{'met' if met else 'NOT met'} (worst {ms(worst)} ms)"
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=500, help="status requests a second (500)")
    p.add_argument("--runs", type=int, default=3, help="runs of each scenario (3)")
    p.add_argument("--timeout", type=float, default=2.0, help="each request's timeout, s (2)")
    p.add_argument("--before", type=float, default=1.0, help="load before the event, s (1)")
    p.add_argument("--after", type=float, default=2.0, help="load after the new holder, s (2)")
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated, in order (handover,sigterm,sigkill)",
    )
    p.add_argument("--deadline", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--keep", action="store_true", help="keep the folder with the logs")
    p.add_argument(
        "--log-ms",
        action="store_true",
        help="controllers log with millisecond timestamps (run through a `python -c` wrapper "
        "around `-m mesh`); their handover lines join each run's timeline",
    )
    return p


async def run(args: argparse.Namespace) -> list[Run]:
    folder = Path(tempfile.mkdtemp(prefix="mesh-bench-handover-"))
    pieces = Pieces(folder)
    pieces.log_ms = args.log_ms
    try:
        async with asyncio.timeout(args.deadline):
            return await bench(args, pieces)
    except (nats.errors.Error, wire.RemoteError) as e:  # before TimeoutError: nats-py's is one
        raise BenchError(f"a request failed: {type(e).__name__}: {e}") from None
    except TimeoutError:
        raise BenchError(f"the run took longer than --deadline {args.deadline:g}s") from None
    finally:
        say("stopping…")
        await pieces.stop()
        if args.keep:
            say(f"logs kept in {folder / 'logs'}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    args = parser().parse_args()
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not args.scenarios or any(s not in SCENARIOS for s in args.scenarios):
        sys.exit(f"--scenarios: a comma-separated list of {', '.join(SCENARIOS)}")
    if args.rate <= 0 or args.runs < 1 or args.timeout <= 0:
        sys.exit("--rate, --runs and --timeout must be positive")
    try:
        runs = asyncio.run(run(args))
    except BenchError as e:
        sys.exit(f"bench failed: {e}")
    except KeyboardInterrupt:
        sys.exit(130)
    summary(runs, args)


if __name__ == "__main__":
    main()
