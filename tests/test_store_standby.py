"""A store with a standby (issue 14): a primary and a synchronous streaming standby from the
embedded binaries, the multi-host URL that always lands on the primary (whichever order, and
after a promotion), the replication check's warning, and `mesh dev up --store-standby`.

Real processes throughout; every one is stopped at teardown, even when a test fails."""

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import asyncpg
import pytest
from helpers import DevUp, await_until, env_file, mesh_cli, wait_until
from standby import Pair, promote, start_pair, sync_pair

from mesh.embedded import postgres
from mesh.store import db, replication

pytestmark = pytest.mark.slow


async def _server_of(conn: asyncpg.Connection) -> tuple[int, bool]:
    port = int(await conn.fetchval("SELECT current_setting('port')"))
    return port, await conn.fetchval("SELECT pg_is_in_recovery()")


async def test_the_standby_streams_synchronously(open_dir: Path, pairs: list[Pair]) -> None:
    pair = await sync_pair(open_dir, pairs)
    conn = await asyncpg.connect(pair.admin(pair.primary_port))
    try:
        row = await conn.fetchrow(
            "SELECT application_name, state, sync_state FROM pg_stat_replication"
        )
        assert (row["application_name"], row["state"], row["sync_state"]) == (
            postgres.STANDBY_NAME, "streaming", "sync",
        )  # fmt: skip
        # A commit on the primary waits for the standby: it is there as soon as it returns.
        await conn.execute("CREATE TABLE marks (n int)")
        await conn.execute("INSERT INTO marks VALUES (1)")
    finally:
        await conn.close()
    standby = await asyncpg.connect(pair.admin(pair.standby_port))
    try:
        assert await standby.fetchval("SELECT pg_is_in_recovery()")
        assert await standby.fetchval("SELECT count(*) FROM marks") == 1
    finally:
        await standby.close()


async def test_the_multi_host_url_reaches_the_primary_whichever_order(
    open_dir: Path, pairs: list[Pair]
) -> None:
    pair = await sync_pair(open_dir, pairs)
    for order in ((pair.primary_port, pair.standby_port), (pair.standby_port, pair.primary_port)):
        url = pair.url(*order)
        conn = await db.connect(url)
        try:
            assert await _server_of(conn) == (pair.primary_port, False), url
            await conn.execute("SELECT pg_advisory_lock(1); SELECT pg_advisory_unlock(1)")
        finally:
            await conn.close()
        pool = await db.pool(url, size=2)
        try:
            async with pool.acquire() as conn:
                assert await _server_of(conn) == (pair.primary_port, False), url
        finally:
            await pool.close()
    # The standby's session was closed, not kept: only the walreceiver's remains on it.
    standby = await asyncpg.connect(pair.admin(pair.standby_port))
    try:
        others = await standby.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'mesh'"
        )
        assert others == 0
    finally:
        await standby.close()
    # Nothing writable: every server tried is named, and why each was refused.
    dead = postgres.free_port()
    with pytest.raises(db.StoreUnreachable) as refused:
        await db.connect(pair.url(pair.standby_port, dead), timeout=3)
    message = str(refused.value)
    assert f"127.0.0.1:{pair.standby_port}: a read-only server" in message, message
    assert f"127.0.0.1:{dead}: " in message, message
    assert "password" not in db._where("postgresql://u:secret@h1,h2/mesh?password=x&a=b")
    assert "secret" not in db._where("postgresql://u:secret@h1,h2/mesh?password=x&a=b")


async def test_after_a_promotion_the_same_url_reaches_the_new_primary(
    open_dir: Path, pairs: list[Pair]
) -> None:
    pair = await sync_pair(open_dir, pairs)
    url = pair.url(pair.primary_port, pair.standby_port)
    conn = await db.connect(url)
    try:
        await conn.execute("CREATE TABLE marks (n int); INSERT INTO marks VALUES (1)")
    finally:
        await conn.close()
    pair.primary.proc.kill()  # the primary dies; the HA manager promotes the standby
    await pair.primary.proc.wait()
    promote(open_dir / "pg-standby")
    conn = await db.connect(url)
    try:
        assert await _server_of(conn) == (pair.standby_port, False)
        # Synchronously replicated: what the old primary acknowledged is there.
        assert await conn.fetchval("SELECT count(*) FROM marks") == 1
        # The promoted server waits for no standby of its own: a write succeeds at once.
        await asyncio.wait_for(conn.execute("INSERT INTO marks VALUES (2)"), timeout=10)
        assert await conn.fetchval("SELECT count(*) FROM marks") == 2
    finally:
        await conn.close()


async def test_the_replication_check_warns_about_an_asynchronous_standby(
    open_dir: Path, pairs: list[Pair]
) -> None:
    sync = await sync_pair(open_dir / "sync", pairs)
    conn = await db.connect(sync.url(sync.standby_port, sync.primary_port))
    try:
        said = await replication.check(conn)
    finally:
        await conn.close()
    assert said.warning is None, said
    assert said.synchronous_standby_names == postgres.STANDBY_NAME
    assert said.standbys == [replication.Standby(postgres.STANDBY_NAME, "streaming", "sync")]

    lax = await start_pair(open_dir / "async", synchronous=False)
    pairs.append(lax)

    async def streaming() -> replication.Replication | None:
        pool = await db.pool(lax.url(lax.primary_port), size=1)  # as the controllers
        try:
            said = await replication.check(pool)  # a pool answers as well as a session
        finally:
            await pool.close()
        return said if said.standbys and said.standbys[0].state == "streaming" else None

    said = await await_until(streaming, within=60, what="the asynchronous standby streaming")
    assert said.standbys[0].sync_state == "async"
    assert said.warning and "without synchronous replication" in said.warning, said
    assert postgres.STANDBY_NAME in said.warning

    # Connected to a standby itself: said too.
    conn = await asyncpg.connect(lax.admin(lax.standby_port))
    try:
        said = await replication.check(conn)
    finally:
        await conn.close()
    assert said.in_recovery and said.warning and "read-only standby" in said.warning


# --- mesh dev up --store-standby ----------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _epoch(url: str, creds: str) -> int:
    done = mesh_cli("--json", "status", nats_url=url, creds=creds, timeout=20)
    seat = json.loads(done.stdout).get("seat") if done.returncode == 0 else None
    return seat["epoch"] if seat else 0


def _postgres_line(dev: DevUp, role: str, data: Path) -> tuple[int, int]:
    line = dev.wait_for(f"postgres {role} up on ", within=120)
    m = re.fullmatch(rf"postgres {role} up on 127\.0\.0\.1:(\d+) \(data in (.+), pid (\d+)\), "
                     r"TLS only .*", line)  # fmt: skip
    assert m and m.group(2) == str(data), line
    return int(m.group(1)), int(m.group(3))


def test_dev_up_with_a_store_standby(open_dir: Path) -> None:
    dir = open_dir / "dev"
    for run in (1, 2):  # the second on the same folder: the standby comes back
        dev = DevUp(dir, "--store-standby", hosts=1)
        try:
            primary, primary_pid = _postgres_line(dev, "primary", dir.resolve() / "pg")
            standby, standby_pid = _postgres_line(dev, "standby", dir.resolve() / "pg-standby")
            url = dev.wait_for("ready ", within=120).split()[1]
            copied = any(line.startswith("copying the primary") for line in dev.seen)
            assert copied == (run == 1), dev.seen
            assert not any(line.startswith("postgres up on") for line in dev.seen)
            env = env_file(dir)
            password = (dir / "creds" / "store" / "mesh.password").read_text().strip()
            assert env["MESH_DATABASE_URL"] == (  # the controllers' role, not the superuser
                f"postgresql://mesh:{password}@127.0.0.1:{primary},127.0.0.1:{standby}/mesh"
                "?target_session_attrs=read-write&sslmode=verify-full"
                f"&sslrootcert={dir.resolve() / 'tls' / 'ca.pem'}"
            )
            done = mesh_cli("--json", "status", nats_url=url, creds=env["MESH_CREDS"])
            assert done.returncode == 0, done.stderr
            epoch = json.loads(done.stdout)["seat"]["epoch"]
            if run == 2:  # the primary dies, the standby is promoted: the mesh answers on
                os.kill(primary_pid, signal.SIGKILL)
                promote(dir / "pg-standby")
                wait_until(
                    lambda u=url, c=env["MESH_CREDS"], e=epoch: _epoch(u, c) > e,
                    within=60, what="a holder on the promoted standby",
                )  # fmt: skip
            dev.proc.send_signal(signal.SIGTERM)
            dev.wait_for("stopped", within=90)
            assert dev.proc.wait(timeout=30) == 0
            wait_until(
                lambda p=primary_pid, s=standby_pid: _gone(p) and _gone(s),
                within=30, what="both PostgreSQL servers stopped",
            )  # fmt: skip
        finally:
            dev.kill()
