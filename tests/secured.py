"""A nats-server that admits only the identities of a mesh folder (`secured`), and a fleet on
it (`secured_fleet`: a controller and two hosts, node-1 a builder, every piece with its own
credentials): what the tests of permissions and attacks share (tests/test_security.py,
tests/test_attacks.py, tests/test_discovery.py). The fixtures are registered in conftest.py."""

import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers import MESH, await_until, hosts_up, mesh_cli, wait_until
from nats.aio.client import Client

from mesh import bus
from mesh.auth import registry
from mesh.embedded import natsd, ports
from mesh.meshdir import MeshDir
from programs.placement import place


class Secured:
    """A nats-server that admits only the identities in a mesh folder."""

    def __init__(self, folder: MeshDir, url: str, start) -> None:
        self.dir = folder
        self.url = url
        self.start = start  # starts the server (again), returns its process
        self.proc = start()

    def creds(self, kind: str, name: str) -> str:
        return str(self.dir.creds_file(kind, name))

    @property
    def admin(self) -> str:
        return self.creds("operator", "admin")

    @property
    def viewer(self) -> str:
        return self.creds("operator", "viewer")

    @property
    def tools(self) -> str:
        return self.creds("operator", "tools")

    def cli(
        self, creds: str | None, *args: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess:
        """The `mesh` command line on this server as `creds` (None: no credentials)."""
        return mesh_cli(*args, nats_url=self.url, creds=creds, stdin=stdin, timeout=180)

    async def connect(
        self, creds: str | None, *, denials: list[str] | None = None, reconnect: bool = False
    ) -> Client:
        return await bus.connect(
            self.url,
            name="test",
            creds=creds,
            reconnect=reconnect,
            denied=denials.append if denials is not None else None,
        )


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def secured(tmp_path: Path, procs) -> Secured:
    folder = MeshDir(tmp_path / "mesh")
    with registry.locked(folder) as users:
        users.ensure("operator", "admin", role="admin")
        users.ensure("operator", "viewer", role="viewer")
        users.ensure("operator", "tools", role="tools")
        users.ensure("controller", registry.CONTROLLER)
        users.ensure("host", "node-1", builder=True)
        users.ensure("host", "node-2")
        users.save()
    port = ports.free_port()
    conf = natsd.write_config(
        folder.server("n1"), port=port, name=f"secure-{port}", auth=folder.auth_conf
    )
    url = f"nats://127.0.0.1:{port}"
    folder.url_file.write_text(url + "\n")

    def start():
        proc = procs.start("nats-server", natsd.argv(conf))
        wait_until(
            lambda: proc.poll() is not None or _listening(port), within=10, what="nats-server"
        )
        assert proc.poll() is None, (tmp_path / "nats-server.log").read_text()
        return proc

    return Secured(folder, url, start)


class Refusals:
    """A connection's permissions violations, as the server reports them.

    The server reports them asynchronously (a flush may return before the report), but in
    the order it handled the connection's messages: an action is followed by a publish on a
    subject nobody may use, and once that one's refusal is in, the action's would be too."""

    def __init__(self, nc: Client, seen: list[str]) -> None:
        self.nc = nc
        self.seen = seen
        self._sentinels = 0

    async def _refused(self, subject: str, act) -> bool:
        before = len(self.seen)
        await act()
        self._sentinels += 1
        sentinel = f"mesh.sentinel.{self._sentinels}"
        await self.nc.publish(sentinel, b"")

        async def reported():
            return any(sentinel in s for s in self.seen[before:])

        await await_until(reported, within=10, what=f"the refusal of {sentinel}")
        return any(s.endswith(" " + subject.lower()) for s in self.seen[before:])

    async def publish_refused(self, subject: str, body: bytes = b"{}") -> bool:
        return await self._refused(subject, lambda: self.nc.publish(subject, body))

    async def subscribe_refused(self, subject: str) -> bool:
        subs = []

        async def act() -> None:
            subs.append(await self.nc.subscribe(subject))

        refused = await self._refused(subject, act)
        await subs[0].unsubscribe()
        return refused


@pytest.fixture
async def as_identity(secured: Secured) -> AsyncIterator:
    opened: list[Client] = []

    async def open_as(creds: str) -> Refusals:
        seen: list[str] = []
        nc = await secured.connect(creds, denials=seen)
        opened.append(nc)
        return Refusals(nc, seen)

    yield open_as
    for nc in opened:
        await nc.close()


# --- a secured fleet: a controller and two hosts, every piece with its own credentials ----------


@pytest.fixture
async def secured_fleet(secured: Secured, procs, database_url: str, tmp_path: Path):
    """ctl-a and node-1 (tier 0, a builder), node-2 (tier 1) up, each with its own credentials,
    placed by the operator; an admin's connection."""
    procs.start(
        "ctl-a",
        [*MESH, "controller", "run", "--instance", "ctl-a",
         "--creds", secured.creds("controller", registry.CONTROLLER)],
        env={"MESH_NATS_URL": secured.url, "MESH_DATABASE_URL": database_url},
    )  # fmt: skip
    # Reconnecting: a test runs commands as subprocesses while its loop waits, and a loaded
    # machine can keep it from answering the server's pings for longer than it allows.
    nc = await secured.connect(secured.admin, reconnect=True)
    # Placed by the operator before they first register: a host never chooses its own.
    await place(nc, url=secured.url, machine="node-1", tier=0, labels={"builder": "true"},
                timeout=40)  # fmt: skip
    await place(nc, url=secured.url, machine="node-2", tier=1, labels={}, timeout=40)
    for name in ("node-1", "node-2"):
        procs.start(
            name,
            [*MESH, "host", "run", "--name", name, "--root", str(tmp_path / "hosts" / name),
             "--creds", secured.creds("host", name)],
            env={"MESH_NATS_URL": secured.url},
        )  # fmt: skip
    await hosts_up(nc, 2, within=40)
    yield nc
    await nc.close()
