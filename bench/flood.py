"""Benchmark: `status` while one host floods its own subjects (issue 39, item 5).

One run, on one nats-server, PostgreSQL and a real controller holding the seat: `--machines`
machines registered through the register verb and beating every second from this script (the
honest fleet), and one more, `flood-1`, registered too. Then phases of `--seconds` each, one
after another: no flood, then `flood-1` publishing registrations (each with another pid and an
inbox reply), beats, then reports (failed applies and processes reports, alternately), as fast
as one process of its own can (this script with `--flood KIND`). Throughout, this client asks
`status` every `--every` seconds, each request sent once with a 5 s timeout.

Per phase it prints what the flooder sent (messages/s), how many `status` requests were asked
and not answered, the answered ones' latency (p50, p95, p99, max, ms), the controller's CPU
(cores) and how much its log grew, and the fewest honest machines `status` counted up (a flood
must not make its neighbours down). Each phase includes `--after` seconds past the flood's
end: a backlog shows there. The phases share one controller, so what one flood leaves behind
shows in the next.

Why: before issue 39 a flood of beats left `status` unanswered for seconds and nats-server
dropped the holder as a slow consumer; docs/performance.md records a run and its command.
Nothing here is asserted (timings are not, anywhere): it prints figures.

    .venv/bin/python bench/flood.py [--seconds 20] [--after 5] [--every 0.01] [--machines 10]
                                    [--kinds registrations,beats,events] [--tls]
                                    [--deadline 600] [--logs DIR]

Everything lives in a temporary folder (`--logs DIR` keeps a copy of its logs: the
controller's, the flooders'); every child runs in its own session and is stopped in a
`finally`, so nothing is left running when the script ends or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
from common import (  # bench/common.py: what the benches share
    STATUS_SUBJECT,
    BenchError,
    Guard,
    Pieces,
    cpu_seconds,
    machine_line,
    run_or_exit,
    say,
)
from nats.aio.client import Client

from mesh import bus, subjects, wire
from mesh.auth import tls as mesh_tls
from mesh.model import (
    Applied,
    Beat,
    Facts,
    ProcessesEvent,
    ProcessState,
    Register,
    RegisterReply,
    StatusReply,
)

KINDS = ("registrations", "beats", "events")
FLOODER = "flood-1"
FACTS = Facts(os="linux", arch="x86_64", cpus=1, memory=1 << 30, mesh_version="bench")
ANSWER_WITHIN = 5.0  # each `status` is sent once, with this timeout
YIELD_EVERY = 200  # the flooder's messages between turns of its loop (its flusher writes)


# --- the flooder (its own process: `python bench/flood.py --flood KIND --url URL`) -----------


def messages(kind: str, name: str):
    """(subject, body, reply) for ever, as tests/flooding.py makes them with a host's inbox."""
    for n in itertools.count():
        if kind == "registrations":
            req = Register(name=name, tier=None, labels={}, facts=FACTS, beat_interval=3600,
                           pid=100_000 + n)  # fmt: skip
            yield subjects.ctl_host(name, "register"), wire.encode(req), f"_INBOX.flood.{n}"
        elif kind == "beats":
            beat = Beat(name=name, seq=n, interval=3600)  # as it registered: up throughout
            yield subjects.host(name, "beat"), wire.encode(beat), ""
        elif n % 2:
            failed = Applied(name=name, digest="sha256:" + "0" * 64, epoch=1, ok=False,
                             step="prepare", error=f"flood {n}")  # fmt: skip
            yield subjects.event(name, "applied"), wire.encode(failed), ""
        else:
            state = ProcessState(name="flood", state="running", healthy=True, pid=n)
            yield (
                subjects.event(name, "processes"),
                wire.encode(ProcessesEvent(name=name, processes=[state])),
                "",
            )


async def flood(url: str, ca: str | None, kind: str, seconds: float) -> None:
    """Publish `kind` as fast as this process can for `seconds` (or until SIGTERM); print one
    JSON line: how many were sent, in how long."""
    context = mesh_tls.client_context(cafile=ca) if ca else None
    nc = await nats.connect(url, name=f"bench flood {kind}", tls=context)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sent = 0
    started = time.monotonic()
    until = started + seconds
    for subject, body, reply in messages(kind, FLOODER):
        await nc.publish(subject, body, reply=reply)
        sent += 1
        if sent % YIELD_EVERY == 0:
            await asyncio.sleep(0)
            if stop.is_set() or time.monotonic() >= until:
                break
    took = time.monotonic() - started
    await nc.flush(timeout=10)
    await nc.close()
    print(json.dumps({"sent": sent, "seconds": took}), flush=True)


# --- the measuring side -----------------------------------------------------------------------


@dataclass
class Phase:
    kind: str  # "none" or a flood's kind
    sent: int = 0  # what the flooder published
    flood_seconds: float = 0.0
    asked: int = 0
    unanswered: list[str] = field(default_factory=list)
    took: list[float] = field(default_factory=list)  # seconds, the answered ones
    bus: list[float] = field(default_factory=list)  # seconds, a PING's round trip to the server
    fewest_up: int | None = None  # the fewest honest machines `status` counted up
    cpu: float = 0.0  # the controller's cores over the phase
    log_growth: int = 0  # bytes

    def percentile(self, p: float, of: list[float] | None = None) -> float:
        took = sorted(self.took if of is None else of)
        return took[min(len(took) - 1, int(p * len(took)))] * 1000 if took else float("nan")


async def ask_status(nc: Client, phase: Phase, stop: asyncio.Event, every: float) -> None:
    """`status` every `every` seconds until `stop`, each sent once with ANSWER_WITHIN."""

    async def one() -> None:
        sent = time.monotonic()
        try:
            msg = await nc.request(STATUS_SUBJECT, b"{}", timeout=ANSWER_WITHIN)
            reply = wire.decode_reply(msg.data, StatusReply)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            phase.unanswered.append(type(e).__name__)
            return
        except wire.RemoteError as e:  # busy (shedding), unavailable: not a status
            phase.unanswered.append(e.code)
            return
        phase.took.append(time.monotonic() - sent)
        up = reply.nodes.up - 1  # flood-1 is up too (it beats once an hour)
        phase.fewest_up = up if phase.fewest_up is None else min(phase.fewest_up, up)

    tasks: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        phase.asked += 1
        task = asyncio.create_task(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await asyncio.sleep(every)
    if tasks:
        await asyncio.gather(*tasks)


async def ping_bus(nc: Client, phase: Phase, stop: asyncio.Event, every: float) -> None:
    """The bus's own round trip (a PING on a connection of its own, nothing else on it) every
    `every` seconds: what `status` costs beyond it is the controller's, or the machine's."""
    while not stop.is_set():
        sent = time.monotonic()
        try:
            await nc.flush(timeout=ANSWER_WITHIN)
            phase.bus.append(time.monotonic() - sent)
        except nats.errors.TimeoutError:
            phase.bus.append(ANSWER_WITHIN)
        await asyncio.sleep(every)


async def beat_honestly(nc: Client, names: list[str]) -> None:
    """The honest fleet: a beat of each machine every second, for ever."""
    for seq in itertools.count():
        for name in names:
            await nc.publish(subjects.host(name, "beat"),
                             wire.encode(Beat(name=name, seq=seq, interval=1.0)))  # fmt: skip
        await asyncio.sleep(1.0)


async def register(nc: Client, name: str, beat_interval: float) -> None:
    req = Register(name=name, tier=None, labels={}, facts=FACTS, beat_interval=beat_interval,
                   pid=1)  # fmt: skip
    data = await bus.request(nc, subjects.ctl_host(name, "register"), wire.encode(req),
                             deadline=time.monotonic() + 30)  # fmt: skip
    wire.decode_reply(data, RegisterReply)


async def run_phase(
    kind: str, args: argparse.Namespace, pieces: Pieces, ncs: tuple[Client, Client],
    ctl_pid: int, log: Path,
) -> Phase:  # fmt: skip
    nc, probe = ncs
    phase = Phase(kind=kind)
    stop = asyncio.Event()
    log_before, cpu_before, started = log.stat().st_size, cpu_seconds(ctl_pid), time.monotonic()
    asking = asyncio.create_task(ask_status(nc, phase, stop, args.every))
    pinging = asyncio.create_task(ping_bus(probe, phase, stop, args.every))
    try:
        if kind == "none":
            await asyncio.sleep(args.seconds + args.after)
        else:
            argv = [sys.executable, str(Path(__file__).resolve()), "--flood", kind,
                    "--url", pieces.server_url, "--seconds", str(args.seconds)]  # fmt: skip
            if pieces.ca:
                argv += ["--ca", pieces.ca]
            flooder = await pieces.start(f"flood-{kind}", argv)
            while flooder.running:
                pieces.guard.check()
                await asyncio.sleep(0.1)
            lines = flooder.log.read_text().strip().splitlines()
            try:
                done = json.loads(lines[-1])
            except (IndexError, json.JSONDecodeError):
                raise BenchError(f"the {kind} flooder failed: {flooder.tail()}") from None
            phase.sent, phase.flood_seconds = done["sent"], done["seconds"]
            await asyncio.sleep(args.after)  # `status` asked on through the aftermath
    finally:
        stop.set()
        await asking
        await pinging
    phase.cpu = (cpu_seconds(ctl_pid) - cpu_before) / (time.monotonic() - started)
    phase.log_growth = log.stat().st_size - log_before
    return phase


async def bench(args: argparse.Namespace, pieces: Pieces) -> list[Phase]:
    await pieces.servers_and_store()
    nc = await pieces.connect("bench client", pieces.server_url)
    probe = await pieces.connect("bench probe", pieces.server_url)
    # The honest fleet's beats on a connection of their own, as hosts have: publishing to a
    # subscriber behind a flood, a connection is stalled by nats-server (its producer stall),
    # and its `status` requests with it.
    fleet = await pieces.connect("bench fleet", pieces.server_url)
    try:
        say("starting the controller…")
        ctl = await pieces.controller(nc)
        say(f"  controller pid {ctl.pid} holds the seat")
        honest = [f"node-{i + 1}" for i in range(args.machines)]
        for name in honest:
            await register(nc, name, 1.0)
        await register(nc, FLOODER, 3600)  # up throughout: `fewest up` counts the honest
        say(f"registered {len(honest)} honest machine(s), beating every second, and {FLOODER}")
        beating = asyncio.create_task(beat_honestly(fleet, honest))
        phases = []
        try:
            for kind in ["none", *args.kinds]:
                what = "no flood" if kind == "none" else f"{FLOODER} flooding {kind}"
                say(f"phase: {what}, {args.seconds:g}s and {args.after:g}s after…")
                phases.append(await run_phase(kind, args, pieces, (nc, probe), ctl.pid, ctl.log))
        finally:
            beating.cancel()
        return phases
    finally:
        await nc.close()
        await probe.close()
        await fleet.close()


def report(phases: list[Phase], args: argparse.Namespace, describe: str) -> None:
    say()
    say(machine_line())
    say(f"nats: {describe}; status every {args.every * 1000:g} ms, each with a "
        f"{ANSWER_WITHIN:g}s timeout; {args.seconds:g}s a phase and {args.after:g}s after; "
        f"{args.machines} honest machine(s)")  # fmt: skip
    say()
    say(f"{'phase':<14} {'flood msg/s':>11} {'asked':>6} {'unanswered':>10} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'p99 ms':>8} {'max ms':>8} {'ctl cores':>9} {'log +B':>8} "
        f"{'fewest up':>9} {'bus p50/p95 ms':>14}")  # fmt: skip
    for p in phases:
        rate = f"{p.sent / p.flood_seconds:,.0f}" if p.flood_seconds else "-"
        say(f"{p.kind:<14} {rate:>11} {p.asked:>6} {len(p.unanswered):>10} "
            f"{p.percentile(0.5):>8.1f} {p.percentile(0.95):>8.1f} {p.percentile(0.99):>8.1f} "
            f"{p.percentile(1.0):>8.1f} {p.cpu:>9.2f} {p.log_growth:>8} "
            f"{p.fewest_up if p.fewest_up is not None else '-':>9} "
            f"{p.percentile(0.5, p.bus):>6.1f}/{p.percentile(0.95, p.bus):<7.1f}")  # fmt: skip
    for p in phases:
        if p.unanswered:
            why = {w: p.unanswered.count(w) for w in sorted(set(p.unanswered))}
            say(f"  {p.kind} unanswered: " + ", ".join(f"{n} {w}" for w, n in why.items()))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of each phase (20)")
    p.add_argument("--after", type=float, default=5.0, help="seconds measured after (5)")
    p.add_argument("--every", type=float, default=0.01, help="seconds between statuses (0.01)")
    p.add_argument("--machines", type=int, default=10, help="honest machines beating (10)")
    p.add_argument("--kinds", default=",".join(KINDS), help="the floods, in order")
    p.add_argument("--tls", action="store_true", help="TLS on the nats-server")
    p.add_argument("--deadline", type=float, default=600, help="seconds for the whole run")
    p.add_argument("--logs", type=Path, help="a folder to copy the run's logs to")
    p.add_argument("--flood", choices=KINDS, help=argparse.SUPPRESS)  # the flooder's mode
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--ca", help=argparse.SUPPRESS)
    return p


async def run(args: argparse.Namespace) -> tuple[list[Phase], str]:
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
        pieces = Pieces(Path(tmp), guard, tls=args.tls)
        try:
            async with asyncio.timeout(args.deadline):
                return await bench(args, pieces), pieces.describe()
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
            await pieces.stop()
            if args.logs:
                shutil.copytree(Path(tmp) / "logs", args.logs, dirs_exist_ok=True)


def main() -> None:
    args = parser().parse_args()
    if args.flood:
        asyncio.run(flood(args.url, args.ca, args.flood, args.seconds))
        return
    args.kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in args.kinds):
        sys.exit(f"--kinds: each of {', '.join(KINDS)}")
    if args.seconds <= 0 or args.after < 0 or args.every <= 0 or args.machines < 0:
        sys.exit("--seconds and --every must be above 0, --after and --machines at least 0")
    phases, describe = run_or_exit(run(args))
    report(phases, args, describe)


if __name__ == "__main__":
    main()
