"""The planned handover (docs/design.md): with a client sending `status` continuously, `mesh
handover` and SIGTERM to the holder move the seat with zero failed and zero timed-out requests.
Real controllers, NATS and PostgreSQL; each request is sent once, never retried."""

import json
import signal
import time
from datetime import UTC, datetime

import anyio
import msgspec
import pytest
from helpers import already, ask, await_until, held_status, mesh_cli
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import subjects, wire
from mesh.model import SeatAnnounce


def _clock() -> str:
    """Now, as the controllers' logs say it (to the ms): to find a failure in them."""
    return datetime.now().strftime("%H:%M:%S.%f")[:-3]


class StatusClient:
    """Workers sending `status`, each request once with a 2 s timeout."""

    def __init__(self) -> None:
        self.sent = 0
        self.failures: list[str] = []
        self.worst = 0.0
        self.holders: list[str] = []
        self.phase = ""  # what the test was doing, said with each failure
        self.moves: list[str] = []  # when each holder's first answer came

    async def run(self, nc: Client, stop: anyio.Event, workers: int = 4) -> None:
        async def worker() -> None:
            while not stop.is_set():
                started, sent_at = time.monotonic(), _clock()
                self.sent += 1
                try:
                    msg = await nc.request("mesh.ctl.status", b"{}", timeout=2)
                except NoRespondersError:
                    self.failures.append(f"no responders, sent at {sent_at} {self.phase}")
                    continue
                except NatsTimeout:
                    self.failures.append(f"timeout, sent at {sent_at} {self.phase}")
                    continue
                self.worst = max(self.worst, time.monotonic() - started)
                reply = json.loads(msg.data)
                if "error" in reply:
                    self.failures.append(str(reply["error"]))
                elif not self.holders or self.holders[-1] != reply["seat"]["holder"]:
                    self.holders.append(reply["seat"]["holder"])
                    self.moves.append(f"{reply['seat']['holder']} answered from {_clock()}")

        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(worker)


@pytest.fixture
async def two(start_fleet):
    """ctl-a holding the seat, ctl-b standing by: their processes."""
    fleet = await start_fleet(hosts=0, controllers=("ctl-a", "ctl-b"))
    return fleet.controllers["ctl-a"], fleet.controllers["ctl-b"]


async def test_handover_and_sigterm_leave_no_request_unanswered(two, nc, nats_url) -> None:
    a, b = two
    client = StatusClient()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.run, nc, stop)
        await await_until(lambda: already(client.sent > 50), within=10, what="requests flowing")

        # 1. `mesh handover`: ctl-b takes the seat; ctl-a stands by again.
        client.phase = "during `mesh handover`"
        # In a thread: the client's workers must keep sending while the command runs.
        done = await anyio.to_thread.run_sync(lambda: mesh_cli("handover", nats_url=nats_url))
        assert done.returncode == 0, done.stderr
        assert "ctl-a handed the seat to ctl-b (epoch" in done.stdout, done.stdout

        async def moved_to(holder: str, epoch_above: int):
            s = await ask(nc, "mesh.ctl.status")
            ok = s and s["seat"]["holder"] == holder and s["seat"]["epoch"] > epoch_above
            return s if ok else None

        s = await await_until(lambda: moved_to("ctl-b", 1), within=15, what="ctl-b holds")
        assert s["handover"]["from"] == "ctl-a" and s["handover"]["to"] == "ctl-b"
        assert s["handover"]["planned"] is True and s["handover"]["gap_ms"] is not None

        async def a_stands_by():
            s = await ask(nc, "mesh.ctl.status")
            return s if s and [x["instance"] for x in s["standbys"]] == ["ctl-a"] else None

        await await_until(a_stands_by, within=15, what="ctl-a standing by again")
        client.phase = "with ctl-a standing by again"
        sent_before = client.sent

        # 2. SIGTERM to the holder: it hands over to ctl-a and exits 0.
        client.phase = "after SIGTERM to ctl-b"
        b.send_signal(signal.SIGTERM)
        s = await await_until(lambda: moved_to("ctl-a", s["seat"]["epoch"]), within=15,
                              what="ctl-a holds again")  # fmt: skip
        assert s["handover"]["planned"] is True
        assert await anyio.to_thread.run_sync(lambda: b.wait(timeout=30)) == 0
        await await_until(lambda: already(client.sent > sent_before + 50), within=10,
                          what="requests after the second handover")  # fmt: skip
        stop.set()
    logs = [proc.log_path.read_text()[-2000:] for proc in (a, b)]
    assert client.failures == [], (client.failures[:5], client.moves, logs)
    assert client.holders == ["ctl-a", "ctl-b", "ctl-a"]
    assert a.poll() is None  # still serving


async def test_a_standby_stopped_while_in_the_verb_group_passes_on_what_it_holds(two, nc) -> None:
    """A handover announced but never finished (its holder kept the seat, as one that died
    between the two would leave it): the standby has joined the verb group and holds every
    request it gets until the seat comes (at most EARLY_FOR, 15 s). SIGTERM to it then must not
    take them with it: it passes them on to the holder as it leaves."""
    a, b = two
    ready = await nc.subscribe(subjects.seat("ready"))
    announce = SeatAnnounce(instance="ctl-test", pid=0, host="test", since=datetime.now(UTC))
    await nc.publish(subjects.seat("handover"), wire.encode(announce))
    said = msgspec.json.decode((await ready.next_msg(timeout=10)).data, type=SeatAnnounce)
    assert said.instance == "ctl-b"  # in the group now: about half the requests are its
    await ready.unsubscribe()

    answers: list[str] = []

    async def one() -> None:
        try:  # well within EARLY_FOR: a request b holds is answered only if b passes it on
            msg = await nc.request("mesh.ctl.status", b"{}", timeout=10)
        except (NoRespondersError, NatsTimeout) as e:
            answers.append(type(e).__name__)
            return
        reply = json.loads(msg.data)
        answers.append(str(reply["error"]) if "error" in reply else reply["seat"]["holder"])

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one)
        await anyio.lowlevel.checkpoint()
        await nc.flush()  # all 20 are with the server, and so with ctl-a or ctl-b
        b.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: b.wait(timeout=30)) == 0
    assert answers == ["ctl-a"] * 20, answers
    assert a.poll() is None
    left = [line for line in b.log_path.read_text().splitlines() if "left the verb group" in line]
    assert len(left) == 1 and " 0 request(s)" not in left[0], left  # it held some, and sent them


async def test_handover_without_a_standby_is_refused(nc, start_controller, nats_url) -> None:
    start_controller("ctl-a")
    await await_until(lambda: held_status(nc), within=30, what="ctl-a to hold the seat")
    done = mesh_cli("handover", nats_url=nats_url)
    assert done.returncode == 1
    assert "no standby" in done.stderr and "Traceback" not in done.stderr
    s = await ask(nc, "mesh.ctl.status")
    assert s["seat"]["holder"] == "ctl-a"


async def test_a_handover_no_standby_takes_says_so(nc, start_controller, nats_url) -> None:
    """A standby that is heard but never answers the handover (announced here, as one cut off
    from answering would be): the holder lets go of the seat for it, none takes it, and the
    holder takes it again. The command says so and exits 1, rather than that the seat was
    handed over."""
    start_controller("ctl-a")
    before = await await_until(lambda: held_status(nc), within=30, what="ctl-a to hold the seat")
    ghost = SeatAnnounce(instance="ctl-ghost", pid=0, host="test", since=datetime.now(UTC))
    done = anyio.Event()

    async def announce() -> None:
        while not done.is_set():
            await nc.publish(subjects.seat("standby"), wire.encode(ghost))
            with anyio.move_on_after(0.5):  # ok: the announcements' own rhythm
                await done.wait()

    async def listed():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and [x["instance"] for x in s["standbys"]] == ["ctl-ghost"] else None

    async with anyio.create_task_group() as tg:
        tg.start_soon(announce)
        await await_until(listed, within=15, what="ctl-ghost listed as a standby")
        handed = await anyio.to_thread.run_sync(lambda: mesh_cli("handover", nats_url=nats_url))
        done.set()
    assert handed.returncode == 1, handed.stdout
    line = handed.stderr.strip()
    assert "Traceback" not in line and len(line.splitlines()) == 1, line
    again = before["seat"]["epoch"] + 1
    assert f"no standby took the seat: ctl-a let it go and took it again (epoch {again})" in line
    s = await ask(nc, "mesh.ctl.status")
    assert s["seat"]["holder"] == "ctl-a" and s["seat"]["epoch"] == again
