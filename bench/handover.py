"""Benchmark: `status` verbs at a steady rate while the seat changes hands.

The pieces are real: nats-server (no auth, as the tests run it), PostgreSQL (embedded, from
mesh.embedded) and two controller processes (`python -m programs.cli controller run --instance
ctl-a`),
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

With `--store-standby` the scenarios are replaced by the store's own failover (issue 14): two
meshes side by side, each with its own nats-server: one on a single PostgreSQL with one
controller, one on a primary and a synchronous standby (mesh.embedded.postgres, as `mesh dev up
--store-standby` makes them) behind the multi-host URL, with two controllers. First
`--rate-rounds` rounds, alternating which mesh goes first, of `status` (64 in flight, closed
loop) and `label` (a writing verb: one commit each, 8 in flight) for `--rate-seconds` each: the
rates with synchronous replication as a share of the single server's. Then `--runs` failover
rounds at `--rate` status/s: SIGKILL to the primary's process group (the server and its
backends, as a crash), `pg_ctl promote` of the standby as soon as the server is gone, on until
the new holder answers; the first answer is timed from the kill and from the promote. After
each round a fresh standby is copied from the new primary onto the dead one's port (the URL
never changes) and a fresh controller replaces the old holder, which exits (SeatLost).

    .venv/bin/python bench/handover.py --store-standby [--runs 10] [--rate-rounds 4]
                                       [--rate-seconds 3] [--rate 500]

Everything lives in a temporary folder (`--keep` keeps it, with the controllers' logs); every
child runs in its own session and is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import asyncpg
import msgspec
import nats
import nats.errors
from common import (  # bench/common.py: what the benches share
    BenchError,
    CpuMeter,
    cpu_stall_seconds,
    machine_line,
    port_open,
    run_or_exit,
    say,
    secrets_key_file,
)
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import subjects, wire
from mesh.embedded import natsd, pgauth, ports, postgres
from mesh.embedded.children import Child, spawn
from mesh.entry import ENTRY
from mesh.model import HandoverReply, SeatAnnounce, StatusReply

STATUS_SUBJECT = "mesh.ctl.status"
HANDOVER_SUBJECT = "mesh.ctl.handover"
SCENARIOS = ("handover", "sigterm", "sigkill")
AIM_PLANNED_MAX = 0.250  # (a) max latency through a planned handover, seconds
AIM_KILL_FIRST = 1.0  # (b) first answer after a SIGKILL, seconds

# --log-ms: `python -m programs.cli` with millisecond log timestamps (mesh's own are whole seconds);
# main()'s logging.basicConfig then does nothing, the root logger having its handler already.
LOG_MS_WRAPPER = (
    "import logging, runpy; logging.basicConfig(level=logging.INFO, "
    "format='%(asctime)s.%(msecs)03d %(name)s: %(message)s', datefmt='%H:%M:%S'); "
    f"runpy.run_module('{ENTRY}', run_name='__main__', alter_sys=True)"
)
# What the controllers log around a handover: (pattern, the name the timeline gives it).
LOG_EVENTS = (
    (re.compile(r"controller (\S+) hands over the seat"), "log: hands over"),
    (re.compile(r"controller (\S+) released the seat"), "log: released"),
    (re.compile(r"controller (\S+) holds the seat"), "log: took the seat"),
)
T = TypeVar("T")
LOG_WINDOW = 3.0  # seconds after the event: this run's lines, not the previous run's
LOG_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) (.*)$")


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


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
    promote_at: float | None = None  # failover: perf_counter when `pg_ctl promote` was run

    @property
    def from_promote(self) -> float | None:
        """failover: from `pg_ctl promote` to the first answer from the new holder."""
        first = self.first_new
        if first is None or self.promote_at is None:
            return None
        return first.ended - self.promote_at

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


class Pieces:
    """nats-server, PostgreSQL and the controllers, stopped in reverse order."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.passwords = pgauth.Passwords(folder / "passwords")  # the store's, as dev up's
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
        await until("nats-server to listen", lambda: port_open(port), within=20, child=child)
        self.nats_url = f"nats://127.0.0.1:{port}"
        return child

    async def postgres(self) -> Child:
        try:
            child, self.database_url = await postgres.start(
                self.folder / "pg", log=self.folder / "logs" / "postgres.log", database="mesh",
                passwords=self.passwords,
            )  # fmt: skip
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
            PYTHONUNBUFFERED="1",
            MESH_NATS_URL=self.nats_url,
            MESH_DATABASE_URL=self.database_url,
            MESH_SECRETS_KEY_FILE=secrets_key_file(self.folder),
        )
        mesh = ["-c", LOG_MS_WRAPPER] if self.log_ms else ["-m", ENTRY]
        argv = [sys.executable, *mesh, "controller", "run", "--instance", name]
        child = await spawn(name, argv, log=self.folder / "logs" / f"{name}.log", env=env)
        self.children.append(child)
        self.controllers[name] = child
        return name

    async def stop(self) -> None:
        for child in reversed(self.children):  # controllers, postgres, nats-server
            sig = signal.SIGINT if child.name.startswith("postgres") else signal.SIGTERM
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
        meter = CpuMeter()
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
        busy_cores, cpu_wait = meter.read(load.stopped - load.started)
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


# --- --store-standby: the store as a primary and a synchronous standby ---------------------

FAILOVER = "failover"
STATUS_IN_FLIGHT = 64  # --store-standby's rate: status requests outstanding at once
LABEL_IN_FLIGHT = 8  # and label requests (a slow verb: the controller takes 16 at a time)
LABEL_SUBJECT = "mesh.ctl.label"


class _Reply(msgspec.Struct):
    error: dict | None = None


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


class StorePair:
    """PostgreSQL as a primary and a synchronous standby (mesh.embedded.postgres), on two ports
    that stay the same so that one multi-host URL serves every round: after a failover the
    promoted server is the primary, and a fresh standby copied from it takes the dead one's
    port (the two swap roles each round, as under an HA manager)."""

    def __init__(self, pieces: Pieces) -> None:
        self.pieces = pieces
        self.primary: Child | None = None
        self.standby: Child | None = None
        self.standby_data = Path()
        self.primary_port = 0
        self.standby_port = 0
        self._copies = 0

    async def start(self) -> None:
        folder = self.pieces.folder
        try:
            self.primary, url = await postgres.start(
                folder / "pg-0", log=folder / "logs" / "postgres-0.log", database="mesh",
                settings=postgres.PRIMARY, passwords=self.pieces.passwords,
            )  # fmt: skip
        except postgres.PostgresFailed as e:
            raise BenchError(str(e)) from None
        self.pieces.children.append(self.primary)
        self.primary_port, self.standby_port = _port_of(url), ports.free_port()
        self.pieces.database_url = postgres.multi_host_url(
            [self.primary_port, self.standby_port], "mesh", user=postgres.CONTROLLER_USER,
            password=self.pieces.passwords.of(postgres.CONTROLLER_USER),
        )  # fmt: skip
        await self.new_standby()

    async def new_standby(self) -> None:
        """Copy the primary into a fresh folder (pg_basebackup), stream from it on
        standby_port, then make the primary wait for it (synchronous_standby_names, with ALTER
        SYSTEM: the copy was taken before, so a promoted copy waits for no standby of its own)
        and wait until it is `sync`."""
        self._copies += 1
        n, folder, primary_port = self._copies, self.pieces.folder, self.primary_port
        data = folder / f"pg-{n}"
        superuser = self.pieces.passwords.of(postgres.PG_USER)
        try:
            child, _ = await postgres.start_standby(
                data, primary_port=primary_port, log=folder / "logs" / f"postgres-{n}.log",
                passwords=self.pieces.passwords, port=self.standby_port,
            )  # fmt: skip
            self.pieces.children.append(child)
            self.standby, self.standby_data = child, data
            conn = await asyncpg.connect(postgres.url(primary_port, password=superuser), timeout=5)
            try:
                await conn.execute(
                    f"ALTER SYSTEM SET synchronous_standby_names = '{postgres.STANDBY_NAME}'"
                )
                await conn.execute("SELECT pg_reload_conf()")
            finally:
                await conn.close()
            await postgres.wait_synchronous(
                primary_port, password=superuser, deadline=60, alive=lambda: child.running
            )
        except (postgres.PostgresFailed, OSError, asyncpg.PostgresError) as e:
            raise BenchError(f"standby {data.name}: {e}") from None

    def promote(self) -> None:
        """What an HA manager does once the primary is gone (docs/operations.md)."""
        done = subprocess.run(
            [postgres.bin("pg_ctl"), "promote", "-w", "-t", "60", "-D", str(self.standby_data)],
            capture_output=True, text=True, **postgres.run_as(),
        )  # fmt: skip
        if done.returncode != 0:
            raise BenchError(f"pg_ctl promote failed: {done.stderr.strip()}")

    def swap(self) -> None:
        """After a failover: the promoted standby is the primary, the dead one's port is free."""
        assert self.standby is not None
        self.primary, self.standby = self.standby, None
        self.primary_port, self.standby_port = self.standby_port, self.primary_port


async def failover(b: Bench, pair: StorePair, index: int) -> Run:
    """One round: status at --rate; SIGKILL to the primary's whole process group (the server
    and every backend, as a crash); `pg_ctl promote` of the standby once the server is gone;
    on until the new holder answers and --after more. Then a fresh standby and a fresh
    standing-by controller for the next round."""
    args = b.args
    old, epoch, standby = await b.seated()
    assert pair.primary is not None
    primary = pair.primary
    load = Load(b.load_nc, args.rate, args.timeout)
    load.new_epoch_above = epoch
    b.seat_events.clear()
    meter = CpuMeter()
    loading = asyncio.create_task(load.run())
    notes: list[str] = []
    try:
        await asyncio.sleep(args.before)
        event_at, event_wall = time.perf_counter(), time.time()
        primary.stopping = True
        os.killpg(primary.pid, signal.SIGKILL)
        await primary.proc.wait()
        promote_at = time.perf_counter()
        await asyncio.to_thread(pair.promote)
        promoted = time.perf_counter()
        notes.append(
            f"primary gone +{ms(promote_at - event_at)} ms; pg_ctl promote returned "
            f"+{ms(promoted - event_at)} ms"
        )
        try:
            await asyncio.wait_for(load.new_holder.wait(), timeout=60)
        except TimeoutError:
            raise BenchError("failover: no answer from a new holder within 60 s") from None
        await asyncio.sleep(args.after)
    finally:
        load.stop()
        await loading
    busy_cores, cpu_wait = meter.read(load.stopped - load.started)
    new = load.first_new.holder if load.first_new else "?"
    run = Run(
        scenario=FAILOVER, index=index, old=old, new=new, epoch_before=epoch,
        event_at=event_at, event_wall=event_wall, requests=load.requests,
        seat_events=list(b.seat_events),
        busy_cores=busy_cores, cpu_wait=cpu_wait, notes=notes, promote_at=promote_at,
    )  # fmt: skip
    run.notes.append(
        f"first answer from the new holder +{ms(run.from_promote)} ms after the promote"
    )
    stale = [r for r in run.answered if r.epoch <= epoch and r.ended > event_at]
    if stale:  # the old holder answers from memory until its lock session's ping fails
        last = max(r.ended for r in stale) - event_at
        after_new = sum(run.first_new is not None and r.ended > run.first_new.ended for r in stale)
        run.notes.append(
            f"the old holder answered {len(stale)} after the kill, the last at +{ms(last)} ms "
            f"({after_new} of them after the new holder's first)"
        )
    if new != standby:
        run.notes.append(f"the new holder is {new}, not the standby {standby}")
    if args.log_ms:
        for name in (old, new):
            if name in b.pieces.controllers:
                run.log_events += from_log(b.pieces.controllers[name], event_wall)
    # The old holder's lock session died with the server: it steps down and exits (SeatLost).
    child = b.pieces.controllers[old]
    try:
        run.exit_code = await asyncio.wait_for(child.proc.wait(), timeout=30)
    except TimeoutError:
        run.notes.append(f"{old} still runs 30 s after the primary's loss (left standing by)")
    else:
        run.notes.append(f"{old} exited with code {run.exit_code}; a fresh controller stands by")
        child.stopping = True
        await b.pieces.controller()
    pair.swap()
    await pair.new_standby()
    return run


@dataclass
class Rate:
    store: str  # "single" or "sync"
    verb: str
    answered: int
    failed: int
    seconds: float
    cpu_wait: float | None

    @property
    def per_second(self) -> float:
        return self.answered / self.seconds


async def closed_loop(
    nc: Client, subject: str, body: Callable[[int], bytes], *, in_flight: int, seconds: float
) -> tuple[int, int, float]:
    """`in_flight` requests outstanding for `seconds`: (answered, failed, seconds taken)."""
    answered = failed = 0
    numbers = itertools.count()
    started = time.perf_counter()
    deadline = started + seconds

    async def worker() -> None:
        nonlocal answered, failed
        while time.perf_counter() < deadline:
            try:
                msg = await nc.request(subject, body(next(numbers)), timeout=10)
                ok = msgspec.json.decode(msg.data, type=_Reply).error is None
            except (nats.errors.Error, msgspec.DecodeError):
                ok = False
            answered += ok
            failed += not ok

    async with asyncio.TaskGroup() as tg:
        for _ in range(in_flight):
            tg.create_task(worker())
    return answered, failed, time.perf_counter() - started


def _label(i: int) -> bytes:
    return msgspec.json.encode({"machine": "bench-1", "set": {"bench": f"v{i}"}})


async def rates(args: argparse.Namespace, meshes: dict[str, Client]) -> list[Rate]:
    """status (64 in flight) and label (8 in flight) against each mesh's holder in turn, in
    --rate-rounds rounds that alternate which store goes first."""
    found: list[Rate] = []
    say(f"{'round':>5} {'store':<6} {'status/s':>9} {'label/s':>8} {'failed':>6} {'cpu wait':>8}")
    for i in range(1, args.rate_rounds + 1):
        order = list(meshes) if i % 2 else list(reversed(meshes))
        for store in order:
            nc = meshes[store]
            got = []
            for verb, subject, body, in_flight in (
                ("status", STATUS_SUBJECT, lambda _: b"{}", STATUS_IN_FLIGHT),
                ("label", LABEL_SUBJECT, _label, LABEL_IN_FLIGHT),
            ):
                stalled = cpu_stall_seconds()
                answered, failed, seconds = await closed_loop(
                    nc, subject, body, in_flight=in_flight, seconds=args.rate_seconds
                )
                now = cpu_stall_seconds()
                wait = None if stalled is None or now is None else (now - stalled) / seconds
                got.append(Rate(store, verb, answered, failed, seconds, wait))
            found += got
            status_rate, label_rate = got
            waits = [r.cpu_wait for r in got if r.cpu_wait is not None]
            say(
                f"{i:>5} {store:<6} {status_rate.per_second:>9.0f} {label_rate.per_second:>8.0f} "
                f"{status_rate.failed + label_rate.failed:>6} "
                f"{f'{max(waits):.0%}' if waits else '-':>8}"
            )
    return found


async def bench_store_standby(
    args: argparse.Namespace, single: Pieces, paired: Pieces
) -> tuple[list[Run], list[Rate]]:
    say("single server: nats-server, PostgreSQL, one controller…")
    await single.nats()
    await single.postgres()
    say("with a standby: nats-server, PostgreSQL primary + synchronous standby…")
    await paired.nats()
    pair = StorePair(paired)
    await pair.start()
    say(f"  {pgauth.without_password(paired.database_url)}")
    ncs = {
        name: await nats.connect(p.nats_url, name=f"bench {name}", allow_reconnect=False)
        for name, p in (("single", single), ("ctl", paired), ("load", paired))
    }
    try:
        await single.controller()
        b = Bench(args, paired, ncs["ctl"], ncs["load"])
        await b.listen()

        async def holds(nc: Client) -> bool:
            s = await status(nc)
            return s is not None and s.seat is not None

        await until("the single store's holder", lambda: holds(ncs["single"]), within=60,
                    pieces=single)  # fmt: skip
        await paired.controller()
        await until("a holder on the pair", lambda: holds(ncs["ctl"]), within=60, pieces=paired)
        await paired.controller()
        holder, epoch, standby = await b.seated()
        say(f"  {holder} holds the seat (epoch {epoch}), {standby} stands by")
        say()
        say(f"rates: {args.rate_rounds} rounds of {args.rate_seconds:g} s per verb and store")
        found = await rates(args, {"single": ncs["single"], "sync": ncs["ctl"]})
        say()
        say(f"failover: {args.runs} rounds, status at {args.rate:g}/s")
        say(HEADER)
        say("-" * len(HEADER))
        runs: list[Run] = []
        for i in range(1, args.runs + 1):
            r = await failover(b, pair, i)
            runs.append(r)
            say(row(r))
            say(describe(r))
        return runs, found
    finally:
        for nc in ncs.values():
            await nc.close()


def percentiles(values: list[float]) -> str:
    """p50 / p90 / max, in ms."""
    if not values:
        return "-"
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return f"{ms(at(0.5))} / {ms(at(0.9))} / {ms(ordered[-1])}"


def summary_store_standby(runs: list[Run], found: list[Rate], args: argparse.Namespace) -> None:
    say()
    say(machine_line())
    say()
    say("rates (all rounds; share = with a synchronous standby / single server):")
    for verb in ("status", "label"):
        by = {
            store: [r for r in found if r.verb == verb and r.store == store]
            for store in ("single", "sync")
        }
        total = {s: sum(r.answered for r in v) / sum(r.seconds for r in v) for s, v in by.items()}
        shares = [
            b.per_second / a.per_second for a, b in zip(by["single"], by["sync"], strict=True)
        ]
        say(
            f"  {verb:<6} single {total['single']:.0f}/s, sync {total['sync']:.0f}/s: "
            f"{total['sync'] / total['single']:.0%} (rounds {min(shares):.0%} .. "
            f"{max(shares):.0%}); failed {sum(r.failed for r in found if r.verb == verb)}"
        )
    if runs:
        sent = sum(len(r.requests) for r in runs)
        bad = sum(r.count("error", "no responders", "timeout") for r in runs)
        say(f"failover ({len(runs)} rounds, p50 / p90 / max, ms; {sent} sent, {bad} not answered):")
        kill = [r.switch for r in runs if r.switch is not None]
        promote = [r.from_promote for r in runs if r.from_promote is not None]
        say(f"  first answer from the new holder after the kill    {percentiles(kill)}")
        say(f"  first answer from the new holder after the promote {percentiles(promote)}")
        say(f"  longest gap with no answer                         "
            f"{percentiles([r.longest_gap[0] for r in runs])}")  # fmt: skip


async def within_deadline(args: argparse.Namespace, work: Awaitable[T]) -> T:
    """`work` to its end within --deadline; a failed request or the deadline fail the run."""
    try:
        async with asyncio.timeout(args.deadline):
            return await work
    except (nats.errors.Error, wire.RemoteError) as e:  # before TimeoutError: nats-py's is one
        raise BenchError(f"a request failed: {type(e).__name__}: {e}") from None
    except TimeoutError:
        raise BenchError(f"the run took longer than --deadline {args.deadline:g}s") from None


async def run_store_standby(args: argparse.Namespace) -> tuple[list[Run], list[Rate]]:
    folder = Path(tempfile.mkdtemp(prefix="mesh-bench-handover-"))
    folder.chmod(0o755)  # the servers run as their own account (as root) under it
    single, paired = Pieces(folder / "single"), Pieces(folder / "standby")
    single.log_ms = paired.log_ms = args.log_ms
    try:
        return await within_deadline(args, bench_store_standby(args, single, paired))
    finally:
        say("stopping…")
        await paired.stop()
        await single.stop()
        if args.keep:
            say(f"logs kept in {folder}/*/logs")
        else:
            shutil.rmtree(folder, ignore_errors=True)


# --- the summary ---------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    """min / median / max, in ms."""
    if not values:
        return "-"
    return f"{ms(min(values))} / {ms(statistics.median(values))} / {ms(max(values))}"


def summary(runs: list[Run], args: argparse.Namespace) -> None:
    say()
    say(f"{machine_line()}; rate {args.rate:g}/s, timeout {args.timeout:g} s")
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
    p.add_argument(
        "--store-standby",
        action="store_true",
        help="PostgreSQL as a primary and a synchronous standby (the multi-host URL): the "
        "status and label rates beside a single server's, then --runs failovers (the primary "
        "killed, the standby promoted) instead of the scenarios",
    )
    p.add_argument(
        "--rate-rounds", type=int, default=4, help="--store-standby: rounds of rates (4)"
    )
    p.add_argument(
        "--rate-seconds", type=float, default=3.0, help="--store-standby: seconds per rate (3)"
    )
    p.add_argument("--deadline", type=float, default=900, help="seconds for the whole run")
    p.add_argument("--keep", action="store_true", help="keep the folder with the logs")
    p.add_argument(
        "--log-ms",
        action="store_true",
        help="controllers log with millisecond timestamps (run through a `python -c` wrapper "
        "around `-m programs.cli`); their handover lines join each run's timeline",
    )
    return p


async def run(args: argparse.Namespace) -> list[Run]:
    folder = Path(tempfile.mkdtemp(prefix="mesh-bench-handover-"))
    pieces = Pieces(folder)
    pieces.log_ms = args.log_ms
    try:
        return await within_deadline(args, bench(args, pieces))
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
    if args.store_standby:
        runs, found = run_or_exit(run_store_standby(args))
        summary_store_standby(runs, found, args)
        return
    summary(run_or_exit(run(args)), args)


if __name__ == "__main__":
    main()
