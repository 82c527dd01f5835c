"""The mesh of machines with their own network (issue 13, items 3 and 4; issue 29): every
nats-server (three, one TLS cluster), PostgreSQL, every controller and every host in a network
namespace of its own, joined by a switch in another (tests/netns.py); the test's own clients sit
in a "client" namespace. Only the switch's addresses carry mesh traffic: no loopback, and
nothing touches the host's network. PostgreSQL listens on its switch address (pg_hba lets the
switch's subnet in), so cutting a controller's link cuts its store session as a real machine's
would. The controllers have the system account's kicker (mesh/auth/system.py).

Shared by tests/test_network.py, tests/test_cut_holder.py and bench/cut.py. Root only.
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import anyio
import asyncpg
import nats
import netns
import pytest
from helpers import MESH, await_until, fleet_up, mesh_cli
from netpieces import (
    CLIENT_PORT,
    CONTROLLERS,
    HOSTS,
    MONITOR_PORT,
    NATS,
    PG_PORT,
    accepts,
    monitor,
    nats_configs,
    nats_current,
    postgres_argv,
    start_cluster,
)

from mesh import bus
from mesh.auth import system, tls
from mesh.embedded import natsd, pgauth, postgres

MEMBERS = [*NATS, "pg", *CONTROLLERS, *HOSTS, "client"]
BEAT = 0.5  # the hosts' beat: down after 3 missed, 1.5 s


@pytest.fixture
def net():
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    with netns.network(MEMBERS) as network:
        yield network


class NetMesh:
    """The pieces of a mesh, each started inside its own namespace."""

    def __init__(self, net: netns.Network, procs, tmp_path: Path) -> None:
        self.net = net
        self.procs = procs
        self.dir = tmp_path
        self.ca_folder = tmp_path / "tls"
        self.ca = str(tls.ensure_ca(self.ca_folder))
        self.nats: dict[str, subprocess.Popen] = {}
        self.confs: dict[str, Path] = {}
        self.url = ",".join(f"tls://{net.address(n)}:{CLIENT_PORT}" for n in NATS)
        self.database_url = f"postgresql://{postgres.PG_USER}@{net.address('pg')}:{PG_PORT}/mesh"
        self.pg_folder: Path | None = None
        self.controllers: dict[str, subprocess.Popen] = {}
        self.hosts: dict[str, subprocess.Popen] = {}
        # The system account's kicker, the controllers' alone (mesh/auth/system.py).
        self.system_creds = tmp_path / "system.creds"
        self.system = system.ensure(self.system_creds, ca=Path(self.ca).read_text())

    def env(self) -> dict[str, str]:
        return {"MESH_NATS_URL": self.url, "MESH_CA": self.ca,
                "MESH_DATABASE_URL": self.database_url, "PYTHONUNBUFFERED": "1"}  # fmt: skip

    # --- NATS ------------------------------------------------------------------------------

    async def start_nats(self) -> None:
        self.confs = nats_configs(self.net, self.dir / "nats", self.ca_folder, NATS, self.system)
        await start_cluster(NATS, self.run_nats, self.nats_healthy)

    def run_nats(self, name: str) -> None:
        argv = self.net.argv(name, natsd.argv(self.confs[name]))
        self.nats[name] = self.procs.start(f"nats-{name}", argv)

    def kill_nats(self, name: str) -> None:
        proc = self.nats[name]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL

    async def nats_healthy(self, name: str, within: float = 60) -> None:
        """The server answers TLS clients and its JetStream is current (/healthz)."""
        proc = self.nats[name]

        async def healthy():
            assert proc.poll() is None, (self.dir / f"nats-{name}.log").read_text()[-3000:]
            return await nats_current(self.net, name)

        await await_until(healthy, within=within, what=f"nats-server {name} healthy")

    async def connect(self) -> nats.aio.client.Client:
        return await bus.connect(self.url, name="test", ca=self.ca)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """The `mesh` command line on this mesh (from the namespace the test thread is in)."""
        return mesh_cli(*args, nats_url=self.url, answer=60, timeout=180)

    # --- PostgreSQL ------------------------------------------------------------------------

    async def start_postgres(self) -> None:
        # Not under pytest's folder, which is private to root (see conftest's pg_admin_url).
        self.pg_folder = Path(tempfile.mkdtemp(prefix="mesh-test-pg-"))
        data = self.pg_folder / "data"
        # The subnet's line below lets the test's pieces in without a password.
        passwords = pgauth.Passwords(self.pg_folder / "passwords")
        await anyio.to_thread.run_sync(lambda: postgres.init(data, passwords=passwords))
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.net.subnet} trust\n")
        argv = postgres_argv(data, self.net.address("pg"))
        with self.net.inside("pg"):  # forked in there, then drops to its account
            proc = self.procs.start("postgres", argv, cwd=data, **postgres.run_as())
        admin = self.database_url.rpartition("/")[0] + "/postgres"

        async def ready():
            assert proc.poll() is None, (self.dir / "postgres.log").read_text()[-3000:]
            if not await accepts(admin):
                return False
            conn = await asyncpg.connect(admin, timeout=2)
            try:
                await conn.execute('CREATE DATABASE "mesh"')
            finally:
                await conn.close()
            return True

        await await_until(ready, within=60, what="PostgreSQL to accept connections")

    def stop_postgres(self) -> None:
        if self.pg_folder is not None:
            shutil.rmtree(self.pg_folder, ignore_errors=True)

    # --- the mesh's services ---------------------------------------------------------------

    def start_controller(self, instance: str) -> subprocess.Popen:
        argv = self.net.argv(instance, [*MESH, "controller", "run", "--instance", instance])
        env = {**self.env(), "MESH_SYSTEM_CREDS": str(self.system_creds)}
        proc = self.procs.start(instance, argv, env=env)
        self.controllers[instance] = proc
        return proc

    def start_host(self, name: str, *extra: str) -> subprocess.Popen:
        argv = self.net.argv(name, [
            *MESH, "host", "run", "--name", name, "--root", str(self.dir / "hosts" / name),
            "--beat", str(BEAT), *extra,
        ])  # fmt: skip
        proc = self.procs.start(name, argv, env=self.env())
        self.hosts[name] = proc
        return proc

    def holder_server(self, holder: str) -> str:
        """The nats-server the controller `holder`'s own connection is on (its verbs and the
        seat; its hosts' connection opens beside it, but may have moved on after a reconnect),
        as the servers' /connz says by the connection's name."""
        name = f"mesh-controller {holder}"
        found = []
        for server in NATS:
            url = f"http://{self.net.address(server)}:{MONITOR_PORT}/connz?limit=1000"
            connz = json.loads(monitor(url) or b"{}")
            if any(c.get("name") == name for c in connz.get("connections") or []):
                found.append(server)
        assert len(found) == 1, f"{holder}'s connection on {found}"
        return found[0]


@pytest.fixture
async def netmesh(net, procs, tmp_path, monkeypatch):
    """The test thread sits in the client namespace throughout: every socket it opens (NATS,
    PostgreSQL, monitoring) and every command it runs goes over the switch."""
    monkeypatch.setenv("MESH_CA", str(tmp_path / "tls" / "ca.pem"))
    monkeypatch.delenv("MESH_CREDS", raising=False)
    with net.inside("client"):
        m = NetMesh(net, procs, tmp_path)
        try:
            yield m
        finally:
            procs.kill_all()  # before the namespaces go
            m.stop_postgres()


async def started(m: NetMesh) -> nats.aio.client.Client:
    """NATS, PostgreSQL, ctl-0 holding, ctl-1 standing by, node-1..3 in tiers 0..2 up."""
    await m.start_nats()
    await m.start_postgres()
    nc = await m.connect()
    await fleet_up(nc, start_controller=m.start_controller, start_host=m.start_host,
                   hosts=len(HOSTS), controllers=CONTROLLERS)  # fmt: skip
    return nc
