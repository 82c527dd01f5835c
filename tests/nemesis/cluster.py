"""The nemesis's cluster: every piece in a network namespace of its own (tests/netns.py), as
tests/test_network.py and tests/test_store_faults.py have them, together: three nats-servers in
one TLS cluster, PostgreSQL pg1 with pg2 its synchronous standby, controllers ctl-0 and ctl-1,
hosts node-1..3 in tiers 0..2, and a `client` namespace for the workload. The controllers have
the system account's kicker, as tests/netmesh.py's do.

It does what a machine's supervisor would (a controller that stepped down, or any piece that
exited, is started again), what an HA manager would (the primary's death answered by promoting
the standby, the old primary then copied again as the new one's synchronous standby), and the
faults of tests/nemesis/schedule.py, each with its heal. Runs as root (network namespaces).
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import netpieces
from helpers import Procs
from netns import Network
from netpieces import CLIENT_PORT, CONTROLLERS, HOSTS, NATS, PG_PORT

from mesh.auth import secretkeys, system, tls
from mesh.embedded import natsd, pgauth, postgres
from mesh.entry import ENTRY

from .history import History

STORES = ["pg1", "pg2"]
MEMBERS = [*NATS, *STORES, *CONTROLLERS, *HOSTS, "client"]
DATABASE = "mesh"
BEAT = 0.5  # the hosts' beat, as the network tests have it


class ClusterError(Exception):
    """The cluster could not be started or healed; the message says why."""


async def until(probe: Callable[[], Awaitable[object]], *, within: float, what: str) -> object:
    deadline = time.monotonic() + within
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {within:g}s waiting for {what}")
        await anyio.sleep(0.1)  # ok: polling a condition with a deadline


class Cluster:
    def __init__(self, net: Network, folder: Path, history: History, python: str) -> None:
        self.net, self.dir, self.history = net, folder, history
        self.mesh = [python, "-P", "-m", ENTRY]
        # Outside any 0700 folder: PostgreSQL and the hosts' processes run as other accounts.
        # FOLDER/hosts links to its hosts/, where the Procs' clean-up looks (as the fixture's).
        self.open = Path(tempfile.mkdtemp(prefix="mesh-nemesis-"))
        self.open.chmod(0o755)
        (self.open / "hosts").mkdir()
        (folder / "hosts").symlink_to(self.open / "hosts", target_is_directory=True)
        self.started = Procs(folder)  # every piece's log is FOLDER/NAME.log
        self.ca_folder = folder / "tls"
        self.ca = str(tls.ensure_ca(self.ca_folder))
        self.key_file = self.open / "secrets.key"
        secretkeys.make(self.key_file)
        self.url = ",".join(f"tls://{net.address(n)}:{CLIENT_PORT}" for n in NATS)
        self.pg = {name: net.address(name) for name in STORES}
        servers = ",".join(f"{address}:{PG_PORT}" for address in self.pg.values())
        self.database_url = (f"postgresql://{postgres.PG_USER}@{servers}/{DATABASE}"
                             "?target_session_attrs=read-write")  # fmt: skip
        self.procs: dict[str, subprocess.Popen] = {}
        self.confs: dict[str, Path] = {}
        self.primary, self.standby = "pg1", "pg2"
        self.down: set[str] = set()  # pieces a fault keeps down: the supervisor leaves them
        self.restarts = 0
        # The system account's kicker, the controllers' alone (mesh/auth/system.py), as a real
        # mesh has it: a new holder closes a cut-off holder's connection at once.
        self.system_creds = folder / "system.creds"
        self.system = system.ensure(self.system_creds, ca=Path(self.ca).read_text())

    def env(self) -> dict[str, str]:
        return {"MESH_NATS_URL": self.url, "MESH_CA": self.ca,
                "MESH_DATABASE_URL": self.database_url, "PYTHONUNBUFFERED": "1",
                "MESH_SECRETS_KEY_FILE": str(self.key_file)}  # fmt: skip

    def start(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        self.procs[name] = self.started.start(name, argv, **kw)
        return self.procs[name]

    def log_tail(self, name: str, chars: int = 2000) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # --- NATS ------------------------------------------------------------------------------

    async def start_nats(self) -> None:
        self.confs = netpieces.nats_configs(self.net, self.dir / "nats", self.ca_folder, NATS,
                                            self.system)  # fmt: skip
        await netpieces.start_cluster(NATS, self.run_nats, self.nats_healthy)

    def run_nats(self, name: str) -> None:
        self.start(name, self.net.argv(name, natsd.argv(self.confs[name])))

    async def nats_healthy(self, name: str, within: float = 60) -> None:
        """It answers and its JetStream is current (/healthz)."""

        async def healthy() -> bool:
            if self.procs[name].poll() is not None:
                raise ClusterError(f"nats-server {name} exited: {self.log_tail(name)}")
            return await netpieces.nats_current(self.net, name)

        await until(healthy, within=within, what=f"nats-server {name} healthy")

    # --- PostgreSQL ------------------------------------------------------------------------

    def direct(self, member: str, database: str = DATABASE) -> str:
        return f"postgresql://{postgres.PG_USER}@{self.pg[member]}:{PG_PORT}/{database}"

    def _postgres(self, member: str, settings: tuple[str, ...]) -> None:
        data = self.open / member
        argv = netpieces.postgres_argv(data, self.pg[member], settings)
        with self.net.inside(member):  # forked in there, then drops to its account
            self.start(member, argv, cwd=data, **postgres.run_as())

    async def _ready(self, member: str) -> None:
        async def ready() -> bool:
            if self.procs[member].poll() is not None:
                raise ClusterError(f"PostgreSQL {member} exited: {self.log_tail(member)}")
            return await netpieces.accepts(self.direct(member, "postgres"))

        await until(ready, within=60, what=f"PostgreSQL on {member}")

    async def sql(self, member: str, statement: str) -> None:
        conn = await asyncpg.connect(self.direct(member, "postgres"), timeout=5,
                                     server_settings={"synchronous_commit": "local"})  # fmt: skip
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    async def start_store(self) -> None:
        """pg1 the primary, pg2 its synchronous standby."""
        data = self.open / "pg1"
        passwords = pgauth.Passwords(self.open / "passwords")
        await anyio.to_thread.run_sync(lambda: postgres.init(data, passwords=passwords))
        with open(data / "pg_hba.conf", "a") as hba:  # the subnet's pieces, without a password
            hba.write(f"host all all {self.net.subnet} trust\n")
            hba.write(f"host replication {postgres.REPLICATION_USER} {self.net.subnet} trust\n")
        self._postgres("pg1", postgres.PRIMARY)
        await self._ready("pg1")
        await self.sql("pg1", f'CREATE DATABASE "{DATABASE}"')
        await self.sql("pg1", f'CREATE ROLE "{postgres.REPLICATION_USER}" WITH REPLICATION LOGIN')
        await self.copy_standby("pg2", of="pg1")

    async def copy_standby(self, member: str, *, of: str) -> None:
        """`member` made again a copy of the primary `of` (pg_basebackup), streaming from it,
        then its synchronous standby."""
        data = self.open / member
        shutil.rmtree(data, ignore_errors=True)
        postgres.init_folder(data)

        def backup() -> subprocess.CompletedProcess:
            with self.net.inside(member):
                return subprocess.run(
                    [postgres.bin("pg_basebackup"), "-D", str(data), "-h", self.pg[of],
                     "-p", str(PG_PORT), "-U", postgres.REPLICATION_USER, "-R", "-X", "stream",
                     "-c", "fast", "--no-password"],
                    capture_output=True, text=True, cwd=data, timeout=120, **postgres.run_as(),
                )  # fmt: skip

        done = await anyio.to_thread.run_sync(backup)
        if done.returncode != 0:
            raise ClusterError(f"pg_basebackup of {of} into {member}: {done.stderr.strip()}")
        conninfo = (f"host={self.pg[of]} port={PG_PORT} user={postgres.REPLICATION_USER} "
                    f"application_name={postgres.STANDBY_NAME}")  # fmt: skip
        self._postgres(member, (f"primary_conninfo={conninfo}", "hot_standby=on",
                                "wal_retrieve_retry_interval=200ms"))  # fmt: skip
        await self._ready(member)
        # The first primary has synchronous_standby_names on its command line (which wins);
        # a promoted one is given it here, once its standby streams.
        name = postgres.STANDBY_NAME
        await self.sql(of, f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
        await self.sql(of, "SELECT pg_reload_conf()")

        async def synchronous() -> bool:
            conn = await asyncpg.connect(self.direct(of, "postgres"), timeout=5)
            try:
                return bool(await conn.fetch("SELECT 1 FROM pg_stat_replication WHERE state ="
                                             " 'streaming' AND sync_state = 'sync'"))  # fmt: skip
            finally:
                await conn.close()

        await until(synchronous, within=60, what=f"{member} streaming synchronously from {of}")

    async def promote(self) -> None:
        """The standby promoted (standby.promote's pg_ctl), and told not to wait for a standby
        of its own (its copied settings may name one) until it has one again."""
        data = self.open / self.standby

        def run() -> subprocess.CompletedProcess:
            return subprocess.run(
                [postgres.bin("pg_ctl"), "promote", "-w", "-t", "60", "-D", str(data)],
                capture_output=True, text=True, timeout=90, **postgres.run_as(),
            )  # fmt: skip

        done = await anyio.to_thread.run_sync(run)
        if done.returncode != 0:
            raise ClusterError(f"pg_ctl promote {self.standby}: {done.stderr.strip()}")
        await self.sql(self.standby, "ALTER SYSTEM RESET synchronous_standby_names")
        await self.sql(self.standby, "SELECT pg_reload_conf()")
        self.primary, self.standby = self.standby, self.primary

    # --- the mesh's services ---------------------------------------------------------------

    def start_controller(self, instance: str) -> None:
        argv = self.net.argv(instance, [*self.mesh, "controller", "run", "--instance", instance])
        self.start(instance, argv, env={**self.env(), "MESH_SYSTEM_CREDS": str(self.system_creds)})

    def start_host(self, name: str) -> None:
        tier = str(min(HOSTS.index(name), 2))
        argv = self.net.argv(name, [
            *self.mesh, "host", "run", "--name", name, "--root", str(self.open / "hosts" / name),
            "--beat", str(BEAT), "--tier", tier,
        ])  # fmt: skip
        self.start(name, argv, env=self.env())

    def restart(self, name: str) -> None:
        if name in CONTROLLERS:
            self.start_controller(name)
        elif name in HOSTS:
            self.start_host(name)
        elif name in NATS:
            self.run_nats(name)
        else:
            raise ClusterError(f"no way to restart {name}")

    async def supervise(self) -> None:
        """What a machine's supervisor does (systemd's Restart=always, one second later): a
        controller or host that exited is started again, unless a fault keeps it down."""
        while True:
            await anyio.sleep(1.0)  # ok: the supervisor's restart delay
            for name in [*CONTROLLERS, *HOSTS]:
                proc = self.procs.get(name)
                if proc is None or name in self.down or proc.poll() is None:
                    continue
                self.history.add("note", what=f"{name} exited with {proc.returncode}; started "
                                 "again by its supervisor")  # fmt: skip
                self.restarts += 1
                self.restart(name)

    # --- the end ---------------------------------------------------------------------------

    async def stop_all(self, within: float) -> dict[str, float | None]:
        """Every piece told to stop at once, as a machine's shutdown does: SIGTERM, and SIGINT
        for PostgreSQL (its fast shutdown, the KillSignal of mesh's unit: SIGTERM is its smart
        shutdown, which waits for every client); the seconds each took to exit, None for one
        still running after `within` (then killed)."""
        sent = time.monotonic()
        alive = {n: p for n, p in self.procs.items() if p.poll() is None}
        for name, proc in alive.items():
            stop = signal.SIGINT if name in STORES else signal.SIGTERM
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a paused piece cannot hear it otherwise
                os.kill(proc.pid, stop)
            except ProcessLookupError:
                pass
        took: dict[str, float | None] = {}
        while alive and time.monotonic() - sent < within + 5:
            for name, proc in list(alive.items()):
                if proc.poll() is not None:
                    took[name] = round(time.monotonic() - sent, 2)
                    del alive[name]
            await anyio.sleep(0.05)  # ok: polling exits with a deadline
        for name in alive:
            took[name] = None
        return took

    def kill_all(self) -> None:
        """Whatever is left, even after a failure (process groups, SIGKILL), and the folders."""
        self.started.kill_all()
        shutil.rmtree(self.open, ignore_errors=True)
