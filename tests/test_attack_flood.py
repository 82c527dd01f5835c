"""A host flooding its own subjects must not stall the seat's holder (issue 39, item 5).

The attack on `mesh dev up`: node-3, with its own real credentials, published registrations
(each with another pid), beats and reports as fast as it could. The holder's log grew by 137 MB
in 70 s (a line per permissions violation of a reply sent minutes late, a line per message
nats-py dropped), `status` asked by an operator went from 1 ms to seconds, then to nothing, and
nats-server dropped the holder as a slow consumer 13 times.

Here node-2's real credentials flood each kind for FLOOD_FOR seconds from a process of its own
(tests/flooding.py) while the admin asks `status` every STATUS_EVERY: every one is answered within
ANSWER_WITHIN, the holder's log grows by at most LOG_GROWTH, and `mesh nodes --json` names node-2
noisy. docs/security.md's threat table has the row; docs/architecture.md says how (the hosts'
own connection, pending limits, budgets per host before decoding)."""

import json
import logging
import sys
import time
from pathlib import Path

import anyio
import nats
import pytest
from helpers import await_until, ok_json
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from secured import Secured

from mesh import bus
from services.controller import noisy
from services.controller.noisy import Budgets

FLOODER = Path(__file__).parent / "flooding.py"
FLOOD_FOR = 20.0  # seconds of flood, each kind
STATUS_EVERY = 0.1  # seconds between the admin's `status` requests
ANSWER_WITHIN = 3.0  # each `status` is sent once, with this timeout
LOG_GROWTH = 256 * 1024  # bytes the holder's log may grow by, flood and its aftermath
AFTER = 5.0  # seconds after the flood in which `status` must still be answered (a backlog)


class Asked:
    """`status` every STATUS_EVERY, each sent once with ANSWER_WITHIN: what was not answered,
    and how long the answered ones took."""

    def __init__(self) -> None:
        self.sent = 0
        self.unanswered: list[str] = []
        self.took: list[float] = []

    async def run(self, nc: Client, stop: anyio.Event) -> None:
        async def one() -> None:
            sent = time.monotonic()
            try:
                msg = await nc.request("mesh.ctl.status", b"{}", timeout=ANSWER_WITHIN)
            except (NoRespondersError, NatsTimeout) as e:
                self.unanswered.append(f"{type(e).__name__} at +{sent - started:.1f}s")
                return
            reply = json.loads(msg.data)
            if "error" in reply or not reply.get("seat"):
                self.unanswered.append(f"{reply.get('error')} at +{sent - started:.1f}s")
                return
            self.took.append(time.monotonic() - sent)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                self.sent += 1
                tg.start_soon(one)
                await anyio.sleep(STATUS_EVERY)  # ok: the client's sending rate

    def percentile(self, p: float) -> float:
        took = sorted(self.took)
        return took[min(len(took) - 1, int(p * len(took)))] * 1000 if took else float("nan")


async def _flood(secured: Secured, kind: str) -> dict:
    """node-2's credentials, flooding `kind` for FLOOD_FOR seconds from a process of its own."""
    argv = [sys.executable, str(FLOODER), "--url", secured.url, "--name", "node-2",
            "--creds", secured.creds("host", "node-2"), "--kind", kind,
            "--seconds", str(FLOOD_FOR)]  # fmt: skip
    done = await anyio.run_process(argv, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout.decode().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.parametrize("kind", ["registrations", "beats", "events"])
async def test_a_host_flooding_its_subjects_stalls_no_verb_and_is_named_noisy(
    kind: str, secured_fleet: Client, secured: Secured, procs
) -> None:
    """node-2's credentials flood `kind` for 20 s (node-2's own host runs on): the admin's
    `status`, every 100 ms, is answered every time within 3 s, through the flood and 5 s after
    it; the holder's log grows by at most 256 KiB and names node-2 noisy, never node-1 down;
    `mesh nodes --json` shows node-2 noisy (and node-1 not); node-2 is up once it is over."""
    admin = secured_fleet
    log_path: Path = procs.folder / "ctl-a.log"
    log_start = log_path.stat().st_size
    asked = Asked()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(asked.run, admin, stop)
        flooded = await _flood(secured, kind)
        await anyio.sleep(AFTER)  # ok: `status` asked on through the aftermath, not a wait
        stop.set()
    grown = log_path.stat().st_size - log_start
    print(f"{kind}: {flooded['sent']} sent in {FLOOD_FOR:g}s; status {asked.sent} asked, "
          f"{len(asked.unanswered)} unanswered, p50 {asked.percentile(0.5):.1f} ms, "
          f"p95 {asked.percentile(0.95):.1f} ms, max {asked.percentile(1.0):.1f} ms; "
          f"log +{grown} bytes")  # fmt: skip
    assert not asked.unanswered, f"{len(asked.unanswered)} of {asked.sent}: {asked.unanswered[:10]}"
    assert grown <= LOG_GROWTH, f"the holder's log grew by {grown} bytes"

    nodes = {n["name"]: n for n in ok_json(secured.cli(secured.admin, "nodes", "--json"))["nodes"]}
    assert nodes["node-2"]["noisy"] is True, nodes["node-2"]
    assert nodes["node-1"]["noisy"] is False, nodes["node-1"]
    said = log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "machine node-2 is noisy" in said, said[-2000:]
    # Another host's beats still reached the holder: a flood must not make its neighbours down.
    assert "machine node-1 is down" not in said, said[-2000:]

    async def beating_again() -> dict | None:
        reply = await admin.request("mesh.ctl.nodes", b"{}", timeout=ANSWER_WITHIN)
        node = next(n for n in json.loads(reply.data)["nodes"] if n["name"] == "node-2")
        return node if node["up"] else None

    await await_until(beating_again, within=30, what="node-2 up after the flood")


# --- the pieces: budgets on a clock the test moves, and a check as nats-py parses --------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_beats_past_a_machines_budget_are_dropped_and_it_is_noisy_for_a_minute(caplog) -> None:
    clock = Clock()
    budgets = Budgets(clock=clock)
    beats = budgets.admits("beats")
    taken = [beats("mesh.host.node-2.beat", b"{}") for _ in range(1000)]
    assert taken.count(True) == noisy.BEAT_BURST
    assert beats("mesh.host.node-1.beat", b"{}")  # each machine its own
    assert beats("mesh.nothing", b"{}")  # a stray is the subscription's to refuse (origin.py)
    clock.now += noisy.BEAT_EVERY * 1.01  # (floats: a hair past the interval)
    assert beats("mesh.host.node-2.beat", b"{}")  # 25 a second again
    assert budgets.noisy("node-2") and not budgets.noisy("node-1")
    with caplog.at_level(logging.WARNING, logger="mesh.controller"):
        budgets.say()  # not a whole window yet
        clock.now += noisy.SAY_EVERY
        budgets.say()
        budgets.say()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "machine node-2 is noisy: dropped 950 beats" in lines[0], lines
    clock.now += noisy.NOISY_FOR
    assert not budgets.noisy("node-2")


def test_requests_are_bounded_in_flight_not_by_rate() -> None:
    clock = Clock()
    budgets = Budgets(clock=clock)
    asks = budgets.admits("requests")
    subject = "mesh.ctl.host.node-2.register"
    # A caller that waits for its answers is never held back, however many it asks...
    for _ in range(10 * noisy.REQUESTS_IN_FLIGHT):
        assert asks(subject, b"{}")
        budgets.answered("node-2")
    # ...one that does not has REQUESTS_IN_FLIGHT, and one more as each is answered.
    assert [asks(subject, b"{}") for _ in range(100)].count(True) == noisy.REQUESTS_IN_FLIGHT
    budgets.answered("node-2")
    assert asks(subject, b"{}") and not asks(subject, b"{}")
    clock.now += noisy.ASKING_BACK  # one never answered (a stray, dropped) stops counting
    assert asks(subject, b"{}") and not asks(subject, b"{}")


def test_reports_past_the_budget_keep_the_newest_of_each_kind_in_order() -> None:
    clock = Clock()
    budgets = Budgets(clock=clock)
    reports = budgets.admits("reports")
    taken = [reports(f"mesh.event.node-2.{k}", b"old") for k in ["applied"] * noisy.REPORT_BURST]
    assert all(taken)
    assert not reports("mesh.event.node-2.applied", b"a1")
    assert not reports("mesh.event.node-2.processes", b"p1")
    assert not reports("mesh.event.node-2.applied", b"a2")  # newer: it goes after p1
    assert not reports("mesh.event.node-2.whatever", b"?")  # not a report's kind: not kept
    assert budgets.due() == []  # no turn yet
    clock.now += noisy.REPORT_EVERY * 1.01  # (floats: a hair past the interval)
    # One turn: the oldest kept first; while some are kept, what comes joins them.
    assert budgets.due() == [("mesh.event.node-2.processes", b"p1")]
    assert not reports("mesh.event.node-2.processes", b"p2")
    clock.now += 2.01 * noisy.REPORT_EVERY
    assert budgets.due() == [
        ("mesh.event.node-2.applied", b"a2"), ("mesh.event.node-2.processes", b"p2"),
    ]  # fmt: skip
    clock.now += 1.01 * noisy.REPORT_EVERY
    assert reports("mesh.event.node-2.applied", b"a3")  # none kept: taken at once again


async def test_admit_drops_what_it_refuses_as_nats_py_parses_it(nats_url: str) -> None:
    """mesh.bus.admit on a real connection: what the check refuses never reaches the
    subscription (nor its queue), yet counts as received; a check that raises lets it in."""
    nc = await bus.connect(nats_url, name="admitting", reconnect=False)
    other = await nats.connect(nats_url)
    got: list[bytes] = []

    async def cb(msg: Msg) -> None:
        got.append(msg.data)

    def admits(subject: str, body: bytes) -> bool:
        if body == b"raise":
            raise ValueError(body)
        return subject == "t.in"

    try:
        sub = await nc.subscribe("t.*", cb=cb)
        bus.admit(sub, admits)
        await nc.flush()
        for subject, body in [("t.out", b"1"), ("t.in", b"2"), ("t.out", b"3"),
                              ("t.x", b"raise"), ("t.in", b"4")]:  # fmt: skip
            await other.publish(subject, body)
        await other.flush()

        async def all_in() -> bool:
            return nc.stats["in_msgs"] >= 5 and len(got) >= 3

        await await_until(all_in, within=10, what="the messages received")
        assert got == [b"2", b"raise", b"4"]
        assert nc.stats["in_msgs"] == 5
        assert sub.pending_msgs == 0 and sub.delivered == 3
    finally:
        await other.close()
        await nc.close()
