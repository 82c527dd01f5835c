"""Small helpers shared by tests: verb calls over a real NATS connection, `mesh dev up` run
as a user runs it."""

import asyncio
import json
import os
import pwd
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoKeysError

from mesh.modules.meshsource import PACKAGES, PROJECT_FILE

MESH = [sys.executable, "-P", "-m", "mesh"]
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
    *args: str, nats_url: str, timeout: float = 60, creds: str | None = None
) -> subprocess.CompletedProcess:
    """Run the `mesh` command line as a user would (with `creds` as MESH_CREDS, or none)."""
    env = {k: v for k, v in os.environ.items() if k != "MESH_CREDS"}
    return subprocess.run(
        [*MESH, *args],
        capture_output=True,
        text=True,
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


def account_of(pid: int) -> str:
    """The name of the account a process runs as."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return pwd.getpwuid(int(line.split()[1])).pw_name
    raise AssertionError(f"no Uid line for pid {pid}")


def ok(done: subprocess.CompletedProcess) -> str:
    """A command that worked: its output."""
    assert done.returncode == 0, done.stderr
    return done.stdout


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """A command that failed as a user should see it: exit 1, one line, no traceback."""
    assert done.returncode == 1, done.stdout
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


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
