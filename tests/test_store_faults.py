"""Store faults (issue 14, item 4): the seat and a three-tier plan across a failover of
PostgreSQL to its streaming standby, with a status client asking throughout.

1. The primary killed, the synchronous standby promoted: the holder's session is gone, it steps
   down; a controller takes the seat on the new primary with a higher epoch; the plan finishes.
2. Asynchronous replication, the last takeover lost: the standby stops receiving (restarted
   against a primary that is not there) while a takeover happens on the primary, then it is
   promoted. Its seat epoch is below the bus's: the next holder takes one above the bus's and
   says so in `mesh status`; no host applies two declarations under one epoch.
3. Partitions (tests/netns.py; see the part's own docstring).

Real PostgreSQL servers, nats-server, controllers and hosts; every wait polls with a deadline.
The store's history is read through test_faults' audit trigger (installed on the primary and
replicated with everything else); the hosts' `applied` events are recorded throughout.
"""

import json
import os
import shutil
import signal
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest
from helpers import MESH, await_until
from test_faults import (
    DEADLINE,
    Verbs,
    _exited,
    _true,
    assert_kv_epochs_rise,
    assert_one_epoch_at_a_time,
    fleet,
    install_audit,
    plan_of,
    query,
    status,
    steps,
)
from test_plans import assert_tier_order, mesh, module, ok
from test_store_standby import DATABASE, Pair, _promote, _start_pair

from mesh.embedded import postgres
from mesh.embedded.children import spawn
from mesh.embedded.ports import free_port

pytestmark = pytest.mark.slow

HOSTS = ["node-1", "node-2", "node-3"]


# --- shared pieces --------------------------------------------------------------------------------


@pytest.fixture
async def store_folder() -> AsyncIterator[Path]:
    # Not under pytest's folder (made private again by every session start): the servers run
    # as their own account and must keep reaching their data.
    path = Path(tempfile.mkdtemp(prefix="mesh-test-store-faults-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def pairs() -> AsyncIterator[list[Pair]]:
    started: list[Pair] = []
    yield started
    for pair in started:
        for child in reversed(pair.children):
            await child.stop(sig=signal.SIGINT, timeout=20)


def direct(port: int) -> str:
    return postgres.url(port, DATABASE)


class Applied:
    """Every `applied` report of every host, as the hosts sent them."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    async def start(self, nc) -> "Applied":
        async def got(msg) -> None:
            self.events.append(json.loads(msg.data))

        await nc.subscribe("mesh.event.*.applied", cb=got)
        await nc.flush()
        return self

    def good(self) -> list[dict]:
        return [e for e in self.events if e["ok"]]

    def assert_one_declaration_per_epoch(self) -> None:
        """No host applied two different declarations under one epoch."""
        digests: dict[tuple[str, int], set[str]] = defaultdict(set)
        for e in self.good():
            digests[(e["name"], e["epoch"])].add(e["digest"])
        twice = {k: v for k, v in digests.items() if len(v) > 1}
        assert twice == {}, f"two declarations applied under one epoch: {twice}"

    def assert_epochs_rise(self) -> None:
        """No host applied a declaration of an older epoch after a newer one's."""
        for name in {e["name"] for e in self.events}:
            epochs = [e["epoch"] for e in self.good() if e["name"] == name]
            assert epochs == sorted(epochs), f"{name} applied epochs {epochs}, in that order"


async def bus_epoch(nc) -> dict:
    kv = await nc.jetstream().key_value("mesh-seat")
    return json.loads((await kv.get("mesh-controller")).value)


async def waiting_in(nc, plan_id: int, machine: str, within: float = 60) -> dict:
    async def applying():
        p = await plan_of(nc, plan_id)
        return p if p and p["state"] == "rolling" and steps(p)[machine] == "applying" else None

    return await await_until(applying, within=within, what=f"{machine}'s step applying")


async def finished(nc, plan_id: int, within: float = 120) -> dict:
    async def done():
        p = await plan_of(nc, plan_id)
        return p if p and p["state"] not in ("pending", "rolling") else None

    return await await_until(done, within=within, what="the plan to finish")


async def holder_above(nc, epoch: int, within: float = 60) -> dict:
    async def above():
        s = await status(nc)
        return s if s and s["seat"]["epoch"] > epoch else None

    return await await_until(above, within=within, what=f"a holder above epoch {epoch}")


async def answers_after(verbs: Verbs) -> None:
    answered = verbs.answered
    await await_until(lambda: _true(verbs.answered > answered + 20), within=DEADLINE,
                      what="answers after the fault")  # fmt: skip


def controllers_on(procs, nats_url: str, database_url: str) -> Callable[[str], object]:
    def start(instance: str):
        return procs.start(
            instance, [*MESH, "controller", "run", "--instance", instance],
            env={"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": database_url,
                 "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    return start


async def promote(data: Path) -> None:
    await anyio.to_thread.run_sync(_promote, data)


# --- 1: the primary killed, the synchronous standby promoted --------------------------------------


async def test_the_primary_killed_and_the_standby_promoted_during_a_plan(
    nc, nats_url, procs, start_host, tmp_path, store_folder, pairs
) -> None:
    """Tier 1 waits: SIGKILL the primary and promote the synchronous standby. The holder's
    session died with the primary: it steps down (exit 1). A controller takes the seat on the
    new primary through the same two-server URL, with an epoch above every one the store and
    the bus saw; the plan finishes; every status is answered within its deadline; what the old
    primary acknowledged (tier 0 done, the audit of every write) is on the new one."""
    pair = await _start_pair(store_folder, synchronous=True)
    pairs.append(pair)
    await postgres.wait_synchronous(pair.primary_port, deadline=60)
    start = controllers_on(procs, nats_url, pair.url(pair.primary_port, pair.standby_port))
    controllers = await fleet(nc, start, start_host, tmp_path, hosts=len(HOSTS))
    await install_audit(direct(pair.primary_port))
    applied = await Applied().start(nc)
    roots = tmp_path / "hosts"
    source = module(tmp_path / "m", marker="ready", deadline="90s")
    plan_id = ok(mesh(nats_url, "push", str(source), "--json"))["plan"]
    (roots / "node-1" / "ready").write_text("")
    before_plan = await waiting_in(nc, plan_id, "node-2")
    before = await status(nc)
    assert before is not None
    holder, epoch = before["seat"]["holder"], before["seat"]["epoch"]
    assert (await bus_epoch(nc))["epoch"] == epoch

    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        killed = time.monotonic()
        pair.primary.proc.kill()
        await pair.primary.proc.wait()
        await promote(store_folder / "pg-standby")
        promoted = time.monotonic() - killed
        code = await await_until(lambda: _exited(controllers[holder]), within=30,
                                 what=f"{holder} to step down")  # fmt: skip
        after = await holder_above(nc, epoch)
        took = time.monotonic() - killed
        controllers["ctl-2"] = start("ctl-2")  # what the old holder's supervisor would do
        (roots / "node-2" / "ready").write_text("")
        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id)
        await answers_after(verbs)
        stop.set()

    print(f"promoted {promoted:.1f}s after the kill; {after['seat']['holder']} held epoch "
          f"{after['seat']['epoch']} {took:.1f}s after; {verbs.answered} status answered, the "
          f"slowest in {verbs.worst:.2f}s")  # fmt: skip
    log = controllers[holder].log_path.read_text()
    assert code == (1,), log[-3000:]
    # Its lock's session died with the primary; its next ping (every second) finds that, unless
    # the bus's watch (every second too) sees the new holder's higher epoch first.
    last = log.strip().splitlines()[-1]  # (asyncpg's pool logs tracebacks of its own before it)
    assert last.startswith("mesh: error: ") and (
        "the seat's store session failed" in last or f"above ours ({epoch})" in last
    ), log[-3000:]
    assert verbs.failures == [], verbs.failures[:5]
    assert after["seat"]["holder"] != holder
    assert after["seat"]["warnings"] == [], after["seat"]  # nothing was lost: nothing to say

    assert plan["state"] == "done", plan
    assert steps(plan) == {h: "done" for h in HOSTS}
    assert_tier_order(plan)
    node_1 = next(s for s in before_plan["steps"] if s["machine"] == "node-1")
    assert node_1 in plan["steps"], "tier 0's step as the old primary acknowledged it"

    new = direct(pair.standby_port)
    audit = await query(new, "SELECT max(epoch) AS top FROM fault_audit WHERE tbl = 'seats'")
    assert audit[0]["top"] == after["seat"]["epoch"]  # no epoch above the holder's, anywhere
    seen = await query(new, "SELECT epoch FROM fault_audit WHERE tbl = 'seats' ORDER BY id")
    assert epoch in [r["epoch"] for r in seen], "the old primary's takeover was replicated"
    wrote = await assert_one_epoch_at_a_time(new)
    assert {epoch, after["seat"]["epoch"]} <= wrote, wrote
    assert (await bus_epoch(nc))["epoch"] == after["seat"]["epoch"]
    await assert_kv_epochs_rise(nc)
    applied.assert_one_declaration_per_epoch()
    applied.assert_epochs_rise()


# --- 2: asynchronous replication, the last takeover lost ------------------------------------------


async def caught_up(pair: Pair, within: float = 60) -> None:
    """The standby has replayed everything the primary had written when this was called."""
    conn = await asyncpg.connect(direct(pair.primary_port))
    try:
        lsn = await conn.fetchval("SELECT pg_current_wal_lsn()::text")
    finally:
        await conn.close()

    async def replayed():
        standby = await asyncpg.connect(direct(pair.standby_port))
        try:
            return await standby.fetchval(
                "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", lsn
            )
        finally:
            await standby.close()

    await await_until(replayed, within=within, what="the standby to replay the primary's WAL")


async def streaming(pair: Pair, within: float = 60) -> None:
    async def there():
        sql = "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming'"
        rows = await query(direct(pair.primary_port), sql)
        return bool(rows)

    await await_until(there, within=within, what="the standby streaming")


async def cut_off(pair: Pair, data: Path) -> None:
    """Restart the standby (on its port: the controllers' URL names it) with its primary's
    address pointing nowhere: it stays a hot standby with what it has, receiving nothing."""
    standby = pair.children.pop()
    await standby.stop(sig=signal.SIGINT, timeout=30)
    settings = postgres.standby_settings(primary_port=free_port())
    child = await spawn(
        "postgres-standby", postgres.argv(data, port=pair.standby_port, settings=settings),
        log=data.parent / "standby-cut-off.log", cwd=data, **postgres.run_as(),
    )  # fmt: skip
    pair.standby = child
    pair.children.append(child)
    await postgres.wait_ready(pair.standby_port, deadline=60, alive=lambda: child.running)


async def test_a_promoted_asynchronous_standby_without_the_last_takeover(
    nc, nats_url, procs, start_host, tmp_path, store_folder, pairs
) -> None:
    """An asynchronous standby has everything up to ctl-0's takeover (epoch E) and tier 1
    starting; then it stops receiving (restarted against a primary that is not there). SIGKILL
    ctl-0: ctl-1 takes E+1 on the primary, records it on the bus and rolls tier 1 to the end.
    The primary dies; the standby, which never got E+1, is promoted. The next holder takes an
    epoch above the bus's (E+2, not the store's E+1 again), `mesh status` says the store was
    behind, the plan finishes, and no host applied two declarations under one epoch."""
    pair = await _start_pair(store_folder, synchronous=False)
    pairs.append(pair)
    await streaming(pair)
    start = controllers_on(procs, nats_url, pair.url(pair.primary_port, pair.standby_port))
    controllers = await fleet(nc, start, start_host, tmp_path, hosts=len(HOSTS))
    await install_audit(direct(pair.primary_port))
    applied = await Applied().start(nc)
    roots = tmp_path / "hosts"
    source = module(tmp_path / "m", marker="ready", deadline="90s")
    plan_id = ok(mesh(nats_url, "push", str(source), "--json"))["plan"]
    (roots / "node-1" / "ready").write_text("")
    await waiting_in(nc, plan_id, "node-2")
    first = await status(nc)
    assert first is not None and first["seat"]["holder"] == "ctl-0"
    epoch = first["seat"]["epoch"]
    assert any("without synchronous replication" in w for w in first["seat"]["warnings"]), first
    await caught_up(pair)

    await cut_off(pair, store_folder / "pg-standby")

    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        # A takeover the standby will never see.
        os.kill(first["seat"]["pid"], signal.SIGKILL)
        assert controllers["ctl-0"].wait(timeout=10) == -signal.SIGKILL
        lost = await holder_above(nc, epoch)
        assert lost["seat"]["holder"] == "ctl-1" and lost["seat"]["epoch"] == epoch + 1
        assert (await bus_epoch(nc))["epoch"] == epoch + 1
        controllers["ctl-2"] = start("ctl-2")
        (roots / "node-2" / "ready").write_text("")
        await waiting_in(nc, plan_id, "node-3")  # tier 1 done under E+1: lost with the primary

        # The primary dies; the standby is promoted without E+1 (the old URL reaches it).
        killed = time.monotonic()
        pair.primary.proc.kill()
        await pair.primary.proc.wait()
        await promote(store_folder / "pg-standby")
        code = await await_until(lambda: _exited(controllers["ctl-1"]), within=30,
                                 what="ctl-1 to step down")  # fmt: skip
        after = await holder_above(nc, epoch + 1)
        took = time.monotonic() - killed
        controllers["ctl-3"] = start("ctl-3")
        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id)
        await answers_after(verbs)
        stop.set()

    print(f"{after['seat']['holder']} held epoch {after['seat']['epoch']} {took:.1f}s after the "
          f"primary died; {verbs.answered} status answered, the slowest in "
          f"{verbs.worst:.2f}s")  # fmt: skip
    assert code == (1,), controllers["ctl-1"].log_path.read_text()[-3000:]
    assert verbs.failures == [], verbs.failures[:5]
    new = direct(pair.standby_port)
    store_seen = await query(new, "SELECT epoch FROM fault_audit WHERE tbl = 'seats' ORDER BY id")
    assert epoch + 1 not in [r["epoch"] for r in store_seen], "the standby got E+1 after all"
    assert after["seat"]["epoch"] == epoch + 2, after["seat"]  # above the bus's, not E+1 again
    assert (await bus_epoch(nc))["epoch"] == epoch + 2
    said = [w for w in after["seat"]["warnings"] if "below the bus's" in w]
    assert said and f"the store's epoch ({epoch}) was below the bus's ({epoch + 1})" in said[0]
    behind = await query(new, "SELECT detail FROM events WHERE kind = 'seat.store_behind'")
    assert len(behind) == 1, behind
    shown = ok(mesh(nats_url, "status", "--json"))
    assert said[0] in shown["seat"]["warnings"], shown

    assert plan["state"] == "done", plan
    assert steps(plan) == {h: "done" for h in HOSTS}
    assert_tier_order(plan)
    await assert_one_epoch_at_a_time(new)
    await assert_kv_epochs_rise(nc)
    applied.assert_one_declaration_per_epoch()
    applied.assert_epochs_rise()
    # ctl-1's epoch did reach the hosts (it was the plan's holder for tier 1); every key is
    # E+2's now (republished from the promoted store, the plan's last steps published).
    assert epoch + 1 in {e["epoch"] for e in applied.good()}, applied.events
    await assert_declarations_of(nc, epoch + 2)


async def assert_declarations_of(nc, epoch: int) -> None:
    kv = await nc.jetstream().key_value("mesh-declarations")
    for machine in HOSTS:
        assert json.loads((await kv.get(machine)).value)["epoch"] == epoch, machine
