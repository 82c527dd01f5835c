"""`mesh init` on this machine, as a user runs it: a new mesh whose controller is a process from
the start (never a container), answering `mesh status` with the printed environment."""

import asyncio
import json
import os
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import asyncpg
import pytest
from cryptography import x509
from helpers import MESH, account_of

from mesh.auth import creds, tls

# its hosts deploy services/controller (helpers.seeds_container)
pytestmark = pytest.mark.deploys_controller


def test_init_makes_a_mesh_whose_controller_is_a_process(made) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    done = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0", "--name", "ctl-machine"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"source {made.resolve()}/env" in done.stdout
    assert "mesh machine add NAME" in done.stdout

    # As the user is told: source the env file, then `mesh status`.
    for line in (made / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    status = subprocess.run(
        [*MESH, "--json", "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert status.returncode == 0, status.stderr
    seat = json.loads(status.stdout)["seat"]
    assert seat["holder"].startswith("ctl-machine-")  # the process, not mesh-init
    if os.geteuid() == 0:
        assert account_of(seat["pid"]) == "mesh-controller"
    # The controller process has the system account's kicker as a file, so a new holder can
    # close a cut-off holder's connection (services/controller/module.toml).
    environ = (Path("/proc") / str(seat["pid"]) / "environ").read_bytes().split(b"\0")
    files = dict(e.decode().split("=", 1) for e in environ if b"=" in e)["MESH_FILES"]
    assert "BEGIN USER NKEY SEED" in (Path(files) / "system.creds").read_text()
    handover = json.loads(status.stdout)["handover"]
    assert handover["from"] == "mesh-init" and handover["planned"] is True

    # A second init on the same folder is refused, in one line.
    again = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert again.returncode == 1 and "already holds a mesh" in again.stderr
    assert "Traceback" not in again.stderr


def _env_of(folder: Path, base: dict[str, str]) -> dict[str, str]:
    """`base` with FOLDER/env sourced, as the user is told to."""
    env = dict(base)
    for line in (folder / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    return env


def _names(cert: Path) -> list[str]:
    return tls.names(x509.load_pem_x509_certificate(cert.read_bytes()))


def _tls_after_info(host: str, port: int, context: ssl.SSLContext, name: str) -> None:
    """A NATS client's TLS handshake at HOST:PORT (the server's INFO line first, in plaintext),
    checking the server's certificate as `context` does against `name`."""
    with socket.create_connection((host, port), timeout=10) as raw:
        info = b""
        while not info.endswith(b"\r\n"):
            info += raw.recv(1)
        assert info.startswith(b"INFO ") and b'"tls_required":true' in info
        with context.wrap_socket(raw, server_hostname=name):
            pass


def test_init_address_serves_other_machines(made: Path, open_dir: Path) -> None:
    """`--address`: every server listens there too and is certified for it, and every URL
    written names it, so a credentials file alone, copied anywhere, reaches the mesh."""
    address = "127.0.0.2"  # Linux routes all of 127/8 to lo: an address of this machine's own
    try:
        with socket.socket() as s:
            s.bind((address, 0))
    except OSError as e:
        pytest.skip(f"{address} cannot be bound here: {e}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_") or k == "MESH_PORTS"}
    done = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0", "--name", "ctl-addr", "--nats", "2",
         "--address", address, "--print-units"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    assert "ignoring" not in done.stdout  # nothing of another mesh's here

    # Every URL written names the address, each server once: the folder's, DIR/env's, and the
    # one every credentials file carries.
    url = (made / "nats" / "url").read_text().strip()
    servers = url.split(",")
    assert len(servers) == 2 and all(s.startswith(f"tls://{address}:") for s in servers), url
    mine = _env_of(made, env)
    assert mine["MESH_NATS_URL"] == url
    assert f"@{address}:" in mine["MESH_DATABASE_URL"]
    for name in ("admin", "viewer", "controller"):
        assert creds.read(made / "creds" / f"{name}.creds").servers == url
    assert creds.read(made / "creds" / "hosts" / "ctl-addr.creds").servers == url

    # The certificates name the address besides loopback: both nats-servers' (their routes
    # dial the address, each checking the other: the cluster formed, or init would not have
    # ended) and the store's front's.
    for cert in (made / "nats/n1/server.pem", made / "nats/n2/server.pem", made / "pg/server.crt"):
        assert {address, "127.0.0.1", "localhost"} <= set(_names(cert)), cert

    # A credentials file copied elsewhere, with nothing else: no MESH_* at all, another
    # folder. The client takes the URL and the CA from the file and checks the server by them.
    copied = open_dir / "elsewhere" / "admin.creds"
    copied.parent.mkdir()
    shutil.copy(made / "creds" / "admin.creds", copied)
    bare = {k: v for k, v in env.items() if not k.startswith("MESH_")}
    status = subprocess.run(
        [*MESH, "--json", "--creds", str(copied), "status"],
        capture_output=True, text=True, timeout=60, env=bare, cwd=copied.parent,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["seat"]["holder"].startswith("ctl-addr-")

    # Checked against the mesh's CA and the address: a handshake naming another address fails.
    host, port = servers[0].removeprefix("tls://").rsplit(":", 1)
    context = tls.client_context(cafile=str(made / "tls" / "ca.pem"))
    _tls_after_info(host, int(port), context, address)
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_after_info(host, int(port), context, "127.0.0.3")

    # The store, at the address, on TLS checked against the CA (verify-full), with the URL as
    # DIR/env gives it.
    async def store_answers() -> int:
        conn = await asyncpg.connect(mine["MESH_DATABASE_URL"], timeout=30)
        try:
            return await conn.fetchval("SELECT 1")
        finally:
            await conn.close()

    assert asyncio.run(store_answers()) == 1


def test_init_ignores_another_meshs_settings(made: Path, open_dir: Path) -> None:
    """With a `mesh dev up`'s DIR/env sourced (another CA, URL, credentials, folder, store),
    `mesh init` says what it ignores and makes its own mesh, whose pieces never see them."""
    other = open_dir / "other"
    other_ca = tls.ensure_ca(other / "tls")
    another = {
        "MESH_CA": str(other_ca),
        "MESH_NATS_URL": "tls://127.0.0.1:4222",
        "MESH_CREDS": str(other / "creds" / "admin.creds"),
        "MESH_DIR": str(other),
        "MESH_DATABASE_URL": "postgresql://mesh:secret@127.0.0.1:5999/mesh?sslmode=verify-full",
    }
    env = {**os.environ, **another}
    done = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0", "--name", "ctl-clean",
         "--print-units"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    said = [line for line in done.stdout.splitlines() if line.startswith("mesh init: ignoring ")]
    assert len(said) == 1, done.stdout
    assert said[0].endswith("from the environment (another mesh's): this mesh uses its own")
    for key in another:
        assert key in said[0]

    # Its pieces and their units have this mesh's settings, none of the other's.
    host = json.loads((made / "mesh.json").read_text())["pids"]["ctl-clean"]
    environ = (Path("/proc") / str(host) / "environ").read_bytes().split(b"\0")
    seen = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
    assert seen["MESH_CA"] == str(made.resolve() / "tls" / "ca.pem")
    assert "MESH_DATABASE_URL" not in seen and "MESH_CREDS" not in seen
    units = "".join(p.read_text() for p in (made / "units").iterdir())
    for value in another.values():
        assert value not in units

    # As the user is told, in that same shell: source the new env, then `mesh status`.
    status = subprocess.run(
        [*MESH, "--json", "status"],
        capture_output=True, text=True, timeout=60, env=_env_of(made, env),
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["seat"]["holder"].startswith("ctl-clean-")
