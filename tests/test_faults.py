"""Fault tests (docs/design.md, issue 6): the holder SIGKILLed again and again during a plan, the
holder SIGSTOPped past the step-down bound and woken later, PostgreSQL and the nats-server
restarted during a plan. Real controllers, hosts, nats-server and PostgreSQL, no mocks; every
wait polls a condition with a deadline.

The store's history is checked with an audit trigger the tests add to their own database: every
committed write of a plan, a plan step, a declaration or the seat's row is recorded in commit
order (a fenced write holds the seat's row FOR SHARE until it commits, so a takeover's epoch
increment is ordered after it), with the epoch the writing transaction saw. "No two epochs do
plan work at once" then reads: every plan write carries the epoch of the last takeover before
it, never an older one. The `events` table (seat.taken, plan.*) must tell the same story.
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import anyio
import asyncpg
import msgspec
import nats
import pytest
from helpers import MESH, ask, await_until, kv_history, kv_keys
from test_plans import assert_tier_order, mesh, module, ok

from mesh import bus, wire
from mesh.embedded import natsd, pgauth, ports, postgres
from mesh.model import DeclarationReply
from mesh.modules.compose import encode, merge
from mesh.store import seats

KILLS = 20
DEADLINE = 10.0  # a logical request's deadline, as the command line's (retries within it)

AUDIT = """
CREATE TABLE fault_audit (
    id    bigserial PRIMARY KEY,
    tbl   text NOT NULL,
    what  text,
    epoch bigint,          -- the epoch the row was written with (plan_steps, declarations, seats)
    seat  bigint NOT NULL  -- the seat's epoch as the writing transaction saw it
);
CREATE FUNCTION fault_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fault_audit (tbl, what, epoch, seat) VALUES (
        TG_TABLE_NAME,
        concat_ws(' ', to_jsonb(NEW) ->> 'machine', to_jsonb(NEW) ->> 'state'),
        CASE WHEN TG_TABLE_NAME <> 'plans' THEN (to_jsonb(NEW) ->> 'epoch')::bigint END,
        (SELECT epoch FROM seats WHERE name = 'mesh-controller'));
    RETURN NULL;
END $$;
"""


async def install_audit(database_url: str) -> None:
    """Record every write from now on; the seat's current epoch is the first row."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            epoch = await conn.fetchval(
                "SELECT epoch FROM seats WHERE name = 'mesh-controller' FOR UPDATE"
            )
            await conn.execute(AUDIT)
            await conn.execute(
                "INSERT INTO fault_audit (tbl, epoch, seat) VALUES ('seats', $1, $1)", epoch
            )
            for table in ("seats", "plans", "plan_steps", "declarations"):
                await conn.execute(
                    f"CREATE TRIGGER fault_audit AFTER INSERT OR UPDATE ON {table}"
                    " FOR EACH ROW EXECUTE FUNCTION fault_audit()"
                )
    finally:
        await conn.close()


async def query(database_url: str, sql: str, *args):
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def assert_one_epoch_at_a_time(database_url: str) -> set[int]:
    """Every plan write (audit) and plan event carries the epoch of the takeover before it;
    epochs only rise. Returns the epochs that wrote plan steps."""
    audit = await query(database_url, "SELECT * FROM fault_audit ORDER BY id")
    seat = None
    for r in audit:
        if r["tbl"] == "seats":
            assert seat is None or r["epoch"] > seat, f"the epoch went back: {dict(r)}"
            seat = r["epoch"]
            continue
        assert r["seat"] == seat, f"a write saw epoch {r['seat']} after {seat} took: {dict(r)}"
        assert r["epoch"] in (None, seat), f"written with epoch {r['epoch']}: {dict(r)}"
    events = await query(
        database_url,
        "SELECT id, kind, epoch FROM events WHERE kind = 'seat.taken' OR kind LIKE 'plan.%'"
        " ORDER BY id",
    )
    taken = None
    for e in events:
        if e["kind"] == "seat.taken":
            assert taken is None or e["epoch"] > taken, f"seat.taken went back: {dict(e)}"
            taken = e["epoch"]
        else:
            assert e["epoch"] == taken, f"{e['kind']} by epoch {e['epoch']} under {taken}"
    return {r["epoch"] for r in audit if r["tbl"] == "plan_steps" and r["epoch"] is not None}


async def assert_kv_epochs_rise(nc) -> None:
    """In the declarations bucket's history, no key's epoch ever goes back."""
    kv = await nc.jetstream().key_value("mesh-declarations")
    for key in await kv_keys(kv):
        epochs = [json.loads(e.value)["epoch"] for e in await kv_history(kv, key) if e.value]
        assert epochs == sorted(epochs), f"{key}: declarations published with epochs {epochs}"


class Verbs:
    """Workers sending `status` continuously; each logical request is retried over "no
    responders" and timeouts until its own deadline, as the command line does (bus.request)."""

    def __init__(self) -> None:
        self.answered = 0
        self.failures: list[tuple[float, str]] = []  # (when the request started, why)
        self.worst = 0.0
        self.answers: list[list[tuple[float, str, int]]] = []  # per worker: (when, holder, epoch)

    async def run(self, nc, stop: anyio.Event, workers: int = 3) -> None:
        async def worker(seen: list[tuple[float, str, int]]) -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    data = await bus.request(
                        nc, "mesh.ctl.status", b"{}", deadline=started + DEADLINE,
                        attempt_timeout=1.0,
                    )  # fmt: skip
                except bus.NoAnswer as e:
                    self.failures.append((started, str(e)))
                    continue
                self.worst = max(self.worst, time.monotonic() - started)
                reply = json.loads(data)
                if "error" in reply or not reply.get("seat"):
                    self.failures.append((started, json.dumps(reply)))
                    continue
                self.answered += 1
                seen.append((time.monotonic(), reply["seat"]["holder"], reply["seat"]["epoch"]))
                await anyio.sleep(0.002)  # ok: pacing a steady client, not a wait

        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                self.answers.append([])
                tg.start_soon(worker, self.answers[-1])


async def status(nc) -> dict | None:
    s = await ask(nc, "mesh.ctl.status", timeout=1)
    return s if s and s.get("seat") else None


async def plan_of(nc, plan_id: int) -> dict | None:
    p = await ask(nc, "mesh.ctl.plan", {"id": plan_id}, timeout=1)
    return p if p and "steps" in p else None


def steps(plan: dict) -> dict[str, str]:
    return {s["machine"]: s["state"] for s in plan["steps"]}


async def fleet(nc, start_controller, start_host, tmp_path: Path, hosts: int) -> dict:
    """ctl-0 holding the seat, ctl-1 standing by, node-1..N in tiers 0, 1, 2; the controllers."""
    controllers = {"ctl-0": start_controller("ctl-0")}
    for i in range(hosts):
        start_host(f"node-{i + 1}", "--tier", str(min(i, 2)))

    async def up():
        s = await status(nc)
        return s if s and s["nodes"]["up"] == hosts else None

    await await_until(up, within=30, what=f"{hosts} hosts up")
    controllers["ctl-1"] = start_controller("ctl-1")
    await await_until(lambda: standing_by(nc, "ctl-1"), within=30, what="ctl-1 standing by")
    return controllers


async def standing_by(nc, instance: str) -> dict | None:
    s = await status(nc)
    return s if s and instance in [b["instance"] for b in s["standbys"]] else None


# --- SIGKILL --------------------------------------------------------------------------------------


async def test_the_holder_killed_twenty_times_during_a_plan(
    nc, nats_url, database_url, start_controller, start_host, tmp_path
) -> None:
    """Kill the holder 20 times while a three-tier plan rolls (each tier waits for a marker file,
    made after a third of the kills); a replacement starts after each kill so a standby exists.
    Every `status` is answered within its deadline, the plan finishes, and the store shows one
    epoch at a time doing plan work."""
    controllers = await fleet(nc, start_controller, start_host, tmp_path, hosts=3)
    roots = tmp_path / "hosts"
    await install_audit(database_url)
    source = module(tmp_path / "m", marker="ready", deadline="60s")
    plan_id = ok(mesh(nats_url, "push", str(source), "--json"))["plan"]
    markers = {KILLS // 3: "node-1", 2 * KILLS // 3: "node-2"}  # node-3's after the last kill

    async def wrote_plan_steps(epoch: int) -> bool:
        rows = await query(
            database_url,
            "SELECT 1 FROM fault_audit WHERE tbl = 'plan_steps' AND epoch = $1 LIMIT 1",
            epoch,
        )
        return bool(rows)

    killed: dict[str, int] = {}  # instance -> its epoch when killed
    newest = "ctl-1"
    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        for kill in range(KILLS):
            if kill in markers:
                (roots / markers[kill] / "ready").write_text("")

            async def ready_to_kill(kill=kill, newest=newest):
                """A live holder, the newest controller standing by, and (every other time)
                the holder has written plan steps under its epoch; else kill mid-takeover."""
                s = await standing_by(nc, newest)
                if s is None or s["seat"]["holder"] in killed:
                    return None
                if kill % 2 and not await wrote_plan_steps(s["seat"]["epoch"]):
                    return None
                return s

            s = await await_until(ready_to_kill, within=30, what=f"a holder to kill ({kill + 1})")
            plan = await plan_of(nc, plan_id)
            assert plan is not None and plan["state"] in ("pending", "rolling"), plan
            holder = s["seat"]["holder"]
            killed[holder] = s["seat"]["epoch"]
            os.kill(s["seat"]["pid"], signal.SIGKILL)
            assert controllers[holder].wait(timeout=10) == -signal.SIGKILL
            newest = f"ctl-{kill + 2}"
            controllers[newest] = start_controller(newest)

        (roots / "node-3" / "ready").write_text("")

        async def finished():
            p = await plan_of(nc, plan_id)
            return p if p and p["state"] not in ("pending", "rolling") else None

        plan = await await_until(finished, within=60, what="the plan to finish")
        answered = verbs.answered
        await await_until(lambda: _true(verbs.answered > answered + 20), within=DEADLINE,
                          what="answers after the plan")  # fmt: skip
        stop.set()

    print(f"{verbs.answered} status answered; the slowest took {verbs.worst:.2f}s")
    assert verbs.failures == [], verbs.failures[:5]
    assert plan["state"] == "done", plan
    assert steps(plan) == {"node-1": "done", "node-2": "done", "node-3": "done"}
    assert_tier_order(plan)

    # Answers never come from an older epoch than one already answered (no two holders answer).
    for seen in verbs.answers:
        epochs = [epoch for _, _, epoch in seen]
        assert epochs == sorted(epochs), "an answer from an older holder came after a newer one"
    holders = {holder for seen in verbs.answers for _, holder, _ in seen}
    assert len(holders) > KILLS // 2, holders  # the client saw the seat move, many times

    wrote = await assert_one_epoch_at_a_time(database_url)
    assert len(wrote) > KILLS // 2, f"plan steps written by epochs {sorted(wrote)} only"
    taken = await query(
        database_url, "SELECT epoch FROM events WHERE kind = 'seat.taken' ORDER BY id"
    )
    assert len(taken) == KILLS + 1  # ctl-0's, then one per kill
    await assert_kv_epochs_rise(nc)


# --- SIGSTOP --------------------------------------------------------------------------------------


async def test_a_paused_holder_loses_the_seat_and_its_late_writes_are_refused(
    nc, nats_url, database_url, start_controller, start_host, tmp_path
) -> None:
    """SIGSTOP the holder while tier 1 waits: the standby takes the seat while it is still
    paused (its lock's session is ended by the server's idle_session_timeout) and finishes the
    plan. SIGCONT: the old holder steps down without writing under its old epoch, and a host
    ignores a declaration published under that epoch."""
    controllers = await fleet(nc, start_controller, start_host, tmp_path, hosts=2)
    roots = tmp_path / "hosts"
    old = controllers["ctl-0"]
    await install_audit(database_url)
    source = module(tmp_path / "m", marker="ready", deadline="60s")
    plan_id = ok(mesh(nats_url, "push", str(source), "--json"))["plan"]
    (roots / "node-1" / "ready").write_text("")

    async def tier_1_waits():
        p = await plan_of(nc, plan_id)
        return p if p and steps(p) == {"node-1": "done", "node-2": "applying"} else None

    await await_until(tier_1_waits, within=30, what="tier 1 applying")
    before = await status(nc)
    assert before is not None and before["seat"]["holder"] == "ctl-0"
    epoch = before["seat"]["epoch"]

    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        os.kill(old.pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:

            async def taken_over():
                s = await status(nc)
                return s if s and s["seat"]["holder"] == "ctl-1" else None

            after = await await_until(taken_over, within=30, what="ctl-1 to take the seat")
            print(f"the standby held the seat {time.monotonic() - paused:.1f}s after SIGSTOP")
            assert after["seat"]["epoch"] > epoch
            assert old.poll() is None  # still there, still paused

            # The plan goes on under the new holder while the old one sleeps.
            (roots / "node-2" / "ready").write_text("")

            async def done():
                p = await plan_of(nc, plan_id)
                return p if p and p["state"] == "done" else None

            await await_until(done, within=30, what="the plan to finish under ctl-1")
        finally:
            os.kill(old.pid, signal.SIGCONT)
        woke = time.monotonic()

        # Woken, the old holder finds its session gone and steps down.
        code = await await_until(lambda: _exited(old), within=20, what="ctl-0 to step down")
        gone = time.monotonic()
        answered = verbs.answered
        await await_until(lambda: _true(verbs.answered > answered + 20), within=DEADLINE,
                          what="answers after ctl-0 stepped down")  # fmt: skip
        stop.set()

    print(f"{verbs.answered} status answered, {len(verbs.failures)} not within {DEADLINE:g}s;"
          f" the slowest took {verbs.worst:.2f}s")  # fmt: skip
    log = old.log_path.read_text()
    assert code == (1,), log[-2000:]
    assert "the seat's store session failed" in log or "this controller holds" in log, log
    assert "Traceback" not in log, log[-3000:]
    # While paused, the old holder stays in the verb queue group until the nats-server drops
    # it for not answering its pings, so a request may miss its deadline then; once it is
    # gone, every request is answered.
    late = [why for started, why in verbs.failures if started >= gone]
    assert late == [], late[:5]
    stale = [
        (round(t - woke, 2), holder, e)
        for seen in verbs.answers
        for t, holder, e in seen
        if t > woke and e == epoch
    ]
    assert stale == [], f"the paused holder answered after it woke: {stale[:5]}"

    # The store: nothing written under the old epoch after the new one took the seat. (Woken,
    # the old holder usually finds its session gone before its planner tries a write; a write
    # it tries is refused by the fence below, which every plan write goes through.)
    wrote = await assert_one_epoch_at_a_time(database_url)
    assert wrote >= {epoch, after["seat"]["epoch"]}, wrote
    conn = await asyncpg.connect(database_url)
    try:
        with pytest.raises(seats.Fenced, match=f"this controller holds {epoch}\\b"):
            async with conn.transaction():
                await seats.fence(conn, epoch=epoch)
                await conn.execute("UPDATE plan_steps SET state = 'failed', epoch = $1", epoch)
        states = await conn.fetch("SELECT state FROM plan_steps")
    finally:
        await conn.close()
    assert [r["state"] for r in states] == ["done", "done"]
    await assert_kv_epochs_rise(nc)
    kv = await nc.jetstream().key_value("mesh-declarations")
    for machine in ("node-1", "node-2"):  # republished by the new holder, under its epoch
        assert json.loads((await kv.get(machine)).value)["epoch"] == after["seat"]["epoch"]

    # A declaration published late under the old epoch (here: the old holder taking node-1's
    # process away) is ignored by the host, which says so.
    nodes = {n["name"]: n for n in (await ask(nc, "mesh.ctl.nodes"))["nodes"]}
    applied = nodes["node-1"]["digest_applied"]
    running = {p["name"]: p["pid"] for p in (await ask(nc, "mesh.host.node-1.status"))["processes"]}
    assert list(running) == ["gated"], running
    body, digest = encode(merge("node-1", []))
    late = DeclarationReply(
        machine="node-1", digest=digest, epoch=epoch, declaration=msgspec.Raw(body)
    )
    events = await nc.subscribe("mesh.event.node-1.applied")
    await kv.put("node-1", wire.encode(late))
    report = json.loads((await events.next_msg(timeout=15)).data)
    assert (report["ok"], report["step"], report["digest"]) == (False, "fence", digest), report
    assert f"epoch {epoch} is older" in report["error"]
    host = await ask(nc, "mesh.host.node-1.status")
    assert host["applied"] == applied
    # Its process kept, the very same one (its health is its check's, which a loaded machine
    # can make miss a beat: not what this asserts).
    assert [(p["name"], p["pid"], p["state"]) for p in host["processes"]] == [
        ("gated", running["gated"], "running")
    ], host["processes"]


# --- restarts -------------------------------------------------------------------------------------


class Servers:
    """A PostgreSQL and a nats-server of this test's own, each restartable on the same port
    with its data kept (JetStream on disk with sync_interval: always)."""

    def __init__(self, procs, tmp_path: Path) -> None:
        self._procs = procs
        # Not under pytest's folder, which is private to root (see conftest's pg_admin_url).
        self.pg_folder = Path(tempfile.mkdtemp(prefix="mesh-test-pg-"))
        self.pg_data = self.pg_folder / "data"
        self.pg_port = ports.free_port()
        self.nats_port = ports.free_port()
        self.nats_conf = natsd.write_config(tmp_path / "bus", port=self.nats_port)
        self.pg: subprocess.Popen | None = None
        self.nats: subprocess.Popen | None = None
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.passwords = pgauth.Passwords(self.pg_folder / "passwords")
        self.superuser = self.passwords.of(postgres.PG_USER)
        self.database_url = postgres.url(  # the controllers' role, as `mesh dev up` gives it
            self.pg_port, "mesh", user=postgres.CONTROLLER_USER,
            password=self.passwords.of(postgres.CONTROLLER_USER),
        )  # fmt: skip

    async def start_postgres(self) -> None:
        await anyio.to_thread.run_sync(
            lambda: postgres.init(self.pg_data, passwords=self.passwords)
        )
        self.pg = self._procs.start(
            "postgres", postgres.argv(self.pg_data, port=self.pg_port), cwd=self.pg_data,
            **postgres.run_as(),
        )  # fmt: skip
        pg = self.pg
        await postgres.wait_ready(
            self.pg_port, password=self.superuser, deadline=30, alive=lambda: pg.poll() is None
        )
        await postgres.ensure_store(self.pg_port, database="mesh", passwords=self.passwords)

    def stop_postgres(self) -> None:
        assert self.pg is not None
        self.pg.send_signal(signal.SIGINT)  # fast shutdown: every session is ended
        self.pg.wait(timeout=30)

    async def start_nats(self) -> None:
        self.nats = self._procs.start("nats-server", natsd.argv(self.nats_conf))

        async def listening():
            assert self.nats is not None
            assert self.nats.poll() is None, "nats-server exited"
            try:
                conn = await nats.connect(self.nats_url, allow_reconnect=False)
            except Exception:
                return False
            await conn.close()
            return True

        await await_until(listening, within=15, what="nats-server to listen")

    def kill_nats(self) -> None:
        assert self.nats is not None
        self.nats.kill()  # a crash: JetStream recovers its files at the next start
        self.nats.wait(timeout=10)

    def stop(self) -> None:
        for proc in (self.pg, self.nats):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(self.pg_folder, ignore_errors=True)


@pytest.fixture
async def servers(procs, tmp_path):
    s = Servers(procs, tmp_path)
    try:
        await s.start_postgres()
        await s.start_nats()
        yield s
    finally:
        s.stop()


async def test_the_mesh_recovers_from_restarts_of_postgres_and_nats_during_a_plan(
    servers, procs, tmp_path
) -> None:
    """Tier 1 waits: restart PostgreSQL (every session ends: the holder steps down, the standby
    reconnects and takes the seat). Tier 2 waits: kill and restart the nats-server. Each time a
    holder answers again and the plan goes on to the end."""
    env = {"MESH_NATS_URL": servers.nats_url, "MESH_DATABASE_URL": servers.database_url}
    roots = tmp_path / "hosts"

    def controller(name: str) -> subprocess.Popen:
        return procs.start(name, [*MESH, "controller", "run", "--instance", name], env=env)

    def host(name: str, tier: int) -> subprocess.Popen:
        argv = [*MESH, "host", "run", "--name", name, "--root", str(roots / name), "--tier",
                str(tier), "--beat", "0.5"]  # fmt: skip
        return procs.start(name, argv, env={"MESH_NATS_URL": servers.nats_url})

    nc = await nats.connect(servers.nats_url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        controllers = {"ctl-0": controller("ctl-0")}
        for i in range(3):
            host(f"node-{i + 1}", i)

        async def up():
            s = await status(nc)
            return s if s and s["nodes"]["up"] == 3 else None

        await await_until(up, within=30, what="three hosts up")
        controllers["ctl-1"] = controller("ctl-1")
        await await_until(lambda: standing_by(nc, "ctl-1"), within=30, what="ctl-1 standing by")
        await install_audit(servers.database_url)
        source = module(tmp_path / "m", marker="ready", deadline="60s")
        plan_id = ok(mesh(servers.nats_url, "push", str(source), "--json"))["plan"]
        (roots / "node-1" / "ready").write_text("")

        async def waiting_in(machine: str):
            p = await plan_of(nc, plan_id)
            return p if p and p["state"] == "rolling" and steps(p)[machine] == "applying" else None

        await await_until(lambda: waiting_in("node-2"), within=30, what="tier 1 applying")
        before = await status(nc)
        assert before is not None

        # 1. PostgreSQL restarts.
        servers.stop_postgres()
        await servers.start_postgres()

        async def new_holder(above: int):
            s = await status(nc)
            return s if s and s["seat"]["epoch"] > above else None

        after_pg = await await_until(lambda: new_holder(before["seat"]["epoch"]), within=30,
                                     what="a holder after PostgreSQL restarted")  # fmt: skip
        print(f"after PostgreSQL restarted: {after_pg['seat']['holder']} holds")
        old = controllers[before["seat"]["holder"]]
        code = await await_until(lambda: _exited(old), within=15, what="the old holder to stop")
        assert code == (1,)
        log = old.log_path.read_text()
        # Its own ping finds the session gone, or the bus shows the new holder's higher epoch
        # first (services/controller/epochs.py): either way it stops.
        assert "the seat's store session failed" in log or "above ours" in log, log[-2000:]
        controllers["ctl-2"] = controller("ctl-2")  # what its supervisor would do
        (roots / "node-2" / "ready").write_text("")
        await await_until(lambda: waiting_in("node-3"), within=30, what="tier 2 applying")

        async def applied(machine: str):
            h = await ask(nc, f"mesh.host.{machine}.status", timeout=1)
            p = await plan_of(nc, plan_id)
            step = next(s for s in p["steps"] if s["machine"] == machine) if p else None
            return h if h and step and h["applied"] == step["after"] else None

        await await_until(lambda: applied("node-3"), within=30, what="node-3 applied")

        # 2. The nats-server crashes and comes back on the same port, with its data.
        servers.kill_nats()
        await servers.start_nats()
        (roots / "node-3" / "ready").write_text("")

        async def finished():
            p = await plan_of(nc, plan_id)
            return p if p and p["state"] not in ("pending", "rolling") else None

        plan = await await_until(finished, within=60, what="the plan to finish")
        assert plan["state"] == "done", plan
        assert steps(plan) == {"node-1": "done", "node-2": "done", "node-3": "done"}
        assert_tier_order(plan)
        s = await status(nc)
        assert s is not None and s["nodes"]["up"] == 3
        print(f"after nats-server restarted: {s['seat']['holder']} holds, epoch "
              f"{s['seat']['epoch']}")  # fmt: skip
        await assert_one_epoch_at_a_time(servers.database_url)
        await assert_kv_epochs_rise(nc)
    finally:
        await nc.close()


async def _exited(proc):
    code = proc.poll()
    return None if code is None else (code,)  # a tuple, so that exit code 0 is truthy too


async def _true(value: bool) -> bool:
    return value
