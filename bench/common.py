"""What the benchmarks share (bench/*.py are scripts that print figures; docs/performance.md
records their commands): a line said and a failure in one line, a run to its exit code; the
CPU of processes and of the whole machine, from /proc; a run's deadline; the pieces of a run
(nats-servers, PostgreSQL, a controller) made as `mesh dev up` makes them; a simulated host's
view of its declaration; the rollout's module, tiers and push, which the scale bench runs too.
No bench imports another but this one (tests/test_house.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.client import __version__ as nats_py_version
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import APIError

from mesh import bus, wire
from mesh.auth import secretkeys
from mesh.auth import tls as mesh_tls
from mesh.embedded import natsd, pgauth, ports, postgres
from mesh.embedded.children import Child, spawn
from mesh.entry import command
from mesh.model import StatusReply


def secrets_key_file(folder: Path) -> str:
    """The key of the secrets a bench's controllers are given, made the first time in `folder`
    as `mesh dev up` makes it (keys/secrets.key, mesh/auth/secretkeys.py)."""
    path = folder / "keys" / "secrets.key"
    if not path.exists():
        secretkeys.make(path)
    return str(path)


STATUS_SUBJECT = "mesh.ctl.status"
PUSH_TIMEOUT = 30.0  # `mesh push --timeout` of the rollout's plans
MODULE = "bench"  # the rollout's module
T = TypeVar("T")


def say(line: str = "") -> None:
    print(line, flush=True)


class BenchError(Exception):
    """The run cannot go on; the message says why."""


def run_or_exit(main: Coroutine[Any, Any, T]) -> T:
    """`main` run to its end; a BenchError ends the script with `bench failed: …`, Ctrl-C with
    exit code 130."""
    try:
        return asyncio.run(main)
    except BenchError as e:
        sys.exit(f"bench failed: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


def machine_line() -> str:
    """The machine the figures come from: cores, Python, nats-py and the load then."""
    return (
        f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, nats-py "
        f"{nats_py_version}, load average {os.getloadavg()[0]:.2f}"
    )


# --- measuring ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/<pid>/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        raise BenchError(f"process {pid} is gone (it exited during the run)") from None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of the whole line
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def cpu_of(pids: list[int]) -> float:
    """CPU seconds of several processes together (the nats-servers of a cluster)."""
    return sum(cpu_seconds(pid) for pid in pids)


def machine_busy_seconds() -> float:
    """CPU time all cores spent busy (not idle, not waiting on I/O), from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_stall_seconds() -> float | None:
    """Seconds in which some runnable task waited for a CPU (/proc/pressure/cpu, "some"), or
    None without pressure stall information."""
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
    except OSError:
        return None
    return int(some[-1].removeprefix("total=")) / 1e6


class CpuMeter:
    """Cores busy and the share of time with a task waiting for a CPU, since it was made."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.stall0 = time.time(), machine_busy_seconds(), cpu_stall_seconds()

    def read(self, seconds: float | None = None) -> tuple[float, float | None]:
        """Over `seconds` (by default the time since it was made)."""
        if seconds is None:
            seconds = max(time.time() - self.t0, 1e-9)
        cores = (machine_busy_seconds() - self.busy0) / seconds
        stall = cpu_stall_seconds()
        wait = None if stall is None or self.stall0 is None else (stall - self.stall0) / seconds
        return cores, wait


def children_of(pid: int) -> list[int]:
    """The direct children of `pid` (PostgreSQL's backends are the postmaster's)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            found.extend(int(c) for c in text.split())
    except OSError:
        pass
    return found


def tree_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its direct children that are alive now."""
    total = cpu_seconds(pid)
    for child in children_of(pid):
        try:
            total += cpu_seconds(child)
        except BenchError:  # a backend that ended between the listing and the read
            pass
    return total


# --- a run's deadline --------------------------------------------------------------------


class Guard:
    """The run's deadline and Ctrl-C, checked before every request. Cancelling the task is not
    enough on its own: Python 3.11's asyncio.wait_for (inside nats-py's request) can swallow a
    cancellation that arrives as the reply does."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.interrupted = False

    def check(self) -> None:
        if self.interrupted:
            raise BenchError("interrupted")
        if time.monotonic() > self.deadline:
            raise BenchError(f"the run took longer than --deadline {self.seconds:g}s")


# --- the pieces of a run (the project's own helpers) --------------------------------------


async def port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


async def until(
    what: str, child: Child, probe: Callable[[], Awaitable[bool]], *, within: float, guard: Guard
) -> None:
    """Until `probe()` says the child `what` is ready, within `within` seconds; a child that
    exits, or a probe that never says so, fails the run with the end of its log."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        guard.check()
        if not child.running:
            raise BenchError(f"{what} exited while starting; {last_lines(child)}")
        if await probe():
            return
        await asyncio.sleep(0.1)
    raise BenchError(f"{what} did not answer within {within:g}s; {last_lines(child)}")


def last_lines(child: Child) -> str:
    return f"last lines of its log {child.log}:\n{child.tail()}"


class Pieces:
    """The child processes of one benchmark run, stopped in reverse order.

    `servers` nats-servers: one, or a cluster (always TLS); `tls` makes a lone server TLS too.
    The controller (and bench/verbs.py's echo responder) connect to the first server, the
    bench's own client to the second (`client_url`), so with a cluster every request crosses
    a route."""

    def __init__(
        self, folder: Path, guard: Guard, *, servers: int = 1, tls: bool = False,
        max_payload: int | None = None, sync_interval: str = "always",
    ) -> None:  # fmt: skip
        self.folder = folder
        self.sync_interval = sync_interval  # JetStream's fsyncs: mesh's "always" unless measuring
        self.max_payload = max_payload
        self.guard = guard
        self.servers = servers
        self.tls = tls or servers > 1
        self.children: list[Child] = []
        self.urls: list[str] = []  # one per server, n1 first
        self.nats_url = ""  # every server, comma-separated
        self.ca: str | None = None  # the CA's certificate, with TLS
        self.database_url = ""

    @property
    def server_url(self) -> str:
        """Where the controller and the echo responder connect: n1."""
        return self.urls[0]

    @property
    def client_url(self) -> str:
        """Where the bench's own client connects: n2 (n1 when alone)."""
        return self.urls[min(1, len(self.urls) - 1)]

    def describe(self) -> str:
        kind = f"a cluster of {self.servers}" if self.servers > 1 else "one"
        return f"{kind} nats-server{'s' if self.servers > 1 else ''}, " + (
            "TLS" if self.tls else "plaintext"
        )

    async def connect(self, name: str, url: str | None = None) -> Client:
        return await bus.connect(url or self.client_url, name=name, reconnect=False, ca=self.ca)

    async def start(self, name: str, argv: list[str], **kwargs: object) -> Child:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.urls:
            env["MESH_NATS_URL"] = self.server_url
        if self.ca:
            env["MESH_CA"] = self.ca
        if self.database_url:
            env["MESH_DATABASE_URL"] = self.database_url
            env["MESH_SECRETS_KEY_FILE"] = secrets_key_file(self.folder)
        child = await spawn(name, argv, log=self.folder / "logs" / f"{name}.log", env=env, **kwargs)
        self.children.append(child)
        return child

    async def nats(self) -> list[Child]:
        """The nats-server(s), made as `mesh dev up` makes them (programs/dev_up.py start_nats):
        with TLS, a CA and a certificate per server; with several, one cluster with TLS routes."""
        client = [ports.free_port() for _ in range(self.servers)]
        cluster = [ports.free_port() for _ in range(self.servers)] if self.servers > 1 else []
        scheme = "tls" if self.tls else "nats"
        if self.tls:
            self.ca = str(mesh_tls.ensure_ca(self.folder / "ca", name="bench"))
        children = []
        for i, port in enumerate(client):
            name = f"n{i + 1}" if cluster else "bench"
            folder = self.folder / "nats" / name
            server_tls = None
            if self.ca:
                cert, key = folder / "server.pem", folder / "server.key"
                mesh_tls.issue_server(self.folder / "ca", cert, key, name=name,
                                      hosts=["127.0.0.1", "localhost"])  # fmt: skip
                server_tls = natsd.Tls(cert=cert, key=key, ca=Path(self.ca))
            conf = natsd.write_config(
                folder, port=port, name=name, tls=server_tls, max_payload=self.max_payload,
                sync_interval=self.sync_interval,
                cluster=natsd.Cluster(port=cluster[i], routes=[f"127.0.0.1:{p}" for p in cluster])
                if cluster else None,
            )  # fmt: skip
            child_name = f"nats-{name}" if cluster else "nats-server"
            children.append(await self.start(child_name, natsd.argv(conf)))
            self.urls.append(f"{scheme}://127.0.0.1:{port}")
        for child, port in zip(children, client, strict=True):
            await until(child.name, child, lambda p=port: port_open(p), within=20,
                         guard=self.guard)  # fmt: skip
        self.nats_url = ",".join(self.urls)
        if cluster:
            await self._cluster_formed(children)
        return children

    async def servers_and_store(self) -> tuple[list[Child], Child]:
        """The nats-server(s) and PostgreSQL, started and said as they come up."""
        say(f"starting {self.describe()}…")
        servers = await self.nats()
        for child, url in zip(servers, self.urls, strict=True):
            say(f"  {child.name} on {url} (pid {child.pid})")
        say("starting PostgreSQL…")
        pg = await self.postgres()
        say(f"  postgres pid {pg.pid}")
        return servers, pg

    async def _cluster_formed(self, children: list[Child]) -> None:
        """Until JetStream can place a stream on min(3, servers) of them: then the controller's
        buckets get all their replicas (mesh.blobs.ensure settles for fewer while the routes
        are still forming)."""
        replicas = min(3, self.servers)
        nc = await self.connect("bench probe", self.server_url)
        try:
            deadline = time.monotonic() + 30
            while True:
                self.guard.check()
                for child in children:
                    if not child.running:
                        raise BenchError(f"{child.name} exited; {last_lines(child)}")
                try:
                    jsm = nc.jsm()
                    await jsm.add_stream(
                        StreamConfig(name="bench-probe", subjects=["bench.probe"],
                                     num_replicas=replicas, storage=StorageType.MEMORY)
                    )  # fmt: skip
                    await jsm.delete_stream("bench-probe")
                    return
                except (APIError, nats.errors.Error) as e:
                    if time.monotonic() > deadline:
                        raise BenchError(
                            f"the cluster could not place a stream on {replicas} servers "
                            f"within 30 s: {type(e).__name__}: {e}"
                        ) from None
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def postgres(self) -> Child:
        data = self.folder / "pg"
        try:
            child, self.database_url = await postgres.start(
                data, log=self.folder / "logs" / "postgres.log", database="mesh",
                passwords=pgauth.Passwords(self.folder / "passwords"),
            )  # fmt: skip
        except postgres.PostgresFailed as e:
            raise BenchError(str(e)) from None
        self.children.append(child)
        return child

    async def controller(self, nc: Client) -> Child:
        argv = command("controller", "run", "--instance", "bench-ctl")
        child = await self.start("controller", argv)

        async def holds_seat() -> bool:
            try:
                data = await bus.request(nc, STATUS_SUBJECT, b"{}", deadline=time.monotonic() + 1)
                return wire.decode_reply(data, StatusReply).seat is not None
            except (bus.NoAnswer, wire.RemoteError):
                return False

        await until("the controller", child, holds_seat, within=60, guard=self.guard)
        return child

    async def stop(self) -> None:
        for child in reversed(self.children):  # controller/echo, postgres, nats-server(s)
            sig = signal.SIGINT if child.name == "postgres" else signal.SIGTERM
            await child.stop(sig=sig, timeout=10)


# --- simulated hosts and the rollout's plans ----------------------------------------------


class Declaration(msgspec.Struct):
    processes: dict[str, msgspec.Raw]  # only the names matter here


class Envelope(msgspec.Struct):
    """A value of `mesh-declarations` (services/host/apply.py's Envelope), as far as a simulated
    host reads it."""

    machine: str
    digest: str
    epoch: int
    declaration: Declaration


def spread(n: int, split: list[float]) -> dict[str, int]:
    """`n` machine names, sim-0001…, over tiers 0/1/2 by the percentages in `split` (each
    tier that has a share gets at least one machine; the last tier, what is left)."""
    counts = [max(1, round(n * share / 100)) if share > 0 else 0 for share in split]
    counts[-1] = n - sum(counts[:-1])
    if counts[-1] < (1 if split[-1] > 0 else 0):
        raise BenchError(f"--split {split} leaves no machine for tier {len(split) - 1}")
    width = max(4, len(str(n)))
    tiers: dict[str, int] = {}
    i = 0
    for tier, count in enumerate(counts):
        for _ in range(count):
            i += 1
            tiers[f"sim-{i:0{width}d}"] = tier
    return tiers


def write_module(folder: Path, version: int) -> Path:
    """The module at `version`: a files bundle, one process without a check, all tiers."""
    (folder / "src").mkdir(parents=True, exist_ok=True)
    (folder / "src" / "hello.txt").write_text(f"version {version}\n")
    (folder / "module.toml").write_text(
        f'[module]\nname = "{MODULE}"\ndescription = "rollout benchmark, version {version}"\n'
        '[bundle.code]\nkind = "files"\nsource = "src"\n'
        f'[process.{MODULE}]\nbundle = "code"\ncommand = ["sleep", "infinity"]\nroot = true\n'
        "[assign]\ntiers = [0, 1, 2]\n"
    )
    return folder


async def push(folder: Path, nats_url: str, logs: Path, ca: str | None) -> int:
    """`mesh push DIR --json` (without --wait: the script follows the plan itself)."""
    argv = command("push", str(folder), "--json", "--nats-url", nats_url,
                   "--timeout", str(PUSH_TIMEOUT))  # fmt: skip
    if ca:
        argv += ["--ca", ca]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    with (logs / "push.log").open("ab") as f:
        f.write(out + err)
    if proc.returncode != 0:
        raise BenchError(f"mesh push failed ({proc.returncode}): {err.decode().strip()}")
    reply = json.loads(out)
    if reply.get("plan") is None:
        raise BenchError(f"mesh push made no plan: {reply.get('message')}")
    return int(reply["plan"])
