"""An epoch never repeats, whatever the store lost: the holder records its epoch on the bus with
compare-and-set, takes one above both the store's and the bus's, says so when the store was
behind, and steps down when the bus names a higher epoch than its own. Hosts refuse an epoch
older than the one they applied, or the same one from another holder (test_apply.py)."""

import json
import signal

import asyncpg
from helpers import ask, await_until, js

from services.host.apply import fenced


def test_what_a_host_refuses() -> None:
    assert fenced(4, "ctl-a", applied=5, by="ctl-a") == "epoch 4 is older than epoch 5"
    assert fenced(5, "ctl-b", applied=5, by="ctl-a") == (
        "epoch 5 comes from ctl-b, but ctl-a published it first"
    )
    assert fenced(5, "ctl-a", applied=5, by="ctl-a") is None
    assert fenced(6, "ctl-b", applied=5, by="ctl-a") is None
    # Declarations from before holders were named: the epoch alone decides.
    assert fenced(5, "", applied=5, by="ctl-a") is None
    assert fenced(5, "ctl-b", applied=5, by="") is None


async def _held(nc, holder: str) -> dict:
    async def holding():
        s = await ask(nc, "mesh.ctl.status", timeout=0.5)
        return s if s and s.get("seat") and s["seat"]["holder"] == holder else None

    return await await_until(holding, within=30, what=f"{holder} to hold the seat")


async def _bus_epoch(nc) -> dict:
    kv = await js(nc).key_value("mesh-seat")
    return json.loads((await kv.get("mesh-controller")).value)


async def test_a_store_that_lost_writes_does_not_repeat_an_epoch(
    nc, start_controller, database_url
) -> None:
    first = start_controller("ctl-a")
    status = await _held(nc, "ctl-a")
    epoch = status["seat"]["epoch"]
    assert status["seat"]["warnings"] == []
    assert (await _bus_epoch(nc))["epoch"] == epoch
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=30) == 0

    # A failover to a standby that lacked the last increments: the store's epoch goes back.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE seats SET epoch = 0 WHERE name = 'mesh-controller'")
    finally:
        await conn.close()

    start_controller("ctl-b")
    status = await _held(nc, "ctl-b")
    assert status["seat"]["epoch"] == epoch + 1  # above the bus's, not the store's 0 + 1
    [warning] = status["seat"]["warnings"]
    assert f"the store's epoch (0) was below the bus's ({epoch})" in warning
    assert (await _bus_epoch(nc))["epoch"] == epoch + 1
    conn = await asyncpg.connect(database_url)
    try:
        behind = await conn.fetchval(
            "SELECT detail FROM events WHERE kind = 'seat.store_behind' ORDER BY id DESC LIMIT 1"
        )
    finally:
        await conn.close()
    assert {"store_epoch": 0, "bus_epoch": epoch}.items() <= json.loads(behind).items()


async def test_a_holder_steps_down_when_the_bus_names_a_higher_epoch(nc, start_controller) -> None:
    holder = start_controller("ctl-a")
    status = await _held(nc, "ctl-a")
    epoch = status["seat"]["epoch"]
    # Another controller recorded a higher epoch (it took the seat on another primary).
    kv = await js(nc).key_value("mesh-seat")
    record = {"epoch": epoch + 3, "holder": "ctl-elsewhere", "pid": 1,
              "at": "2026-01-01T00:00:00Z"}  # fmt: skip
    await kv.put("mesh-controller", json.dumps(record).encode())
    code = holder.wait(timeout=30)
    assert code != 0  # it gave the seat up: an error exit, for its supervisor to restart
    log = holder.log_path.read_text()
    assert f"ctl-elsewhere holds epoch {epoch + 3} on the bus, above ours ({epoch})" in log
