"""Child processes of `mesh dev up` and of the test fixtures: started, logged, and always stopped.

Each child gets its own session (a Ctrl-C in the terminal reaches only `mesh dev up`, which then
stops the children in order) and a parent-death signal, so not even a SIGKILL of the parent
leaves a stray server behind.
"""

import asyncio
import ctypes
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class Child:
    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.stopping = False
        # How it was started, for a service manager to start it the same way (programs/units.py)
        self.argv: list[str] = []
        self.env: dict[str, str] | None = None  # None: ours
        self.cwd: Path | None = None
        self.user: str | None = None  # the account it was dropped to, if any
        # Processes that serve it and go with it: the store's TLS front, a standby's relay
        # (mesh/embedded/postgres.py). Not stopped by `stop`: their owner stops each in turn.
        self.companions: list[Child] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self, *, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal the child, wait up to `timeout`, then SIGKILL its whole process group."""
        self.stopping = True
        if self.running:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass
            with anyio.move_on_after(timeout):
                await self.proc.wait()
        try:
            os.killpg(self.pid, signal.SIGKILL)  # whatever it left in its group
        except (ProcessLookupError, PermissionError):
            pass
        if self.running:
            await self.proc.wait()
        return self.proc.returncode


async def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    detached: bool = False,
    **credentials: Any,
) -> Child:
    """Start `argv`; `credentials` (user, group, extra_groups) drop privileges. A detached child
    outlives us (`mesh init`'s servers); any other dies with us."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=None if detached else _die_with_parent,
            cwd=cwd,
            **credentials,
        )
    child = Child(name, proc, log)
    child.argv, child.cwd, child.user = list(argv), cwd, credentials.get("user")
    child.env = dict(env) if env is not None else None
    return child


async def respawn(child: Child, *, detached: bool = False) -> Child:
    """`child` started again as it was (its argv, environment, folder and account), to the same
    log: a supervisor's restart."""
    user = child.user
    credentials = {"user": user, "group": user, "extra_groups": []} if user else {}
    return await spawn(child.name, child.argv, log=child.log, env=child.env, cwd=child.cwd,
                       detached=detached, **credentials)  # fmt: skip


class NotOurs:
    """A process that is not our child, watched through a pidfd: a host agent's new version,
    started by the agent it replaced (services/host/successor.py), then left to init. Enough of
    asyncio's Process for Child: pid, returncode (unknown: 0 once gone), wait, send_signal."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._fd = os.pidfd_open(pid)

    async def wait(self) -> int:
        if self.returncode is None:
            await anyio.wait_readable(self._fd)  # readable once the process has ended
            os.close(self._fd)
            self.returncode = 0
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def successor_of(child: Child, pid_file: Path) -> Child | None:
    """The agent that took over from `child` (which has exited), by the pid it wrote, if one
    is alive."""
    try:
        pid = int(pid_file.read_text().strip())
        return None if pid == child.pid else Child(child.name, NotOurs(pid), child.log)  # type: ignore[arg-type]
    except (OSError, ValueError):
        return None


def stop_agents(hosts_root: Path) -> list[int]:
    """Kill the host agents that run from the roots under `hosts_root` (each root's agent.pid,
    checked against the agent's command line): an agent's new version is nobody's child."""
    killed = []
    for pid_file in sorted(hosts_root.glob("*/agent.pid")):
        try:
            pid = int(pid_file.read_text().strip())
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if str(pid_file.parent).encode() not in argv:
            continue  # the pid was reused, or it is not an agent of this root
        _kill_group(pid, killed)
    return killed


def stop_supervised(hosts_root: Path) -> list[int]:
    """Kill the process groups the hosts under `hosts_root` supervise (their
    state/processes.json: pid and kernel start time). Hosts leave their processes running when
    they stop, so that a restarted host adopts them; a dev mesh that stops must not."""
    import json

    killed = []
    # tools.json: tool servers (services/host/tools.py), which a host that stops stops itself;
    # a killed host's are still there until a next host starts.
    states = [*hosts_root.glob("*/state/processes.json"), *hosts_root.glob("*/state/tools.json")]
    for state in sorted(states):
        try:
            instances = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        for instance in instances.values():
            pid, started = instance.get("pid"), instance.get("start_time")
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[19]) != started:
                continue  # the pid was reused: not ours
            _kill_group(pid, killed)
    for record in sorted(hosts_root.glob("*/state/cgroups.json")):
        remove_cgroups(record)
    return killed


def remove_cgroups(record: Path) -> None:
    """A host's processes' cgroups (services/host/limits.py; `record` lists the folders it
    made, one per hierarchy): whatever still runs in them is killed, and the folders go."""
    import json
    import time

    try:
        parents = [Path(p) for p in json.loads(record.read_text())]
    except (OSError, ValueError, TypeError):
        return
    for parent in parents:
        try:
            leaves = [c for c in parent.iterdir() if c.is_dir()]
        except OSError:
            continue
        for leaf in [*leaves, parent]:
            deadline = time.monotonic() + 5  # a killed process leaves its cgroup a moment later
            while leaf.exists() and time.monotonic() < deadline:
                try:
                    leaf.rmdir()
                except OSError:
                    for pid in _cgroup_pids(leaf):
                        _kill(pid)
                    time.sleep(0.02)


def _cgroup_pids(folder: Path) -> list[int]:
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: int, killed: list[int]) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
        killed.append(pid)
    except (ProcessLookupError, PermissionError):
        pass


def remove_containers(hosts_root: Path) -> list[str]:
    """Remove the containers the hosts under `hosts_root` created (labelled with their root), if
    a container engine is here at all."""
    import shutil

    if shutil.which("docker") is None:
        return []
    removed = []
    for root in sorted(p.resolve() for p in hosts_root.glob("*") if p.is_dir()):
        found = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=mesh.root={root}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        ids = found.stdout.split() if found.returncode == 0 else []
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True, timeout=120)
            removed += ids
    return removed
