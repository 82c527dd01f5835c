"""What the fault tests share (tests/test_faults.py, test_network.py, test_store_faults.py): a
status client asking throughout a fault, the store's audit of every write with the epoch
invariants read from it, and a plan followed to a step or to its end.

The audit is a trigger a test adds to its own database: every committed write of a plan, a plan
step, a declaration or the seat's row is recorded in commit order (a fenced write holds the
seat's row FOR SHARE until it commits, so a takeover's epoch increment is ordered after it),
with the epoch the writing transaction saw. "No two epochs do plan work at once" then reads:
every plan write carries the epoch of the last takeover before it, never an older one. The
`events` table (seat.taken, plan.*) must tell the same story.
"""

import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import anyio
import asyncpg
import nats
import pytest
from helpers import already, ask, await_until, held_status, js, kv_history, kv_keys

from mesh import bus
from mesh.embedded import natsd, pgauth, ports, postgres

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
    kv = await js(nc).key_value("mesh-declarations")
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

    async def answers_after(self, what: str) -> None:
        """Twenty more answers from now, within one request's deadline."""
        answered = self.answered
        await await_until(lambda: already(self.answered > answered + 20), within=DEADLINE,
                          what=what)  # fmt: skip


async def plan_of(nc, plan_id: int) -> dict | None:
    p = await ask(nc, "mesh.ctl.plan", {"id": plan_id}, timeout=1)
    return p if p and "steps" in p else None


def steps(plan: dict) -> dict[str, str]:
    return {s["machine"]: s["state"] for s in plan["steps"]}


async def finished(nc, plan_id: int, *, within: float) -> dict:
    """The plan once it is no longer pending or rolling."""

    async def done():
        p = await plan_of(nc, plan_id)
        return p if p and p["state"] not in ("pending", "rolling") else None

    return await await_until(done, within=within, what="the plan to finish")


async def waiting_in(nc, plan_id: int, machine: str, *, within: float = 60) -> dict:
    """The plan once it rolls and `machine`'s step is applying."""

    async def applying():
        p = await plan_of(nc, plan_id)
        return p if p and p["state"] == "rolling" and steps(p)[machine] == "applying" else None

    return await await_until(applying, within=within, what=f"{machine}'s step applying")


async def holder_above(nc, epoch: int, *, within: float = 60) -> dict:
    """`status` once a holder answers with an epoch above `epoch`."""

    async def above():
        s = await held_status(nc)
        return s if s and s["seat"]["epoch"] > epoch else None

    return await await_until(above, within=within, what=f"a holder above epoch {epoch}")


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
