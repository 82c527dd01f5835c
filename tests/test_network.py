"""Machines with their own network (issue 13, items 3 and 4): every nats-server (three, one
TLS cluster), PostgreSQL, every controller and every host in a network namespace of its own,
joined by a switch in another (tests/netns.py); the test's own clients sit in a "client"
namespace. Only the switch's addresses carry mesh traffic: no loopback, and nothing touches
the host's network.

PostgreSQL runs in its own namespace too, listening on its switch address (pg_hba lets the
switch's subnet in), so cutting a controller's link cuts its store session as a real machine's
would, and blocking only the NATS servers' addresses inside a namespace leaves its store.

Faults: SIGKILL of the nats-server the holder is connected to (found by the holder's
namespace's established connections), a host's link cut at the switch for longer than its
down-detection, the holder's namespace cut off from NATS only, and clients that do not trust
the mesh's CA or do not speak TLS. Real processes, no mocks; every wait polls with a deadline.

Root only (network namespaces): skipped otherwise, or where `ip netns add` is refused.
"""

import json
import os
import socket
import ssl
import time

import anyio
import nats
import pytest
from faults import (
    Verbs,
    assert_kv_epochs_rise,
    assert_one_epoch_at_a_time,
    finished,
    install_audit,
    query,
    steps,
    waiting_in,
)
from helpers import (
    ask,
    assert_tier_order,
    await_until,
    exited,
    held_status,
    kv_read,
    node_named,
    ok_json,
)
from module_folders import gated_module
from netmesh import CLIENT_PORT, CONTROLLERS, HOSTS, NATS, started

from mesh import bus
from mesh.auth import tls

pytestmark = pytest.mark.slow

# A holder cut off from NATS by a silent link: its own round trips (every 0.25 s) find 1 s of
# silence, then it steps down (docs/architecture.md, the seat): about 1.5 s here. The bound
# leaves room for a loaded CI machine; nats-py's own pings alone took 46 s over TLS.
STEP_DOWN_PROMISED = 20.0
STEP_DOWN_AT_MOST = 90.0  # how long the test waits for the exit at all


async def kv_value(nc, key: str) -> bytes:
    """A key's value, asked again while JetStream re-elects after the servers' restarts."""

    async def read(kv) -> bytes:
        return (await kv.get(key)).value

    return await kv_read(nc, "mesh-declarations", read, what=f"{key} in mesh-declarations")


async def assert_declarations_newest(nc, plan: dict) -> None:
    """Every host's key is in the bucket, with the plan's declaration and the newest epoch."""
    # Asked until answered: one status of 1 s went unanswered once on a loaded CI machine
    # just after the plan ended; what this checks is the bucket, not how fast status is.
    taken = await await_until(lambda: held_status(nc), within=30, what="status to answer")
    for step in plan["steps"]:
        entry = json.loads(await kv_value(nc, step["machine"]))
        assert entry["digest"] == step["after"], (step, entry)
        assert entry["epoch"] == taken["seat"]["epoch"], (step["machine"], entry["epoch"])
    await assert_kv_epochs_rise(nc)


# --- a: nats-servers killed under the holder ------------------------------------------------------


async def test_the_nats_server_of_the_holder_killed_during_a_plan(netmesh, tmp_path) -> None:
    """Tier 1 waits: SIGKILL the nats-server the holder is connected to, start it again (its
    JetStream catches up). Tier 2 waits: the same with the holder's server then. A status client
    runs throughout: every request is answered within its deadline; the plan finishes and
    every declaration is in the bucket under the newest epoch."""
    m = netmesh
    nc = await started(m)
    try:
        await install_audit(m.database_url)
        roots = tmp_path / "hosts"
        source = gated_module(tmp_path / "m", marker="ready", deadline="90s")
        plan_id = ok_json(m.cli("push", str(source), "--json"))["plan"]
        verbs, stop = Verbs(), anyio.Event()
        killed = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(verbs.run, nc, stop)
            for waiting, ready in (("node-2", "node-1"), ("node-3", "node-2")):
                (roots / ready / "ready").write_text("")
                await waiting_in(nc, plan_id, waiting)
                s = await held_status(nc)
                assert s is not None
                server = m.holder_server(s["seat"]["holder"])
                m.kill_nats(server)
                killed.append((s["seat"]["holder"], server))

                async def moved(holder=s["seat"]["holder"], server=server):
                    """The holder is on another server (and still holds)."""
                    now = await held_status(nc)
                    if now is None or now["seat"]["holder"] != holder:
                        return None
                    found = m.net.peers(holder, CLIENT_PORT)
                    return now if found and m.net.address(server) not in found else None

                await await_until(moved, within=30, what="the holder on another server")
                m.run_nats(server)
                await m.nats_healthy(server)
            (roots / "node-3" / "ready").write_text("")
            plan = await finished(nc, plan_id, within=90)
            await verbs.answers_after("answers after the plan")
            stop.set()

        print(f"killed {killed}; {verbs.answered} status answered, the slowest in "
              f"{verbs.worst:.2f}s")  # fmt: skip
        assert verbs.failures == [], verbs.failures[:5]
        # A host's `applied` report lost with the dying server is said again (the host on its
        # reconnect, or when the holder says `held` again after its own): no step waits out
        # its deadline for it.
        assert plan["state"] == "done", plan
        assert steps(plan) == {h: "done" for h in HOSTS}
        assert_tier_order(plan)
        await assert_one_epoch_at_a_time(m.database_url)
        await assert_declarations_newest(nc, plan)
    finally:
        await nc.close()


# --- b: a host's link cut ---------------------------------------------------------------------


async def test_a_host_cut_off_is_down_skipped_and_comes_back_unrestarted(netmesh, tmp_path) -> None:
    """node-2's link is cut while tier 0 waits, for longer than its down-detection: it shows
    down, and with `skip_down` its step is skipped and tier 2 goes on. Restored, node-2 is up
    again, applies the newest declaration, and neither its host agent nor the process it ran
    before was restarted."""
    m = netmesh
    nc = await started(m)
    try:
        roots = tmp_path / "hosts"
        ok_json(
            m.cli("push", str(gated_module(tmp_path / "keep", name="keep")), "--wait", "--json")
        )
        before = await ask(nc, "mesh.host.node-2.status")
        pids = {p["name"]: p["pid"] for p in before["processes"]}
        assert pids.get("keep"), before
        agent = m.hosts["node-2"].pid

        (roots / "node-3" / "ready").write_text("")
        source = gated_module(tmp_path / "gated", marker="ready", deadline="60s",
                              extra="skip_down = true\n")  # fmt: skip
        plan_id = ok_json(m.cli("push", str(source), "--json"))["plan"]
        await waiting_in(nc, plan_id, "node-1")
        m.net.cut("node-2")
        cut = time.monotonic()
        try:

            async def down():
                node = await node_named(nc, "node-2", timeout=1)
                return node is not None and node["up"] is False

            await await_until(down, within=30, what="node-2 down")
            print(f"node-2 down {time.monotonic() - cut:.1f}s after its link was cut")
            (roots / "node-1" / "ready").write_text("")
            plan = await finished(nc, plan_id, within=90)
            assert steps(plan) == {"node-1": "done", "node-2": "skipped", "node-3": "done"}, plan
            assert plan["state"] == "done", plan
        finally:
            m.net.restore("node-2")
        restored = time.monotonic()
        after = next(s["after"] for s in plan["steps"] if s["machine"] == "node-2")

        async def back():
            node = await node_named(nc, "node-2", timeout=1)
            return node if node and node["up"] and node["digest_applied"] == after else None

        await await_until(back, within=60, what="node-2 up with the newest declaration")
        print(f"node-2 up and applied {time.monotonic() - restored:.1f}s after its link came back")
        host = await ask(nc, "mesh.host.node-2.status")
        assert host["applied"] == after
        now = {p["name"]: p["pid"] for p in host["processes"]}
        assert now["keep"] == pids["keep"], (pids, now)
        assert "gated" in now, now
        assert m.hosts["node-2"].poll() is None and m.hosts["node-2"].pid == agent
        await assert_declarations_newest(nc, plan)
    finally:
        await nc.close()


# --- c: the holder cut off from NATS only -----------------------------------------------------


async def test_the_holder_cut_off_from_nats_only_steps_down(netmesh, tmp_path) -> None:
    """Tier 1 waits: the holder's namespace loses its routes to every nats-server but keeps
    PostgreSQL. It gives up the seat within its bound (the client's ping detection plus the 3 s
    grace), the standby takes it and finishes the plan, and no two epochs wrote at once."""
    m = netmesh
    nc = await started(m)
    try:
        await install_audit(m.database_url)
        roots = tmp_path / "hosts"
        source = gated_module(tmp_path / "m", marker="ready", deadline="90s")
        plan_id = ok_json(m.cli("push", str(source), "--json"))["plan"]
        (roots / "node-1" / "ready").write_text("")
        await waiting_in(nc, plan_id, "node-2")
        before = await held_status(nc)
        assert before is not None
        holder = before["seat"]["holder"]
        standby = next(c for c in CONTROLLERS if c != holder)
        servers = [m.net.address(n) for n in NATS]
        m.net.block(holder, servers)
        blocked = time.monotonic()
        try:
            code = await await_until(lambda: exited(m.controllers[holder]), within=120,
                                     what=f"{holder} to step down")  # fmt: skip
            gave_up = time.monotonic() - blocked

            async def taken():
                s = await held_status(nc)
                return s if s and s["seat"]["holder"] == standby else None

            after = await await_until(taken, within=30, what=f"{standby} to take the seat")
            took = time.monotonic() - blocked
        finally:
            m.net.unblock(holder, servers)
        print(f"{holder} gave up the seat {gave_up:.1f}s after losing NATS; {standby} held it "
              f"{took:.1f}s after")  # fmt: skip
        log = m.controllers[holder].log_path.read_text()
        assert code == (1,), log[-3000:]
        assert "lost NATS for more than" in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        assert gave_up < STEP_DOWN_AT_MOST, gave_up
        assert after["seat"]["epoch"] > before["seat"]["epoch"]

        (roots / "node-2" / "ready").write_text("")
        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id, within=90)
        assert plan["state"] == "done", plan
        assert steps(plan) == {h: "done" for h in HOSTS}
        assert_tier_order(plan)
        wrote = await assert_one_epoch_at_a_time(m.database_url)
        assert after["seat"]["epoch"] in wrote, wrote
        seat = "SELECT kind, epoch FROM events WHERE kind LIKE 'seat.%' ORDER BY id"
        print([tuple(r) for r in await query(m.database_url, seat)])
        await assert_declarations_newest(nc, plan)
    finally:
        await nc.close()
    assert gave_up <= STEP_DOWN_PROMISED, f"{holder} gave up the seat only after {gave_up:.1f}s"


# --- d: clients the servers refuse ------------------------------------------------------------


async def test_clients_without_the_mesh_ca_or_tls_cannot_connect(netmesh, tmp_path) -> None:
    m = netmesh
    await m.start_nats()
    for name in NATS:
        address = m.net.address(name)
        url = f"tls://{address}:{CLIENT_PORT}"

        # The mesh's CA: connects (the control).
        nc = await bus.connect(url, name="test", ca=m.ca, reconnect=False)
        await nc.close()

        # No CA: the mesh's client refuses to try; nats-py with the system's CAs fails the
        # server's certificate.
        os.environ.pop("MESH_CA", None)
        try:
            with pytest.raises(bus.Unreachable, match="CA is not known"):
                await bus.connect(url, name="test", reconnect=False)
        finally:
            os.environ["MESH_CA"] = m.ca
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(url, tls=ssl.create_default_context(), allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=3)  # fmt: skip

        # Another CA: the server's certificate is not one of its.
        other = tls.ensure_ca(tmp_path / "other-ca")
        with pytest.raises(bus.Unreachable, match="certificate verify failed"):
            await bus.connect(url, name="test", ca=str(other), reconnect=False)

        # Plaintext: nats-py without a TLS context gives up; a raw CONNECT gets no PONG, an
        # error naming TLS, and the connection closed.
        with pytest.raises(Exception, match=r"ssl|tls|TLS"):
            await nats.connect(f"nats://{address}:{CLIENT_PORT}", allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=3)  # fmt: skip
        said = await anyio.to_thread.run_sync(_plaintext, address)
        assert b"PONG" not in said, said
        assert b"TLS Required" in said or said.startswith(b"INFO"), said


def _plaintext(address: str) -> bytes:
    """What a nats-server says to a plaintext CONNECT + PING, up to its closing the socket."""
    said = b""
    with socket.create_connection((address, CLIENT_PORT), timeout=5) as s:
        said += s.recv(65536)  # INFO
        assert b'"tls_required":true' in said, said
        s.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            said += chunk
        else:
            raise AssertionError(f"the server kept a plaintext client open: {said!r}")
    return said
