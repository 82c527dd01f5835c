"""TLS on the mesh's NATS, against a real nats-server configured as a mesh folder's server is
(its own CA, a server certificate, nkey users): only clients that trust the mesh's CA get in, a
plaintext client gets nothing, keys are private files, credentials carry the CA, and `mesh cert
rotate` changes the certificate under running clients without breaking them.

Each refusal has an accepted connection beside it, so a server that refused everyone (or no
one) fails a test instead of passing it."""

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import threading
from pathlib import Path

import anyio
import pytest
from cryptography import x509
from helpers import MESH, await_until, wait_until
from nats.aio.client import Client

from mesh import bus
from mesh.auth import creds as credentials
from mesh.auth import registry, tls
from mesh.embedded import natsd, ports
from mesh.meshdir import MeshDir

SERVER = "n1"


class TlsMesh:
    """A mesh folder with one nats-server (TLS, nkeys), and how to start it again."""

    def __init__(self, root: Path, procs) -> None:
        self.folder = MeshDir(root)
        self.procs = procs
        self.port = ports.free_port()
        self.url = f"tls://127.0.0.1:{self.port}"
        self.dir = self.folder.server(SERVER)
        self.cert, self.key = self.dir / "server.pem", self.dir / "server.key"
        self.proc: subprocess.Popen | None = None

    def make(self) -> None:
        tls.ensure_ca(self.folder.tls)
        self.folder.nats.mkdir(parents=True, exist_ok=True)
        self.folder.url_file.write_text(self.url + "\n")
        with registry.locked(self.folder) as users:
            self.admin = str(users.ensure("operator", "admin", role="admin"))
            self.controller = str(users.ensure("controller", registry.CONTROLLER))
            users.save()
        tls.issue_server(self.folder.tls, self.cert, self.key, name=SERVER,
                         hosts=["127.0.0.1", "localhost"])  # fmt: skip
        self.conf = natsd.write_config(
            self.dir, port=self.port, name=f"tls-{self.port}", auth=self.folder.auth_conf,
            tls=natsd.Tls(cert=self.cert, key=self.key, ca=self.folder.ca),
        )  # fmt: skip

    def start(self) -> None:
        self.proc = proc = self.procs.start(f"nats-{SERVER}", natsd.argv(self.conf))
        wait_until(lambda: proc.poll() is not None or _listening(self.port), within=10,
                   what="nats-server to listen")  # fmt: skip
        assert proc.poll() is None, Path(proc.log_path).read_text()  # type: ignore[attr-defined]

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CA, credentials or folder from the environment: each test says what it uses."""
    for name in ("MESH_CA", "MESH_CREDS", "MESH_DIR", "MESH_NATS_URL", "MESH_FILES"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mesh(tmp_path: Path, procs, clean_env) -> TlsMesh:
    m = TlsMesh(tmp_path / "mesh", procs)
    m.make()
    m.start()
    return m


def _serial_of(nc: Client) -> int:
    """The serial of the certificate the server presented on this connection."""
    ssl_object = nc._transport._io_writer.get_extra_info("ssl_object")  # type: ignore[union-attr]
    assert ssl_object is not None, "the connection is not TLS"
    return x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True)).serial_number


def _hex(number: int) -> str:
    text = f"{number:X}"
    return text if len(text) % 2 == 0 else "0" + text


async def _mesh_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real `mesh` command line, without blocking this test's clients' event loop."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    return await anyio.run_process([*MESH, *args], check=False, env={**base, **(env or {})})


# --- who gets in ------------------------------------------------------------------------------


async def test_a_client_without_the_mesh_ca_is_refused(mesh: TlsMesh) -> None:
    plain = mesh.url.replace("tls://", "nats://")
    with pytest.raises(bus.Unreachable, match="certificate verify failed"):
        await bus.connect(plain, name="no-ca", reconnect=False)  # the system's CAs: not enough
    with pytest.raises(bus.Unreachable, match="CA is not known"):
        await bus.connect(mesh.url, name="no-ca", reconnect=False)
    nc = await bus.connect(mesh.url, name="with-ca", creds=mesh.admin, reconnect=False)
    try:
        assert nc.is_connected and _serial_of(nc) == tls.serial(mesh.cert)
    finally:
        await nc.close()


async def test_a_client_trusting_another_ca_is_refused(mesh: TlsMesh, tmp_path: Path) -> None:
    other = tls.ensure_ca(tmp_path / "other-ca", name="other")
    # `ca` wins over the CA the credentials carry: the right key does not help a wrong CA.
    with pytest.raises(bus.Unreachable, match="certificate verify failed"):
        await bus.connect(mesh.url, name="other-ca", creds=mesh.admin, ca=str(other),
                          reconnect=False)  # fmt: skip
    nc = await bus.connect(mesh.url, name="mesh-ca", creds=mesh.admin, ca=str(mesh.folder.ca),
                           reconnect=False)  # fmt: skip
    await nc.close()


def test_a_plaintext_client_is_refused(mesh: TlsMesh) -> None:
    with socket.create_connection(("127.0.0.1", mesh.port), timeout=5) as s:
        reader = s.makefile("rb")
        line = reader.readline()
        assert line.startswith(b"INFO "), line
        info = json.loads(line[5:])
        assert info["tls_required"] is True
        assert info["auth_required"] is True
        s.sendall(b"CONNECT {}\r\nPING\r\n")
        answer = b""
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    # The server expected a TLS handshake and hangs up on anything else: no PONG, no +OK.
    assert b"PONG" not in answer and b"+OK" not in answer, answer


# --- the files --------------------------------------------------------------------------------


def test_keys_are_private_and_credentials_carry_the_ca(mesh: TlsMesh) -> None:
    for key in (mesh.folder.tls / "ca.key", mesh.key, Path(mesh.admin), Path(mesh.controller)):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    ca = mesh.folder.ca.read_text()
    for path in (mesh.admin, mesh.controller):
        held = credentials.read(path)
        assert held.ca is not None and held.ca.strip() == ca.strip(), path
        assert held.servers == mesh.url


async def test_cert_show_names_the_ca_and_the_server(mesh: TlsMesh) -> None:
    done = await _mesh_cli("cert", "show", "--json", env={"MESH_DIR": str(mesh.folder.root)})
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["ca"]["subject"] == "CN=mesh CA"
    [server] = shown["servers"]
    assert server["name"] == SERVER and server["hosts"] == ["127.0.0.1", "localhost"]
    assert server["serial"] == server["presented"] == _hex(tls.serial(mesh.cert))
    assert server["issued_by_ca"] is True and server["running"] is True


async def test_cert_commands_name_a_folder_that_is_no_mesh(tmp_path: Path, clean_env) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for verb in ("rotate", "show"):
        done = await _mesh_cli("cert", verb, "--dir", str(empty))
        assert done.returncode == 1, done.stdout
        err = done.stderr.decode().strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, err
        assert f"no mesh CA in {empty.resolve() / 'tls'}" in err, err
    done = await _mesh_cli("cert", "show", env={"MESH_DIR": str(tmp_path / "missing")})
    assert done.returncode == 1
    assert f"no mesh folder at {(tmp_path / 'missing').resolve()}" in done.stderr.decode()


# --- rotation ---------------------------------------------------------------------------------


async def test_rotation_under_a_connected_service(mesh: TlsMesh) -> None:
    """A service stays connected through `mesh cert rotate`; new connections get the new
    certificate; after the server restarts, the same client reconnects by itself."""
    old = tls.serial(mesh.cert)
    service = await bus.connect(mesh.url, name="service", creds=mesh.controller, reconnect=True)
    try:

        async def answer(msg) -> None:
            await msg.respond(b"ok:" + msg.data)

        await service.subscribe("mesh.ctl.status", cb=answer)
        await service.subscribe("mesh.seat.mesh-controller.echo", cb=answer)
        await service.flush()
        assert _serial_of(service) == old

        done = await _mesh_cli("cert", "rotate", "--dir", str(mesh.folder.root), "--json")
        assert done.returncode == 0, done.stderr
        [rotated] = json.loads(done.stdout)["servers"]
        new = tls.serial(mesh.cert)
        assert new != old
        assert rotated["name"] == SERVER and rotated["state"] == "reloaded"
        assert rotated["old_serial"] == _hex(old) and rotated["serial"] == _hex(new)
        assert rotated["presented"] == _hex(new)
        assert rotated["hosts"] == ["127.0.0.1", "localhost"]
        assert stat.S_IMODE(mesh.key.stat().st_mode) == 0o600
        assert not list(mesh.dir.glob(".*.new")), "the new files were left beside the old"

        # The service was not cut: the same TLS session, no reconnect, still answering.
        assert service.is_connected and service.stats["reconnects"] == 0
        assert _serial_of(service) == old
        client = await bus.connect(mesh.url, name="admin", creds=mesh.admin, reconnect=False)
        try:
            assert _serial_of(client) == new
            assert (await client.request("mesh.ctl.status", b"1", timeout=5)).data == b"ok:1"
        finally:
            await client.close()

        # The server goes and comes back on the same configuration: the service follows alone.
        mesh.kill()
        await _until(lambda: not service.is_connected, what="the service to see the server go")
        mesh.start()
        await _until(lambda: service.is_connected, what="the service to reconnect")
        assert service.stats["reconnects"] >= 1
        assert _serial_of(service) == new
        reply = await service.request("mesh.seat.mesh-controller.echo", b"2", timeout=5)
        assert reply.data == b"ok:2"
        client = await bus.connect(mesh.url, name="admin", creds=mesh.admin, reconnect=False)
        try:
            assert (await client.request("mesh.ctl.status", b"3", timeout=5)).data == b"ok:3"
        finally:
            await client.close()
    finally:
        await service.close()


async def test_rotating_a_stopped_server_leaves_it_for_its_start(mesh: TlsMesh) -> None:
    mesh.kill()
    old = tls.serial(mesh.cert)
    done = await _mesh_cli("cert", "rotate", "--dir", str(mesh.folder.root))
    assert done.returncode == 0, done.stderr
    out = done.stdout.decode()
    new = tls.serial(mesh.cert)
    assert f"{SERVER}: serial {_hex(old)} → {_hex(new)}" in out and "not running" in out, out
    mesh.start()
    nc = await bus.connect(mesh.url, name="admin", creds=mesh.admin, reconnect=False)
    try:
        assert _serial_of(nc) == new
    finally:
        await nc.close()


async def _until(predicate, *, what: str, within: float = 15) -> None:
    async def holds() -> bool:
        return bool(predicate())

    await await_until(holds, within=within, what=what)


async def test_a_one_shot_client_of_a_cluster_connects_past_a_dead_server(tmp_path, procs) -> None:
    """A command's connection (reconnect=False) is given every server of a cluster: one dead
    server, whichever the client tries first, is passed over (nats-py alone gives up at the
    first failure of a client that may not reconnect); with none alive it fails in one line."""
    ca_folder = tmp_path / "tls"
    ca = tls.ensure_ca(ca_folder)
    client = [ports.free_port() for _ in range(3)]
    routes = [ports.free_port() for _ in range(3)]
    servers = []
    for i in range(3):
        folder = tmp_path / f"n{i + 1}"
        cert, key = folder / "server.pem", folder / "server.key"
        tls.issue_server(ca_folder, cert, key, name=f"n{i + 1}", hosts=["127.0.0.1"])
        conf = natsd.write_config(
            folder, port=client[i], name=f"n{i + 1}", tls=natsd.Tls(cert=cert, key=key, ca=ca),
            cluster=natsd.Cluster(port=routes[i], routes=[f"127.0.0.1:{p}" for p in routes]),
        )  # fmt: skip
        servers.append(procs.start(f"nats-n{i + 1}", natsd.argv(conf)))
    for port in client:
        wait_until(lambda p=port: _listening(p), within=10, what=f"nats-server on {port}")
    url = ",".join(f"tls://127.0.0.1:{p}" for p in client)
    servers[0].kill()
    servers[0].wait(timeout=10)
    # In its place, what a server dying under a connection looks like: the TCP connection is
    # accepted, then reset.
    resetting = socket.create_server(("127.0.0.1", client[0]))
    resetting.settimeout(0.2)
    stop = threading.Event()

    def reset_every_connection() -> None:
        while not stop.is_set():
            try:
                conn, _ = resetting.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_every_connection, daemon=True).start()
    try:
        for _ in range(12):  # the pool's order is random: each server comes first some time
            nc = await bus.connect(url, name="one-shot", reconnect=False, ca=str(ca))
            assert nc.connected_url is not None and nc.connected_url.port != client[0]
            await nc.close()
    finally:
        stop.set()
        resetting.close()
    for s in servers[1:]:
        s.kill()
        s.wait(timeout=10)
    with pytest.raises(bus.Unreachable, match="cannot reach NATS"):
        await bus.connect(url, name="one-shot", reconnect=False, ca=str(ca))


async def test_a_failed_handshake_does_not_hang_the_next_try(tmp_path, procs) -> None:
    """Two servers: one whose certificate another CA issued (its handshake fails, as one killed
    mid-handshake does), one good. Whichever the client tries first, it connects to the good
    one within its bound: after a failed handshake nats-py waited for ever on the plain
    socket's close (asyncio had handed that socket to TLS), found by the nemesis (issue 29)."""
    ca = tls.ensure_ca(tmp_path / "tls")
    other = tls.ensure_ca(tmp_path / "other-tls", name="other")
    port = {"bad": ports.free_port(), "good": ports.free_port()}
    for name, issuer in (("bad", tmp_path / "other-tls"), ("good", tmp_path / "tls")):
        folder = tmp_path / name
        cert, key = folder / "server.pem", folder / "server.key"
        tls.issue_server(issuer, cert, key, name=name, hosts=["127.0.0.1"])
        ca_of = other if name == "bad" else ca
        conf = natsd.write_config(folder, port=port[name], name=name,
                                  tls=natsd.Tls(cert=cert, key=key, ca=ca_of))  # fmt: skip
        procs.start(f"nats-{name}", natsd.argv(conf))
        wait_until(lambda p=port[name]: _listening(p), within=10, what=f"nats-server {name}")
    url = f"tls://127.0.0.1:{port['bad']},tls://127.0.0.1:{port['good']}"
    for _ in range(12):  # the pool's order is random: the bad server comes first some time
        with anyio.fail_after(20):
            nc = await bus.connect(url, name="one-shot", reconnect=False, ca=str(ca))
        try:
            assert nc.connected_url is not None and nc.connected_url.port == port["good"]
        finally:
            await bus.close(nc)
