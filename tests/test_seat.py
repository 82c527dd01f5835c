"""The seat: two controllers, exactly one holder; kill it and the standby takes over with a
higher epoch (docs/design.md, the seat: one holder, crash takeover)."""

import os
import signal
import time

import asyncpg
import nats as nats_client
from helpers import ask, await_until, exited, held_status

from services.controller.seat.lock import SEAT_LOCK


async def _lock_holders(database_url: str) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND ((classid::bigint << 32) | objid::bigint) = $1",
            SEAT_LOCK,
        )
    finally:
        await conn.close()


async def test_two_controllers_one_holder_and_kill_moves_the_seat(
    nc, start_controller, database_url
) -> None:
    first = start_controller("ctl-a")
    status = await await_until(lambda: held_status(nc, timeout=0.5), within=20, what="a holder")
    assert status["seat"]["holder"] == "ctl-a"
    second = start_controller("ctl-b")

    async def standby_listed():
        s = await held_status(nc, timeout=0.5)
        return s if s and [b["instance"] for b in s["standbys"]] == ["ctl-b"] else None

    status = await await_until(standby_listed, within=20, what="ctl-b to stand by")
    epoch = status["seat"]["epoch"]
    assert epoch >= 1
    assert status["seat"]["pid"] == first.pid
    assert await _lock_holders(database_url) == 1

    # Every answer in a burst comes from the one holder: the standby never answers.
    holders = {(await ask(nc, "mesh.ctl.status"))["seat"]["holder"] for _ in range(50)}
    assert holders == {"ctl-a"}

    os.kill(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()

    async def taken_over():
        s = await held_status(nc, timeout=0.5)
        return s if s and s["seat"]["holder"] == "ctl-b" else None

    status = await await_until(taken_over, within=10, what="ctl-b to take the seat")
    print(f"takeover after SIGKILL answered in {time.monotonic() - killed_at:.2f}s")
    assert status["seat"]["epoch"] > epoch
    assert status["seat"]["pid"] == second.pid
    assert await _lock_holders(database_url) == 1

    conn = await asyncpg.connect(database_url)
    try:
        taken = await conn.fetch(
            "SELECT epoch, detail->>'holder' AS holder FROM events"
            " WHERE kind = 'seat.taken' ORDER BY id"
        )
    finally:
        await conn.close()
    assert [(r["holder"], r["epoch"]) for r in taken] == [
        ("ctl-a", epoch),
        ("ctl-b", status["seat"]["epoch"]),
    ]


async def test_sigterm_releases_the_seat_to_the_standby(nc, start_controller) -> None:
    first = start_controller("ctl-a")
    await await_until(lambda: held_status(nc, timeout=0.5), within=20, what="a holder")
    start_controller("ctl-b")

    async def has_standby():
        s = await held_status(nc, timeout=0.5)
        return s if s and s["standbys"] else None

    before = await await_until(has_standby, within=20, what="a standby")
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=15) == 0  # a clean stop, not a crash

    async def taken_over():
        s = await held_status(nc, timeout=0.5)
        return s if s and s["seat"]["holder"] == "ctl-b" else None

    after = await await_until(taken_over, within=10, what="ctl-b to take the seat")
    assert after["seat"]["epoch"] == before["seat"]["epoch"] + 1


async def test_holder_that_loses_nats_steps_down_and_frees_the_lock(
    nats_server, start_controller, database_url
) -> None:
    client = await nats_client.connect(nats_server.url)
    holder = start_controller("ctl-a")
    try:
        await await_until(lambda: held_status(client, timeout=0.5), within=20, what="a holder")
    finally:
        await client.close()
    assert await _lock_holders(database_url) == 1

    nats_server.kill()  # the bus is gone, for good
    lost_at = time.monotonic()
    (code,) = await await_until(lambda: exited(holder), within=20, what="the holder to step down")
    print(f"stepped down {time.monotonic() - lost_at:.1f}s after losing NATS")
    assert code == 1
    log = holder.log_path.read_text()
    assert "lost NATS for more than" in log
    assert "Traceback" not in log
    assert await _lock_holders(database_url) == 0
