"""The holder cut off while its process lives (issue 29), on the network-namespace mesh of
tests/test_network.py: from NATS only (routes to every nats-server refused inside its
namespace), from the store only (the route to PostgreSQL refused), or from both (its link down
at the switch). A client runs the real command line, `mesh --json status` with its defaults,
every STATUS_EVERY seconds throughout; what each invocation got, and when, is kept.

Shared by tests/test_cut_holder.py (one cut of each kind, every request answered) and
bench/cut.py (ten of each, the gap's median and max).
"""

import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import msgspec
from helpers import MESH, await_until, exited, held_status, standing_by
from nats.aio.client import Client
from netmesh import NATS

Kind = Literal["nats", "store", "both"]
KINDS: tuple[Kind, ...] = ("nats", "store", "both")
STATUS_EVERY = 0.5  # how often the client starts a `mesh --json status`
# At most this many at once: a command line that a loaded machine starts late is not started
# again and again on top of it (each start is a Python process's worth of CPU); one not
# started is counted (`Cut.skipped`), never taken for a lost request.
IN_FLIGHT = 12
AFTER = 5.0  # how long the client goes on once the new holder has answered
PROBE_EVERY = 0.1  # the bus probe's pace: the gap to a tenth of a second
PROBE_WAIT = 1.0


class Answer(msgspec.Struct):
    sent: float  # monotonic, when the command started
    done: float  # when it exited
    code: int
    holder: str | None
    epoch: int | None
    said: str  # its stderr's last line, for a failure


class Cut(msgspec.Struct):
    kind: Kind
    holder: str
    standby: str
    epoch_before: int
    at: float  # monotonic, the cut
    answers: list[Answer] = []  # the command line's
    probes: list[Answer] = []  # the bus probe's: status every PROBE_EVERY, each asked once
    skipped: int = 0  # command lines not started, IN_FLIGHT running already
    baseline: float = 0.0  # a command line's own time before the cut (median of 3): its start
    running: int = 0

    def unanswered(self) -> list[Answer]:
        return [a for a in self.answers if a.code != 0 or a.holder is None]

    def first_by_new(self, *, probes: bool = False) -> Answer | None:
        got = sorted(self.probes if probes else self.answers, key=lambda a: a.done)
        new = (a for a in got if a.holder == self.standby and (a.epoch or 0) > self.epoch_before)
        return next(new, None)

    def gap(self, *, probes: bool = False) -> float | None:
        """From the cut to the first answer by the new holder: as the bus probe got it, or
        as a command line got it (which adds its own start, about half a second here)."""
        first = self.first_by_new(probes=probes)
        return first.done - self.at if first else None


def fault(m, kind: Kind, member: str, *, on: bool) -> None:
    """Cut `member` off (`on`) or restore it."""
    targets = {"nats": [m.net.address(n) for n in NATS], "store": [m.net.address("pg")]}
    if kind == "both":
        (m.net.cut if on else m.net.restore)(member)
    elif on:
        m.net.block(member, targets[kind])
    else:
        m.net.unblock(member, targets[kind])


async def _status(m, cut: Cut) -> None:
    """One `mesh --json status` from the client's namespace, with the command line's defaults."""
    argv = m.net.argv("client", [*MESH, "--json", "status"])
    sent = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "MESH_CREDS"}
    cut.running += 1
    try:
        done = await anyio.run_process(argv, check=False, env={**env, **m.env()})
    finally:
        cut.running -= 1
    holder = epoch = None
    if done.returncode == 0:
        try:
            seat = json.loads(done.stdout)["seat"]
            holder, epoch = seat["holder"], seat["epoch"]
        except (ValueError, KeyError, TypeError):
            pass
    said = done.stderr.decode(errors="replace").strip().splitlines()
    last = said[-1] if said else ""
    cut.answers.append(Answer(sent=sent, done=time.monotonic(), code=done.returncode,
                              holder=holder, epoch=epoch, said=last))  # fmt: skip


async def _probe(nc: Client, cut: Cut) -> None:
    sent = time.monotonic()
    holder = epoch = None
    try:
        msg = await nc.request("mesh.ctl.status", b"{}", timeout=PROBE_WAIT)
        seat = json.loads(msg.data).get("seat") or {}
        holder, epoch = seat.get("holder"), seat.get("epoch")
    except Exception:  # unanswered: what the probe counts is the first answer
        pass
    cut.probes.append(Answer(sent=sent, done=time.monotonic(), code=0 if holder else 1,
                             holder=holder, epoch=epoch, said=""))  # fmt: skip


async def _probing(nc: Client, cut: Cut, stop: anyio.Event) -> None:
    async with anyio.create_task_group() as tg:
        while not stop.is_set():
            tg.start_soon(_probe, nc, cut)
            await anyio.sleep(PROBE_EVERY)  # ok: the probe's pace


async def cut_once(m, nc: Client, kind: Kind, *, within: float = 60) -> Cut:
    """Cut the holder off (`kind`) with the status client running; once the standby holds a
    higher epoch and has answered for AFTER seconds, stop the client (every invocation
    finished) and restore the link. The old holder steps down and exits meanwhile."""
    before = await await_until(lambda: held_status(nc, timeout=2), within=30, what="a holder")
    holder = before["seat"]["holder"]
    standby = next(b["instance"] for b in before["standbys"])
    cut = Cut(kind=kind, holder=holder, standby=standby,
              epoch_before=before["seat"]["epoch"], at=0.0)  # fmt: skip
    before_cut = Cut(kind=kind, holder=holder, standby=standby, epoch_before=0, at=0.0)
    for _ in range(3):
        await _status(m, before_cut)
    cut.baseline = statistics.median(a.done - a.sent for a in before_cut.answers)
    fault(m, kind, holder, on=True)
    cut.at = time.monotonic()

    def done() -> bool:
        first = cut.first_by_new()
        return first is not None and time.monotonic() > first.done + AFTER

    await asking(m, nc, cut, until=done, within=within)
    fault(m, kind, holder, on=False)
    return cut


async def asking(m, nc: Client, cut: Cut, *, until, within: float) -> None:
    """The status client (and the bus probe) from now until `until()` or `within` seconds, and
    until every command line it started has ended (each within its --timeout, 5 s)."""
    stop, started = anyio.Event(), time.monotonic()
    async with anyio.create_task_group() as client:
        client.start_soon(_probing, nc, cut, stop)
        while not until() and time.monotonic() < started + within:
            if cut.running < IN_FLIGHT:
                client.start_soon(_status, m, cut)
            else:
                cut.skipped += 1
            await anyio.sleep(STATUS_EVERY)  # ok: the client's pace, not a synchronisation
        stop.set()


async def others_cut(
    m, nc: Client, member: str, *, seconds: float, kind: Kind = "both",
    then: Callable[[], Awaitable[object]] | None = None,
) -> Cut:  # fmt: skip
    """Cut `member` (a standby or a host) off (`kind`) for `seconds` with the status client
    running, and `then()` at once if given."""
    before = await await_until(lambda: held_status(nc, timeout=2), within=30, what="a holder")
    holder = before["seat"]["holder"]
    cut = Cut(kind=kind, holder=holder, standby=holder, epoch_before=before["seat"]["epoch"],
              at=time.monotonic())  # fmt: skip
    fault(m, kind, member, on=True)
    try:
        async with anyio.create_task_group() as tg:
            if then is not None:
                tg.start_soon(then)
            await asking(m, nc, cut, until=lambda: False, within=seconds)
    finally:
        fault(m, kind, member, on=False)
    return cut


async def stand_by_again(m, nc: Client, instance: str) -> None:
    """The cut holder has stepped down and exited: start it again and wait until it stands by."""
    proc = m.controllers[instance]
    await await_until(lambda: exited(proc), within=60, what=f"{instance} to step down and exit")
    m.start_controller(instance)
    await await_until(lambda: standing_by(nc, instance), within=60,
                      what=f"{instance} standing by again")  # fmt: skip


def _seconds(gap: float | None) -> str:
    return "none" if gap is None else f"{gap:.2f}s"


def summary(cut: Cut) -> str:
    busy = f", {cut.skipped} not started (machine too busy)" if cut.skipped else ""
    return (f"{cut.kind}: {cut.holder} -> {cut.standby}, gap {_seconds(cut.gap(probes=True))} "
            f"(bus probe), {_seconds(cut.gap())} (command line); {len(cut.answers)} status, "
            f"{len(cut.unanswered())} unanswered{busy}; a command line took {cut.baseline:.2f}s "
            "before the cut")  # fmt: skip
