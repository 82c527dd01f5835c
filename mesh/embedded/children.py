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
    return Child(name, proc, log)


def stop_supervised(hosts_root: Path) -> list[int]:
    """Kill the process groups the hosts under `hosts_root` supervise (their
    state/processes.json: pid and kernel start time). Hosts leave their processes running when
    they stop, so that a restarted host adopts them; a dev mesh that stops must not."""
    import json

    killed = []
    for state in sorted(hosts_root.glob("*/state/processes.json")):
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
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return killed


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
