"""Plain helpers every test may use (fixtures are conftest.py's): verb calls over a real NATS
connection, the `mesh` command line run as a user runs it, a fleet started and waited for,
plans' tier order, `mesh dev up` read line by line, a copy of the mesh. No test module imports
another: what two of them share lives here, or in a module of tests/ named by what it holds
(module_folders.py, faults.py, standby.py, secured.py, netns.py, fuzzing.py)."""

import asyncio
import contextlib
import fcntl
import itertools
import json
import os
import pwd
import queue
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import NoKeysError

from mesh.embedded.children import remove_containers, stop_agents, stop_supervised
from mesh.entry import command
from mesh.modules.meshsource import PACKAGES, PROJECT_FILE

MESH = command()
CHECKOUT = Path(__file__).parent.parent


async def ask(nc: Client, subject: str, body: bytes | dict = b"{}", timeout: float = 2) -> Any:
    """One request; returns the decoded JSON reply, or None if nobody answered in time."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except (NoRespondersError, NatsTimeout):
        return None
    return json.loads(msg.data)


def wait_until(predicate: Callable[[], object], *, within: float, what: str) -> object:
    """Poll `predicate` until it returns something truthy; fail the test after `within` s."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within:g}s waiting for {what}")
        time.sleep(0.05)  # ok: polling interval of a condition with a deadline


async def await_until(predicate, *, within: float, what: str):
    """Async form of wait_until: `predicate` is an async callable."""
    deadline = time.monotonic() + within
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(0.05)  # ok: polling interval of a condition with a deadline


def mesh_cli(
    *args: str,
    nats_url: str,
    creds: str | None = None,
    stdin: str | None = None,
    answer: float | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess:
    """Run the `mesh` command line as a user would: on `nats_url`, with `creds` as MESH_CREDS
    (or none), `stdin` as its input; `answer` is its --timeout (how long it waits for an
    answer; its own default without); the whole command may take `timeout` seconds. The
    conftest fixture `cli` is this on the test's own NATS."""
    env = {k: v for k, v in os.environ.items() if k != "MESH_CREDS"}
    return subprocess.run(
        [*MESH, *args, *(["--timeout", f"{answer:g}"] if answer is not None else [])],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=timeout,
        env={**env, "MESH_NATS_URL": nats_url, **({"MESH_CREDS": creds} if creds else {})},
    )


async def next_failure(events, *, within: float) -> dict:
    """The next apply event that failed, from a subscription to mesh.event.<name>.applied."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no failed apply within {within:g}s")
        event = json.loads((await events.next_msg(timeout=left)).data)
        if not event["ok"]:
            return event


def engine_answers() -> bool:
    """A Docker Engine is here and answers."""
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


# The seed's container is named mesh-controller on this machine's one engine, and a mesh whose
# hosts deploy services/controller retires a container of that name once its controller process
# is healthy: `mesh init` of one test would take the story's container away (CI saw it). The story
# holds this lock alone; meshes that deploy the controller hold it together.
SEEDS_CONTAINER_LOCK = Path(tempfile.gettempdir()) / "mesh-test-seeds-container.lock"


@contextlib.contextmanager
def seeds_container(*, alone: bool, within: float = 600):
    with open(SEEDS_CONTAINER_LOCK, "a") as f:
        mode = (fcntl.LOCK_EX if alone else fcntl.LOCK_SH) | fcntl.LOCK_NB

        def taken() -> bool:
            try:
                fcntl.flock(f, mode)
            except BlockingIOError:
                return False
            return True

        wait_until(taken, within=within, what="the turn at the container named mesh-controller")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def account_of(pid: int) -> str:
    """The name of the account a process runs as."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return pwd.getpwuid(int(line.split()[1])).pw_name
    raise AssertionError(f"no Uid line for pid {pid}")


def ok(done: subprocess.CompletedProcess) -> str:
    """A command that worked: its output."""
    assert done.returncode == 0, f"{done.args}: {done.stderr}{done.stdout}"
    return done.stdout


def ok_json(done: subprocess.CompletedProcess) -> Any:
    """A command that worked (with --json): its output, decoded."""
    return json.loads(ok(done))


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """A command that failed as a user should see it: exit 1, one line, no traceback."""
    assert done.returncode == 1, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def js(nc: Client, timeout: float = 30) -> JetStreamContext:
    """A JetStream context for a test's reads of the buckets: 30 s for each API request, not
    nats-py's 5 s. A test asserts what is stored, not how fast; in CI's second pass, hosts'
    tests beside each other, a 5 s `kv.get` timed out once (test_modules). A test that asks
    again while a stream elects its leader gives a shorter `timeout`: a request sent into the
    election goes unanswered, and the next one is what gets through."""
    return nc.jetstream(timeout=timeout)


async def kv_read(nc: Client, bucket: str, read: Callable[[Any], Any], *, what: str,
                  within: float = 60) -> Any:  # fmt: skip
    """`await read(kv)` on the bucket, asked again until it gives something, each try 5 s: a
    request sent while the test's connection reconnects, or while the stream elects its
    leader, goes unanswered, and the next one gets through (CI saw one 30 s try, sent as the
    connection broke, take a test's whole deadline)."""

    async def once() -> Any:
        try:
            return await read(await js(nc, timeout=5).key_value(bucket))
        except NatsTimeout:
            return None

    return await await_until(once, within=within, what=what)


async def kv_keys(kv, *, within: float = 30) -> list[str]:
    """The keys of a KV bucket. nats-py's `keys()` lists them through a watcher that now and
    then, on a loaded machine or right after a fault, reports none (NoKeysError) or times out:
    asked again until `within`; still none at the deadline fails the test."""

    async def listed():
        try:
            return await kv.keys()
        except (NoKeysError, NatsTimeout):
            return None

    return await await_until(listed, within=within, what=f"the keys of {kv._name}")


async def kv_history(kv, key: str, *, within: float = 30) -> list:
    """A key's history, asked again as `kv_keys` asks (nats-py reads it through the same kind
    of watcher, which on a cluster now and then reports nothing right after a fault)."""

    async def read():
        try:
            return await kv.history(key)
        except (NoKeysError, NatsTimeout):
            return None

    return await await_until(read, within=within, what=f"the history of {key}")


async def exited(proc: subprocess.Popen) -> tuple[int] | None:
    """For await_until: (its exit code,) once `proc` has exited (a tuple, so that exit code 0
    is truthy too), else None."""
    code = proc.poll()
    return None if code is None else (code,)


async def already(value: object) -> object:
    """For await_until: a condition already computed (`lambda: already(n > 20)`)."""
    return value


class Procs:
    """Processes a test started; all are killed (process group, SIGKILL) at teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, **kw):
        log = open(self.folder / f"{name}.log", "ab")
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=kw.pop("stdout", log),
            stderr=kw.pop("stderr", subprocess.STDOUT),
            env={**os.environ, **(env or {})},
            start_new_session=True,
            **kw,
        )
        proc.log_path = self.folder / f"{name}.log"  # type: ignore[attr-defined]
        self.started.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        stop_agents(self.folder / "hosts")  # an agent's new version is nobody's child
        stop_supervised(self.folder / "hosts")  # what the test's hosts started, hosts gone
        remove_containers(self.folder / "hosts")


# --- a fleet: controllers and hosts up ------------------------------------------------------


async def node_named(nc: Client, name: str, *, timeout: float = 2) -> dict | None:
    """Machine `name` as `nodes` lists it, or None (not listed, or nobody answered)."""
    reply = await ask(nc, "mesh.ctl.nodes", timeout=timeout)
    return next((n for n in reply["nodes"] if n["name"] == name), None) if reply else None


async def held_status(nc: Client, *, timeout: float = 1) -> dict | None:
    """`status` as a holder answers it, or None (nobody answered, or no seat in the reply)."""
    s = await ask(nc, "mesh.ctl.status", timeout=timeout)
    return s if s and s.get("seat") else None


async def hosts_up(nc: Client, count: int, *, within: float = 30) -> dict:
    """`status` once a holder answers it with `count` hosts up."""

    async def up() -> dict | None:
        s = await held_status(nc, timeout=2)
        return s if s and s["nodes"]["up"] == count else None

    return await await_until(up, within=within, what=f"{count} host(s) up")


async def standing_by(nc: Client, instance: str) -> dict | None:
    """`status` if it lists controller `instance` among the standbys, else None."""
    s = await held_status(nc)
    return s if s and instance in [b["instance"] for b in s["standbys"]] else None


def environment_of(pid: int) -> dict[str, str] | None:
    """A process's environment as the kernel has it (/proc/PID/environ); None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


async def running(nc: Client, process: str, variable: str) -> dict[str, tuple[int, str | None]]:
    """machine -> (pid, `variable` in its environment) of each healthy process `process`, as
    `nodes` lists them: what version a machine runs, read from the process itself."""
    found: dict[str, tuple[int, str | None]] = {}
    for n in (await ask(nc, "mesh.ctl.nodes") or {"nodes": []})["nodes"]:
        for p in n["processes"]:
            if p["name"] == process and p["healthy"] and p["pid"] and not p.get("trial"):
                env = environment_of(p["pid"])
                if env is not None:
                    found[n["name"]] = (p["pid"], env.get(variable))
    return found


@dataclass
class Fleet:
    """What fleet_up started: controllers and hosts by name, their processes."""

    controllers: dict[str, subprocess.Popen] = field(default_factory=dict)
    hosts: dict[str, subprocess.Popen] = field(default_factory=dict)


async def fleet_up(
    nc: Client,
    *,
    start_controller: Callable[..., subprocess.Popen],
    start_host: Callable[..., subprocess.Popen],
    hosts: int,
    builder: bool = False,
    controllers: Sequence[str] = ("ctl-a",),
    within: float = 30,
) -> Fleet:
    """The first of `controllers` holding the seat with node-1..N up in tiers 0, 1, 2 (the
    rest in tier 2; node-1 labelled builder=true with `builder`), then each other controller
    standing by. `start_controller(name)` and `start_host(name, *flags)` start a piece: the
    conftest fixtures' (its `start_fleet` is this on the test's own servers), or a test's own
    (in network namespaces, on a store of its own)."""
    first, *standbys = controllers
    fleet = Fleet(controllers={first: start_controller(first)})
    for i in range(hosts):
        name = f"node-{i + 1}"
        label = ["--label", "builder=true"] if builder and i == 0 else []
        fleet.hosts[name] = start_host(name, "--tier", str(min(i, 2)), *label)
    await hosts_up(nc, hosts, within=within)
    for name in standbys:
        fleet.controllers[name] = start_controller(name)
        await await_until(lambda n=name: standing_by(nc, n), within=within,
                          what=f"{name} standing by")  # fmt: skip
    return fleet


# --- plans ------------------------------------------------------------------------------------


def assert_tier_order(plan: dict) -> None:
    """Every step of a tier finished before any step of a later tier started."""
    tiers = sorted({s["tier"] for s in plan["steps"]})
    for earlier, later in itertools.pairwise(tiers):
        last_end = max(when(s["finished"]) for s in plan["steps"] if s["tier"] == earlier)
        started = [when(s["started"]) for s in plan["steps"] if s["tier"] == later and s["started"]]
        assert all(last_end <= t for t in started), (earlier, later, plan["steps"])


def when(text: str | None) -> datetime:
    """A time a reply gives (ISO 8601), which must be there."""
    assert text is not None
    return datetime.fromisoformat(text)


# --- `mesh dev up`, as a user runs it -------------------------------------------------------


def env_file(folder: Path) -> dict[str, str]:
    """What `source FOLDER/env` exports (`mesh dev up`'s, `mesh init`'s)."""
    exported = {}
    for line in (folder / "env").read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        exported[name] = shlex.split(value)[0]
    return exported


class DevUp:
    """`mesh dev up` (`--hosts N --dir FOLDER --port 0`, then `extra`) in its own session, its
    lines read as they come, as a user sees them."""

    def __init__(self, folder: Path, *extra: str, hosts: int = 3) -> None:
        self.folder = folder
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.proc = subprocess.Popen(
            [*MESH, "dev", "up", "--hosts", str(hosts), "--dir", str(folder), "--port", "0",
             *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def match(self, pattern: str, within: float) -> re.Match:
        """The next line matching `pattern` (from its start), within `within` seconds."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            found = re.match(pattern, line)
            if found:
                return found
        pytest.fail(
            f"no line matching {pattern!r} within {within:g}s; saw:\n" + "\n".join(self.seen)
        )

    def wait_for(self, prefix: str, within: float) -> str:
        """The next line starting with `prefix`."""
        return self.match(re.escape(prefix), within).string

    def ready(self, within: float = 120) -> str:
        """The URL(s) of its `ready` line."""
        return self.match(r"ready (\S+)$", within).group(1)

    def pids(self) -> list[int]:
        """Every pid its lines named so far ("… pid 123)")."""
        return [int(m) for line in self.seen for m in re.findall(r"pid (\d+)", line)]

    def drain(self) -> None:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return

    def stop(self, within: float = 90) -> None:
        """SIGTERM, as a user stops it: it stops every piece and exits 0."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=within)
        assert code == 0, "\n".join(self.seen)

    def kill(self) -> None:
        """Whatever is left, even when a test failed: SIGTERM first, then its process group,
        then every pid its lines or its servers' pid files name that still runs from FOLDER."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.drain()
        pids = self.pids()
        for pid_file in self.folder.glob("nats/n*/nats.pid"):
            try:
                pids.append(int(pid_file.read_text().strip()))
            except (OSError, ValueError):
                pass
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                ours = str(self.folder).encode() in cmdline or Path(
                    f"/proc/{pid}/cwd"
                ).resolve().is_relative_to(self.folder.resolve())
                if ours:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass


class StatusEvery10ms:
    """`status` every 10 ms, each sent once with a 5 s timeout; what was not answered."""

    def __init__(self) -> None:
        self.sent = 0
        self.unanswered: list[str] = []
        self.holders: list[tuple[str, int]] = []

    async def run(self, nc: Client, stop: anyio.Event) -> None:
        async def one() -> None:
            sent = time.time()
            try:
                msg = await nc.request("mesh.ctl.status", b"{}", timeout=5)
            except (NoRespondersError, NatsTimeout) as e:
                at = time.strftime("%H:%M:%S", time.localtime(sent))
                at += f".{int(sent % 1 * 1000):03d}"
                self.unanswered.append(f"{type(e).__name__}, sent at {at}")
                return
            reply = json.loads(msg.data)
            if "error" in reply:
                self.unanswered.append(str(reply["error"]))
                return
            seat = (reply["seat"]["holder"], reply["seat"]["epoch"])
            if not self.holders or self.holders[-1] != seat:
                self.holders.append(seat)

        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                self.sent += 1
                tg.start_soon(one)
                await anyio.sleep(0.01)  # ok: the client's sending rate, not synchronisation


def mesh_copy(folder: Path, marker: str, *, broken_agent: str = "") -> Path:
    """A copy of this checkout's mesh, marked. `broken_agent`: its host agent exits 3 at start
    ("at start"), or exits 4 as soon as the old agent has let go ("after go")."""
    for package in PACKAGES:
        shutil.copytree(
            CHECKOUT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(CHECKOUT / PROJECT_FILE, folder / PROJECT_FILE)
    with open(folder / "mesh" / "version.py", "a") as f:
        f.write(f"\nMARKER = {marker!r}  # a test's version of the mesh\n")
    if broken_agent:
        main = folder / "services" / "host" / "main.py"
        text = main.read_text()
        let_go = "the old agent let go: taking the machine over"
        where, code = {
            "at start": ('    root = (root or Path("/")).resolve()\n', 3),
            "after go": (f'        log.info("host %s: {let_go}", name)\n', 4),
        }[broken_agent]
        assert where in text, where
        indent = where[: len(where) - len(where.lstrip())]
        broken = f"{indent}raise SystemExit({code})  # broken\n"
        main.write_text(text.replace(where, broken + where))
    return folder
