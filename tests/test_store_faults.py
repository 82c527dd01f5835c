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
The store's history is read through the fault tests' audit trigger (tests/faults.py, installed
on the primary and replicated with everything else); the hosts' `applied` events are recorded
throughout.
"""

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import anyio
import asyncpg
import nats
import netns
import pytest
from faults import (
    Verbs,
    assert_kv_epochs_rise,
    assert_one_epoch_at_a_time,
    finished,
    holder_above,
    install_audit,
    query,
    steps,
    waiting_in,
)
from helpers import (
    MESH,
    already,
    assert_tier_order,
    await_until,
    exited,
    fleet_up,
    held_status,
    js,
    mesh_cli,
    ok_json,
)
from module_folders import gated_module
from netpieces import CLIENT_PORT, MONITOR_PORT, PG_PORT, accepts, postgres_argv
from standby import DATABASE, Pair, promote, start_pair, sync_pair

from mesh.embedded import natsd, pgauth, postgres
from mesh.embedded.children import spawn
from mesh.embedded.ports import free_port

pytestmark = pytest.mark.slow

HOSTS = ["node-1", "node-2", "node-3"]
CONTROLLERS = ("ctl-0", "ctl-1")  # the holder, then the standby


# --- shared pieces --------------------------------------------------------------------------------


def direct(pair: Pair, port: int) -> str:
    """One server, as the controllers connect (their role owns the tables, and so the audit's
    table and trigger, which the controllers' writes must be allowed to fill)."""
    return postgres.url(
        port, DATABASE, user=postgres.CONTROLLER_USER,
        password=pair.passwords.of(postgres.CONTROLLER_USER),
    )  # fmt: skip


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
    kv = await js(nc).key_value("mesh-seat")
    return json.loads((await kv.get("mesh-controller")).value)


async def _append(into: list, awaitable) -> None:
    into.append(await awaitable)


def controllers_on(procs, nats_url: str, database_url: str) -> Callable[[str], object]:
    def start(instance: str):
        return procs.start(
            instance, [*MESH, "controller", "run", "--instance", instance],
            env={"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": database_url,
                 "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    return start


async def promoted(data: Path) -> None:
    """The standby in `data` promoted (standby.promote), off the event loop."""
    await anyio.to_thread.run_sync(promote, data)


# --- 1: the primary killed, the synchronous standby promoted --------------------------------------


async def rolling(
    nc, nats_url: str, tmp_path: Path, *, deadline: str
) -> tuple[int, dict, dict, Applied]:
    """A three-tier plan pushed (its steps wait for tmp_path/hosts/NAME/ready), tier 0 let
    through, tier 1 applying: the plan's id, the plan and the status then, and the hosts'
    `applied` reports recorded from before the push."""
    applied = await Applied().start(nc)
    source = gated_module(tmp_path / "m", marker="ready", deadline=deadline)
    pushed = mesh_cli("push", str(source), "--json", nats_url=nats_url, answer=60, timeout=180)
    plan_id = ok_json(pushed)["plan"]
    (tmp_path / "hosts" / "node-1" / "ready").write_text("")
    plan = await waiting_in(nc, plan_id, "node-2")
    before = await held_status(nc)
    assert before is not None
    return plan_id, plan, before, applied


async def test_the_primary_killed_and_the_standby_promoted_during_a_plan(
    nc, nats_url, procs, start_fleet, tmp_path, open_dir, pairs
) -> None:
    """Tier 1 waits: SIGKILL the primary and promote the synchronous standby. The holder's
    session died with the primary: it steps down (exit 1). A controller takes the seat on the
    new primary through the same two-server URL, with an epoch above every one the store and
    the bus saw; the plan finishes; every status is answered within its deadline; what the old
    primary acknowledged (tier 0 done, the audit of every write) is on the new one."""
    pair = await sync_pair(open_dir, pairs)
    start = controllers_on(procs, nats_url, pair.url(pair.primary_port, pair.standby_port))
    fleet = await start_fleet(hosts=len(HOSTS), controllers=CONTROLLERS, start_controller=start)
    controllers = fleet.controllers
    await install_audit(direct(pair, pair.primary_port))
    roots = tmp_path / "hosts"
    plan_id, before_plan, before, applied = await rolling(nc, nats_url, tmp_path, deadline="90s")
    holder, epoch = before["seat"]["holder"], before["seat"]["epoch"]
    assert (await bus_epoch(nc))["epoch"] == epoch

    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        killed = time.monotonic()
        pair.primary.proc.kill()
        await pair.primary.proc.wait()
        await promoted(open_dir / "pg-standby")
        promotion = time.monotonic() - killed
        code = await await_until(lambda: exited(controllers[holder]), within=30,
                                 what=f"{holder} to step down")  # fmt: skip
        after = await holder_above(nc, epoch)
        took = time.monotonic() - killed
        controllers["ctl-2"] = start("ctl-2")  # what the old holder's supervisor would do
        (roots / "node-2" / "ready").write_text("")
        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id, within=120)
        await verbs.answers_after("answers after the fault")
        stop.set()

    print(f"promoted {promotion:.1f}s after the kill; {after['seat']['holder']} held epoch "
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

    new = direct(pair, pair.standby_port)
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
    conn = await asyncpg.connect(direct(pair, pair.primary_port))
    try:
        lsn = await conn.fetchval("SELECT pg_current_wal_lsn()::text")
    finally:
        await conn.close()

    async def replayed():
        standby = await asyncpg.connect(direct(pair, pair.standby_port))
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
        rows = await query(direct(pair, pair.primary_port), sql)
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
    await postgres.wait_ready(
        pair.standby_port, password=pair.passwords.of(postgres.PG_USER), deadline=60,
        alive=lambda: child.running,
    )  # fmt: skip


async def test_a_promoted_asynchronous_standby_without_the_last_takeover(
    nc, nats_url, procs, start_fleet, tmp_path, open_dir, pairs
) -> None:
    """An asynchronous standby has everything up to ctl-0's takeover (epoch E) and tier 1
    starting; then it stops receiving (restarted against a primary that is not there). SIGKILL
    ctl-0: ctl-1 takes E+1 on the primary, records it on the bus and rolls tier 1 to the end.
    The primary dies; the standby, which never got E+1, is promoted. The next holder takes an
    epoch above the bus's (E+2, not the store's E+1 again), `mesh status` says the store was
    behind, the plan finishes, and no host applied two declarations under one epoch."""
    pair = await start_pair(open_dir, synchronous=False)
    pairs.append(pair)
    await streaming(pair)
    start = controllers_on(procs, nats_url, pair.url(pair.primary_port, pair.standby_port))
    fleet = await start_fleet(hosts=len(HOSTS), controllers=CONTROLLERS, start_controller=start)
    controllers = fleet.controllers
    await install_audit(direct(pair, pair.primary_port))
    roots = tmp_path / "hosts"
    plan_id, _, first, applied = await rolling(nc, nats_url, tmp_path, deadline="90s")
    assert first["seat"]["holder"] == "ctl-0"
    epoch = first["seat"]["epoch"]
    assert any("without synchronous replication" in w for w in first["seat"]["warnings"]), first
    await caught_up(pair)

    await cut_off(pair, open_dir / "pg-standby")

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
        await promoted(open_dir / "pg-standby")
        code = await await_until(lambda: exited(controllers["ctl-1"]), within=30,
                                 what="ctl-1 to step down")  # fmt: skip
        after = await holder_above(nc, epoch + 1)
        took = time.monotonic() - killed
        controllers["ctl-3"] = start("ctl-3")
        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id, within=120)
        await verbs.answers_after("answers after the fault")
        stop.set()

    print(f"{after['seat']['holder']} held epoch {after['seat']['epoch']} {took:.1f}s after the "
          f"primary died; {verbs.answered} status answered, the slowest in "
          f"{verbs.worst:.2f}s")  # fmt: skip
    assert code == (1,), controllers["ctl-1"].log_path.read_text()[-3000:]
    assert verbs.failures == [], verbs.failures[:5]
    new = direct(pair, pair.standby_port)
    store_seen = await query(new, "SELECT epoch FROM fault_audit WHERE tbl = 'seats' ORDER BY id")
    assert epoch + 1 not in [r["epoch"] for r in store_seen], "the standby got E+1 after all"
    assert after["seat"]["epoch"] == epoch + 2, after["seat"]  # above the bus's, not E+1 again
    assert (await bus_epoch(nc))["epoch"] == epoch + 2
    said = [w for w in after["seat"]["warnings"] if "below the bus's" in w]
    assert said and f"the store's epoch ({epoch}) was below the bus's ({epoch + 1})" in said[0]
    behind = await query(new, "SELECT detail FROM events WHERE kind = 'seat.store_behind'")
    assert len(behind) == 1, behind
    shown = ok_json(mesh_cli("status", "--json", nats_url=nats_url, answer=60, timeout=180))
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
    kv = await js(nc).key_value("mesh-declarations")
    for machine in HOSTS:
        assert json.loads((await kv.get(machine)).value)["epoch"] == epoch, machine


# --- 3: partitions --------------------------------------------------------------------------------
#
# Every piece in a network namespace of its own (tests/netns.py): the nats-server, the primary
# (pg1) and its synchronous standby (pg2), the two controllers, the three hosts, and the test's
# own clients ("client"). PostgreSQL listens on its switch address only; the controllers' URL
# names both servers, so after a promotion the same URL reaches the new primary.

NET = ["nats", "pg1", "pg2", "ctl-0", "ctl-1", *HOSTS, "client"]
NATS_PORT = CLIENT_PORT
BEAT = 0.5
STEP_DOWN_AT_MOST = 30.0  # a holder cut off from the store steps down within this (pings: ~4 s)


@pytest.fixture
def net():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.network(NET) as network:
        yield network


class StoreNet:
    def __init__(self, net: netns.Network, procs, tmp_path: Path, folder: Path) -> None:
        self.net, self.procs, self.dir, self.folder = net, procs, tmp_path, folder
        self.url = f"nats://{net.address('nats')}:{NATS_PORT}"
        self.pg = {name: net.address(name) for name in ("pg1", "pg2")}
        servers = ",".join(f"{address}:{PG_PORT}" for address in self.pg.values())
        self.database_url = (
            f"postgresql://{postgres.PG_USER}@{servers}/{DATABASE}?target_session_attrs=read-write"
        )
        self.servers: dict[str, object] = {}
        self.controllers: dict[str, object] = {}

    def direct(self, member: str, database: str = DATABASE) -> str:
        return f"postgresql://{postgres.PG_USER}@{self.pg[member]}:{PG_PORT}/{database}"

    def env(self) -> dict[str, str]:
        return {"MESH_NATS_URL": self.url, "MESH_DATABASE_URL": self.database_url,
                "PYTHONUNBUFFERED": "1"}  # fmt: skip

    async def start_nats(self) -> None:
        conf = natsd.write_config(self.dir / "bus", port=NATS_PORT, host=self.net.address("nats"))
        # The monitoring port, for /connz: when the server drops a cut-off controller.
        conf.write_text(conf.read_text() + f'http: "{self.net.address("nats")}:{MONITOR_PORT}"\n')
        proc = self.procs.start("nats-server", self.net.argv("nats", natsd.argv(conf)))

        async def listening():
            assert proc.poll() is None, (self.dir / "nats-server.log").read_text()
            try:
                conn = await nats.connect(self.url, allow_reconnect=False, connect_timeout=1)
            except Exception:
                return False
            await conn.close()
            return True

        await await_until(listening, within=30, what="nats-server to listen")

    def _postgres(self, member: str, data: Path, settings: tuple[str, ...]) -> None:
        argv = postgres_argv(data, self.pg[member], settings)
        with self.net.inside(member):  # forked in there, then drops to its account
            self.servers[member] = self.procs.start(
                f"postgres-{member}", argv, cwd=data, **postgres.run_as()
            )

    async def _ready(self, member: str) -> None:
        proc = self.servers[member]

        async def ready():
            assert proc.poll() is None, (self.dir / f"postgres-{member}.log").read_text()[-3000:]
            return await accepts(self.direct(member, "postgres"))

        await await_until(ready, within=60, what=f"PostgreSQL on {member}")

    async def start_store(self) -> None:
        """pg1 a primary with pg2 its synchronous standby, copied with pg_basebackup."""
        primary, standby = self.folder / "pg1", self.folder / "pg2"
        # The subnet's lines below let the test's pieces in without a password.
        passwords = pgauth.Passwords(self.folder / "passwords")
        await anyio.to_thread.run_sync(lambda: postgres.init(primary, passwords=passwords))
        with open(primary / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.net.subnet} trust\n")
            hba.write(f"host replication {postgres.REPLICATION_USER} {self.net.subnet} trust\n")
        self._postgres("pg1", primary, postgres.PRIMARY)
        await self._ready("pg1")
        conn = await asyncpg.connect(self.direct("pg1", "postgres"),
                                     server_settings={"synchronous_commit": "local"})  # fmt: skip
        try:
            await conn.execute(f'CREATE DATABASE "{DATABASE}"')
            await conn.execute(f'CREATE ROLE "{postgres.REPLICATION_USER}" WITH REPLICATION LOGIN')
        finally:
            await conn.close()
        postgres.init_folder(standby)
        with self.net.inside("pg2"):
            done = subprocess.run(
                [postgres.bin("pg_basebackup"), "-D", str(standby), "-h", self.pg["pg1"],
                 "-p", str(PG_PORT), "-U", postgres.REPLICATION_USER, "-R", "-X", "stream",
                 "-c", "fast", "--no-password"],
                capture_output=True, text=True, cwd=standby, **postgres.run_as(),
            )  # fmt: skip
        assert done.returncode == 0, done.stderr
        conninfo = (f"host={self.pg['pg1']} port={PG_PORT} user={postgres.REPLICATION_USER} "
                    f"application_name={postgres.STANDBY_NAME}")  # fmt: skip
        self._postgres("pg2", standby, (f"primary_conninfo={conninfo}", "hot_standby=on"))
        await self._ready("pg2")

        async def synchronous():
            rows = await query(self.direct("pg1"), "SELECT 1 FROM pg_stat_replication"
                               " WHERE state = 'streaming' AND sync_state = 'sync'")  # fmt: skip
            return bool(rows)

        await await_until(synchronous, within=60, what="pg2 streaming synchronously")

    async def promote(self) -> None:
        await promoted(self.folder / "pg2")

    async def connections_of(self, member: str) -> set[int]:
        """The ids of nats-server's client connections from `member`'s address (/connz)."""
        url = f"http://{self.net.address('nats')}:{MONITOR_PORT}/connz?limit=1000"

        def get() -> bytes:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read()

        conns = json.loads(await anyio.to_thread.run_sync(get))["connections"] or []
        return {c["cid"] for c in conns if c["ip"] == self.net.address(member)}

    async def dropped(self, member: str, cids: set[int], within: float = 60) -> float:
        """When (time.monotonic()) nats-server had dropped every one of `cids` (`member`'s
        connections): until then it may route a queue group's requests to them."""

        async def gone():
            return not (await self.connections_of(member)) & cids

        await await_until(gone, within=within, what=f"nats-server to drop {member}'s link")
        return time.monotonic()

    def start_controller(self, instance: str, member: str | None = None):
        argv = self.net.argv(member or instance,
                             [*MESH, "controller", "run", "--instance", instance])  # fmt: skip
        self.controllers[instance] = self.procs.start(instance, argv, env=self.env())
        return self.controllers[instance]

    def start_host(self, name: str, *extra: str):
        argv = self.net.argv(name, [
            *MESH, "host", "run", "--name", name, "--root", str(self.dir / "hosts" / name),
            "--beat", str(BEAT), *extra,
        ])  # fmt: skip
        return self.procs.start(name, argv, env=self.env())


@pytest.fixture
async def storenet(net, procs, tmp_path, open_dir, monkeypatch):
    """The test thread sits in the client namespace throughout: its sockets go over the switch."""
    monkeypatch.delenv("MESH_CA", raising=False)
    monkeypatch.delenv("MESH_CREDS", raising=False)
    with net.inside("client"):
        m = StoreNet(net, procs, tmp_path, open_dir)
        try:
            await m.start_nats()
            await m.start_store()
            nc = await nats.connect(m.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
            try:
                m.nc = nc
                await fleet_up(nc, start_controller=m.start_controller, start_host=m.start_host,
                               hosts=len(HOSTS), controllers=CONTROLLERS)  # fmt: skip
                await install_audit(m.direct("pg1"))
                yield m
            finally:
                await nc.close()
        finally:
            procs.kill_all()  # before the namespaces go


async def rolling_tier_1(m: StoreNet, tmp_path: Path) -> tuple[int, dict, Applied]:
    """A three-tier plan pushed, tier 0 done, tier 1 applying; the seat as it is then."""
    plan_id, _, before, applied = await rolling(m.nc, m.url, tmp_path, deadline="120s")
    return plan_id, before, applied


async def finish(m: StoreNet, tmp_path: Path, plan_id: int, verbs: Verbs) -> dict:
    for name in ("node-2", "node-3"):
        (tmp_path / "hosts" / name / "ready").write_text("")
    plan = await finished(m.nc, plan_id, within=120)
    await verbs.answers_after("answers after the fault")
    return plan


async def assert_finished_well(m: StoreNet, plan: dict, applied: Applied, store: str) -> None:
    assert plan["state"] == "done", plan
    assert steps(plan) == {h: "done" for h in HOSTS}
    assert_tier_order(plan)
    await assert_one_epoch_at_a_time(m.direct(store))
    await assert_kv_epochs_rise(m.nc)
    applied.assert_one_declaration_per_epoch()
    applied.assert_epochs_rise()
    now = await held_status(m.nc)
    assert now is not None
    await assert_declarations_of(m.nc, now["seat"]["epoch"])


async def stepped_down(m: StoreNet, holder: str, within: float = 120) -> tuple[int]:
    return await await_until(lambda: exited(m.controllers[holder]), within=within,
                             what=f"{holder} to step down")  # fmt: skip


async def test_the_holder_cut_off_from_the_store_only(storenet, tmp_path) -> None:
    """(a) Tier 1 waits: the holder's namespace loses its routes to both PostgreSQL servers,
    keeping NATS. Its lock's pings fail: it steps down within its bound; the standby, which
    still reaches the store, takes the seat when the server ends the old session; the
    plan finishes once the holder is back (restarted by its supervisor)."""
    m = storenet
    plan_id, before, applied = await rolling_tier_1(m, tmp_path)
    holder, epoch = before["seat"]["holder"], before["seat"]["epoch"]
    standby = next(c for c in ("ctl-0", "ctl-1") if c != holder)
    stores = list(m.pg.values())
    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, m.nc, stop)
        m.net.block(holder, stores)
        blocked = time.monotonic()
        try:
            code = await stepped_down(m, holder)
            gave_up = time.monotonic() - blocked
            after = await holder_above(m.nc, epoch)
            took = time.monotonic() - blocked
        finally:
            m.net.unblock(holder, stores)
        m.start_controller(holder)  # its supervisor starts it again: it stands by
        plan = await finish(m, tmp_path, plan_id, verbs)
        stop.set()

    print(f"{holder} gave up {gave_up:.1f}s after losing the store; {after['seat']['holder']} "
          f"held {took:.1f}s after; {verbs.answered} status answered, the slowest in "
          f"{verbs.worst:.2f}s")  # fmt: skip
    log = (tmp_path / f"{holder}.log").read_text()
    assert code == (1,), log[-3000:]
    assert "the seat's store session failed" in log, log[-3000:]
    assert gave_up < STEP_DOWN_AT_MOST, gave_up
    assert after["seat"]["holder"] == standby
    assert verbs.failures == [], verbs.failures[:5]
    await assert_finished_well(m, plan, applied, "pg1")


async def test_the_holder_cut_off_from_nats_and_the_store(storenet, tmp_path) -> None:
    """(b) Tier 1 waits: the holder's link is cut at the switch (NATS and both PostgreSQL
    servers gone at once). It steps down (whichever it notices first); the standby takes the
    seat once the server ends the old session; the link comes back, the plan finishes."""
    m = storenet
    plan_id, before, applied = await rolling_tier_1(m, tmp_path)
    holder, epoch = before["seat"]["holder"], before["seat"]["epoch"]
    standby = next(c for c in ("ctl-0", "ctl-1") if c != holder)
    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, m.nc, stop)
        cids = await m.connections_of(holder)
        assert cids, f"{holder} has no connection to nats-server"
        m.net.cut(holder)
        cut = time.monotonic()
        dropped: list[float] = []
        tg.start_soon(lambda: _append(dropped, m.dropped(holder, cids)))
        try:
            after = await holder_above(m.nc, epoch)
            took = time.monotonic() - cut
            code = await stepped_down(m, holder)
            gave_up = time.monotonic() - cut
        finally:
            m.net.restore(holder)
        await await_until(lambda: already(bool(dropped)), within=60, what="the cut link dropped")
        m.start_controller(holder)
        plan = await finish(m, tmp_path, plan_id, verbs)
        stop.set()

    gone = dropped[0] - cut
    window = [f for f in verbs.failures if cut + took <= f[0] < dropped[0]]
    print(f"{after['seat']['holder']} held {took:.1f}s after the cut; {holder} gave up "
          f"{gave_up:.1f}s after; nats-server dropped its link {gone:.1f}s after; "
          f"{verbs.answered} status answered, the slowest in {verbs.worst:.2f}s; "
          f"{len(window)} unanswered while the seat was held and the cut link still in the "
          "verb group")  # fmt: skip
    log = (tmp_path / f"{holder}.log").read_text()
    assert code == (1,), log[-3000:]
    assert "the seat's store session failed" in log or "lost NATS" in log, log[-3000:]
    assert gave_up < STEP_DOWN_AT_MOST, gave_up
    assert after["seat"]["holder"] == standby
    # Until the server ends the cut holder's session (idle_session_timeout, keepalives) nobody
    # can hold the seat, and until nats-server drops the cut holder's link (its pings, or the
    # link's return) it keeps its place in the verb group: about half the attempts vanish into
    # it, so a request may run out of its deadline in that window (every status answered is
    # asked for the store's own failures, not for partitions). Every request started once the
    # standby held the seat and the server had dropped the cut link was answered.
    assert gone < 35, gone  # ping_interval 10 s, ping_max 2: at most 30 s (+ the poll)
    late = [f for f in verbs.failures if f[0] >= max(cut + took, dropped[0])]
    assert late == [], late[:5]
    await assert_finished_well(m, plan, applied, "pg1")


async def test_a_split_store_the_bus_epoch_decides(storenet, tmp_path) -> None:
    """(c) Tier 1 waits: the standby controller loses its route to the primary (pg1) only, and
    pg2 is promoted while pg1 runs on, still the old holder's store (two primaries). The standby
    lands on pg2, where nobody holds the lock, and takes an epoch above the bus's; the old
    holder, whose lock on pg1 is fine, sees the higher epoch on the bus and steps down. Hosts
    never apply the old holder's declarations after the new one's. The fault heals as an HA
    manager heals it (pg1 fenced: stopped), the route comes back, the plan finishes on pg2.

    (pg1's commits wait for its synchronous standby, which is gone: the old holder could not
    commit a plan write there anyway; the bus's epoch and the hosts' fence are what stop it.)"""
    m = storenet
    plan_id, before, applied = await rolling_tier_1(m, tmp_path)
    holder, epoch = before["seat"]["holder"], before["seat"]["epoch"]
    standby = next(c for c in ("ctl-0", "ctl-1") if c != holder)
    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, m.nc, stop)
        m.net.block(standby, [m.pg["pg1"]])
        split = time.monotonic()
        try:
            await m.promote()
            after = await holder_above(m.nc, epoch, within=90)
            took = time.monotonic() - split
            code = await stepped_down(m, holder, within=30)
            gave_up = time.monotonic() - split
            assert m.servers["pg1"].poll() is None, "pg1 ran on through the split"
            # The heal: pg1 is fenced (an HA manager stops it), the route is back.
            m.servers["pg1"].send_signal(signal.SIGINT)
            m.servers["pg1"].wait(timeout=30)
        finally:
            m.net.unblock(standby, [m.pg["pg1"]])
        m.start_controller(holder)  # its supervisor starts it again: it lands on pg2
        plan = await finish(m, tmp_path, plan_id, verbs)
        stop.set()

    print(f"{after['seat']['holder']} held epoch {after['seat']['epoch']} on pg2 {took:.1f}s "
          f"after the split; {holder} gave up {gave_up:.1f}s after; {verbs.answered} status "
          f"answered, the slowest in {verbs.worst:.2f}s")  # fmt: skip
    log = (tmp_path / f"{holder}.log").read_text()
    assert code == (1,), log[-3000:]
    assert f"{standby} holds epoch {after['seat']['epoch']} on the bus, above ours ({epoch})" in (
        log
    ), log[-3000:]
    assert after["seat"]["holder"] == standby
    assert verbs.failures == [], verbs.failures[:5]
    # The old holder's epoch never reached a host after the new holder's (assert_epochs_rise).
    await assert_finished_well(m, plan, applied, "pg2")
