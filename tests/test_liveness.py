"""Machines go down after missed heartbeats and come back up when they resume; both transitions
are events in the store. The host is really paused (SIGSTOP) and resumed (SIGCONT)."""

import os
import signal
import time

import asyncpg
from helpers import ask, await_until, node_named


async def test_node_up_down_up(nc, start_controller, start_host, database_url) -> None:
    start_controller("ctl-a")
    host = start_host("node-7", "--tier", "1", "--label", "zone=a", beat=0.5)

    async def up():
        n = await node_named(nc, "node-7")
        return n if n and n["up"] else None

    node = await await_until(up, within=20, what="node-7 to register")
    assert node["tier"] == 1
    assert node["labels"] == {"zone": "a"}
    assert node["facts"]["os"] == "linux"
    assert node["facts"]["cpus"] >= 1
    assert node["facts"]["memory"] > 0
    assert node["facts"]["mesh_version"]

    os.kill(host.pid, signal.SIGSTOP)
    paused = time.monotonic()
    try:

        async def down():
            n = await node_named(nc, "node-7")
            return n if n and not n["up"] else None

        await await_until(down, within=10, what="node-7 to be marked down")
        print(f"down after {time.monotonic() - paused:.2f}s (threshold 3 x 0.5s)")
        status = await ask(nc, "mesh.ctl.status")
        assert status["nodes"] == {"total": 1, "up": 0, "down": 1}
    finally:
        os.kill(host.pid, signal.SIGCONT)

    await await_until(up, within=10, what="node-7 to come back up")

    conn = await asyncpg.connect(database_url)
    try:
        kinds = [
            r["kind"]
            for r in await conn.fetch(
                "SELECT kind FROM events WHERE machine = 'node-7' ORDER BY id"
            )
        ]
        stored = await conn.fetchrow("SELECT up, tier FROM machines WHERE name = 'node-7'")
    finally:
        await conn.close()
    assert kinds[0] == "machine.registered"
    # The pause, then the resumption: the last down is followed by an up. A registration may
    # come after it: CI saw [..., down, up, registered] once (why the host registered again
    # after its pause was not found; a registration changes nothing of what this checks).
    assert "machine.down" in kinds, kinds
    last_down = len(kinds) - 1 - kinds[::-1].index("machine.down")
    assert "machine.up" in kinds[last_down:], kinds
    assert stored["up"] is True
    assert stored["tier"] == 1


async def test_a_new_holder_keeps_the_fleet(nc, start_controller, start_host) -> None:
    """The new holder knows the fleet from the store, including a machine that is gone and so
    cannot register again: node-2 is killed and marked down before the takeover."""
    first = start_controller("ctl-a")
    start_host("node-1", "--tier", "0")
    gone = start_host("node-2", "--tier", "2", beat=0.5)

    async def both_up():
        r = await ask(nc, "mesh.ctl.nodes")
        return r if r and sum(n["up"] for n in r["nodes"]) == 2 else None

    await await_until(both_up, within=20, what="two nodes up")
    start_controller("ctl-b")

    async def standby():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["standbys"] else None

    await await_until(standby, within=20, what="a standby")
    os.kill(gone.pid, signal.SIGKILL)

    async def node_2_down():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["nodes"]["down"] == 1 else None

    await await_until(node_2_down, within=10, what="node-2 to be marked down")
    os.kill(first.pid, signal.SIGKILL)

    async def new_holder_knows_both():
        s = await ask(nc, "mesh.ctl.status", timeout=0.5)
        if not s or s["seat"]["holder"] != "ctl-b":
            return None
        return s if s["nodes"] == {"total": 2, "up": 1, "down": 1} else None

    await await_until(new_holder_knows_both, within=10, what="ctl-b to hold, node-2 still down")
    nodes = await ask(nc, "mesh.ctl.nodes")
    assert [(n["name"], n["tier"], n["up"]) for n in nodes["nodes"]] == [
        ("node-1", 0, True),
        ("node-2", 2, False),
    ]
