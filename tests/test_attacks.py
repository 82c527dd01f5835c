"""Issue 25: the attacks on `mesh dev up` that got through, each done again the way the attacker
did it, with that piece's real credentials against the real servers; each must be refused or
harmless now. One section per hole."""

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from helpers import DevUp, await_until, mesh_cli

from mesh.embedded import ports, postgres
from mesh.store import db
from mesh.store.migrate import migrate

# --- the store ----------------------------------------------------------------------------------
# Row 5: the embedded PostgreSQL trusted loopback, so any account on the control machine (every
# module's account is one) connected as the superuser, read every secret and ran programs as
# `mesh-postgres` (`COPY … TO PROGRAM`).

SECRETS = "select name, convert_from(value, 'UTF8') from secrets"  # what the attack read


@pytest.fixture
def store_dir() -> Iterator[Path]:
    # Not under pytest's folder, which a starting session makes private (0700) again: the
    # server runs as its own account (as root) and must keep reaching its data.
    path = Path(tempfile.mkdtemp(prefix="mesh-test-attack-store-"))
    yield path / "dev"
    shutil.rmtree(path, ignore_errors=True)


def _exported(folder: Path) -> dict[str, str]:
    """What `source DIR/env` exports."""
    exported = {}
    for line in (folder / "env").read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        exported[name] = shlex.split(value)[0]
    return exported


def _port(url: str) -> int:
    return int(url.rsplit("@", 1)[1].split("/")[0].rsplit(":", 1)[1])


async def _refused(url: str) -> str:
    """The server's refusal of a connection to `url` (the test fails if it lets it in)."""
    try:
        conn = await asyncpg.connect(url, timeout=10)
    except asyncpg.InvalidAuthorizationSpecificationError as e:  # 28000, 28P01
        return str(e)
    await conn.close()
    pytest.fail(f"PostgreSQL let {db._where(url)} in")


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True,
                          text=True, timeout=30, cwd="/")  # fmt: skip


@pytest.mark.slow
async def test_the_store_refuses_local_accounts_and_its_role_is_no_superuser(
    store_dir: Path,
) -> None:
    dev = DevUp(store_dir, hosts=0)
    try:
        url = dev.ready()
        done = mesh_cli("secret", "set", "hello-token", "--from-file", "/etc/hostname",
                        nats_url=url, creds=str(store_dir / "creds" / "admin.creds"))  # fmt: skip
        assert done.returncode == 0, done.stderr
        controllers = _exported(store_dir)["MESH_DATABASE_URL"]
        port = _port(controllers)

        # What the attack did: the superuser, and the controllers' role, without a password
        # or with a wrong one.
        for user in ("postgres", "mesh"):
            said = await _refused(f"postgresql://{user}@127.0.0.1:{port}/mesh")
            assert "password authentication failed" in said, said
            await _refused(f"postgresql://{user}:not-the-password@127.0.0.1:{port}/mesh")

        # The controllers' role, with its real password (the credential file, as DIR/env and
        # the controllers have it): it owns the mesh's tables and nothing more.
        password = (store_dir / "creds" / "store" / "mesh.password").read_text().strip()
        assert controllers == f"postgresql://mesh:{password}@127.0.0.1:{port}/mesh"
        marker = store_dir.parent / "copy-to-program-ran"
        conn = await asyncpg.connect(controllers)
        try:
            assert await conn.fetchval("select count(*) from secrets") == 1
            assert await conn.fetchval(
                "select rolsuper or rolcreaterole or rolcreatedb or rolreplication "
                "from pg_roles where rolname = current_user"
            ) is False  # fmt: skip
            for sql in (
                f"COPY (select 1) TO PROGRAM 'touch {marker}'",
                "select * from pg_authid",
                "CREATE ROLE intruder SUPERUSER LOGIN PASSWORD 'x'",
                "ALTER ROLE mesh SUPERUSER",
                "select pg_read_file('postgresql.conf')",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(sql)
        finally:
            await conn.close()
        assert not marker.exists()

        # The files that hold the passwords are their owner's alone.
        for path in (store_dir / "env", *(store_dir / "creds" / "store").iterdir()):
            assert os.stat(path).st_mode & 0o777 == 0o600, path
        assert os.stat(store_dir / "creds" / "store").st_mode & 0o777 == 0o700

        if os.geteuid() == 0:
            # As the issue showed it: another account of the machine, with psql.
            psql = postgres.bin("psql")
            for user in ("postgres", "mesh"):
                read = _as_nobody(psql, "-w", f"postgresql://{user}@127.0.0.1:{port}/mesh",
                                  "-Atc", SECRETS)  # fmt: skip
                assert read.returncode != 0 and "hello-token" not in read.stdout, read
                assert "no password supplied" in read.stderr, read.stderr
            for path in (store_dir / "env", store_dir / "creds" / "store" / "postgres.password"):
                peek = _as_nobody("cat", str(path))
                assert peek.returncode != 0 and "Permission denied" in peek.stderr, peek

        dev.stop()
    finally:
        dev.kill()


@pytest.mark.slow
async def test_a_store_an_older_mesh_made_with_trust_is_converted_not_broken(
    store_dir: Path,
) -> None:
    """What an older mesh left in DIR/pg: a cluster that trusts loopback, the schema made by
    the superuser, a secret in it. `mesh dev up` on that folder says it converts it, and then
    the superuser is refused without a password while the controllers (a role of their own
    now) hold the seat and read what was there."""
    data = store_dir / "pg"
    postgres.init_folder(data)
    made = subprocess.run(
        [postgres.bin("initdb"), "-D", str(data), "--auth=trust", "--username=postgres",
         "--encoding=UTF8", "--no-instructions"],
        capture_output=True, text=True, cwd=data, **postgres.run_as(),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    port = ports.free_port()
    server = subprocess.Popen(
        postgres.argv(data, port=port), cwd=data, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, **postgres.run_as(),
    )  # fmt: skip
    trusted = f"postgresql://postgres@127.0.0.1:{port}"
    try:

        async def answers() -> bool:
            assert server.poll() is None, "the old cluster's server exited"
            try:
                conn = await asyncpg.connect(f"{trusted}/postgres", timeout=2)
            except (OSError, asyncpg.PostgresError, TimeoutError):
                return False
            await conn.close()
            return True

        await await_until(answers, within=30, what="the old cluster to answer")
        conn = await asyncpg.connect(f"{trusted}/postgres")
        await conn.execute('CREATE DATABASE "mesh"')
        await conn.close()
        conn = await asyncpg.connect(f"{trusted}/mesh")  # no password: what trust allowed
        try:
            await migrate(conn)
            await conn.execute(
                "INSERT INTO secrets (name, value, version) VALUES ('hello-token', 's3cret', 1)"
            )
        finally:
            await conn.close()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)

    dev = DevUp(store_dir, hosts=0)
    try:
        url = dev.ready()
        said = [line for line in dev.seen if "converted to passwords only" in line]
        assert len(said) == 1 and str(data) in said[0], dev.seen
        port = _port(_exported(store_dir)["MESH_DATABASE_URL"])
        await _refused(f"postgresql://postgres@127.0.0.1:{port}/mesh")
        status = mesh_cli("status", nats_url=url, creds=str(store_dir / "creds" / "admin.creds"))
        assert status.returncode == 0 and "held by ctl-" in status.stdout, status
        conn = await asyncpg.connect(_exported(store_dir)["MESH_DATABASE_URL"])
        try:
            assert await conn.fetch(SECRETS) == [("hello-token", "s3cret")]
            owners = await conn.fetch(
                "select distinct tableowner from pg_tables where schemaname = 'public'"
            )
            assert [r[0] for r in owners] == ["mesh"]
        finally:
            await conn.close()
        dev.stop()
    finally:
        dev.kill()
