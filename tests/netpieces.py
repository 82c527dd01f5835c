"""Pieces of a mesh inside network namespaces (tests/netns.py), as the namespace tests and the
nemesis start them: a TLS nats-server of a cluster listening on its switch address (with the
monitoring port, for /healthz and /connz), whether its JetStream is current, and PostgreSQL
listening on its switch address and accepting connections."""

import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
from netns import Network

from mesh.auth import tls
from mesh.embedded import natsd, postgres

CLIENT_PORT, ROUTE_PORT, MONITOR_PORT, PG_PORT = 4222, 6222, 8222, 5432
# The cluster's members as tests/netmesh.py and the nemesis name them.
NATS = ["n1", "n2", "n3"]
CONTROLLERS = ["ctl-0", "ctl-1"]
HOSTS = ["node-1", "node-2", "node-3"]


def nats_config(net: Network, folder: Path, ca_folder: Path, name: str, members: list[str],
                system: str | None = None) -> Path:  # fmt: skip
    """nats-server `name`'s configuration in FOLDER: TLS with a certificate for its switch
    address (from the CA in `ca_folder`), routes to every one of `members`, monitoring on, and
    with `system` the system account's kicker (its public key, mesh/auth/system.py)."""
    address = net.address(name)
    cert, key = folder / "server.pem", folder / "server.key"
    tls.issue_server(ca_folder, cert, key, name=name, hosts=[address])
    conf = natsd.write_config(
        folder, port=CLIENT_PORT, name=name, host=address,
        tls=natsd.Tls(cert=cert, key=key, ca=ca_folder / "ca.pem"),
        cluster=natsd.Cluster(port=ROUTE_PORT,
                              routes=[f"{net.address(m)}:{ROUTE_PORT}" for m in members]),
        system=system,
    )  # fmt: skip
    # The monitoring port, for /healthz (JetStream current) and /connz.
    conf.write_text(conf.read_text() + f'http: "{address}:{MONITOR_PORT}"\n')
    return conf


def nats_configs(net: Network, folder: Path, ca_folder: Path, members: list[str],
                 system: str | None = None) -> dict[str, Path]:  # fmt: skip
    """Every member's configuration (nats_config), each in FOLDER/NAME."""
    return {name: nats_config(net, folder / name, ca_folder, name, members, system=system)
            for name in members}  # fmt: skip


async def start_cluster(members: list[str], run: Callable[[str], object],
                        healthy: Callable[[str], Awaitable[object]]) -> None:  # fmt: skip
    """Every server started first, then each waited for (they elect their leaders together)."""
    for name in members:
        run(name)
    for name in members:
        await healthy(name)


def monitor(url: str) -> bytes:
    """A GET on a nats-server's monitoring port."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read()
    except urllib.error.HTTPError as e:  # /healthz answers 503 with a body while not current
        return e.read()


async def nats_current(net: Network, name: str) -> bool:
    """nats-server `name` answers and its JetStream is current (/healthz)."""
    url = f"http://{net.address(name)}:{MONITOR_PORT}/healthz"
    try:
        got = await anyio.to_thread.run_sync(monitor, url)
    except OSError:
        return False
    return json.loads(got).get("status") == "ok"


def postgres_argv(data: Path, address: str, settings: tuple[str, ...] = ()) -> list[str]:
    """PostgreSQL on the cluster in `data`, listening on `address` only."""
    return [*postgres.argv(data, port=PG_PORT, settings=settings), "-c",
            f"listen_addresses={address}"]  # fmt: skip


async def accepts(url: str) -> bool:
    """PostgreSQL at `url` takes a connection."""
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True
