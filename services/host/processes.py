"""The exec driver: starting, watching, adopting and stopping one OS process.

A process runs without a shell, as its account (setuid/setgid, no supplementary groups but its
own), in its own session and process group, with its output appended to its log file. Every
instance is recorded (pid + kernel start time) so a restarted host adopts it instead of starting
it again; `os.pidfd_open` watches a process whether or not it is our child.
"""

import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import msgspec

log = logging.getLogger(__name__)

LOG_KEEP = 3
LOG_ROTATE_AT = 10 * 2**20


class Instance(msgspec.Struct):
    """One running OS process of a declared process."""

    pid: int
    start_time: int  # clock ticks since boot (/proc/<pid>/stat field 22): pid reuse is no match
    spec: str  # digest of the declared process it runs
    child: bool = True  # started by this host process (we reap it) or adopted


def start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def alive(instance: Instance) -> bool:
    return start_time(instance.pid) == instance.start_time


def rotate(log_file: Path) -> None:
    """At each start: keep the last LOG_KEEP logs once the current one is large."""
    if not log_file.exists() or log_file.stat().st_size < LOG_ROTATE_AT:
        return
    for n in range(LOG_KEEP - 1, 0, -1):
        older = log_file.with_suffix(f".log.{n}")
        if older.exists():
            older.replace(log_file.with_suffix(f".log.{n + 1}"))
    log_file.replace(log_file.with_suffix(".log.1"))


_children: dict[int, subprocess.Popen] = {}


def credentials(uid: int | None, gid: int | None, groups: Sequence[int] = ()) -> dict:
    """subprocess arguments that drop to the account (as root; in dev mode, nothing to drop)."""
    if uid is None or os.geteuid() != 0:
        return {}
    return {"user": uid, "group": gid, "extra_groups": list(groups)}


def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log_file: Path,
    spec: str,
    uid: int | None,
    gid: int | None,
    groups: Sequence[int] = (),
) -> Instance:
    """Start `argv`; raises OSError (e.g. no such file) for the caller to report."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.parent.chmod(0o700)  # output may carry secrets: the host's (root's) alone
    rotate(log_file)
    with os.fdopen(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            **credentials(uid, gid, groups),
        )
    # Held until we reap it ourselves: a collected Popen of a live process would be reaped by
    # the subprocess module behind our back, and its exit code lost.
    _children[proc.pid] = proc
    started = start_time(proc.pid)
    return Instance(pid=proc.pid, start_time=started or 0, spec=spec, child=True)


async def wait(instance: Instance) -> int | None:
    """Until the instance exits: its exit code if it was our child, else None."""
    try:
        fd = os.pidfd_open(instance.pid)
    except ProcessLookupError:
        return _reap(instance)
    try:
        if not alive(instance):
            return _reap(instance)
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)
    return _reap(instance)


def _reap(instance: Instance) -> int | None:
    if not instance.child:
        return None
    proc = _children.pop(instance.pid, None)
    if proc is not None:
        return proc.wait()  # it has exited: this reaps it and gives its code (-N: signal N)
    try:
        _, status = os.waitpid(instance.pid, 0)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status)


async def stop(instance: Instance, *, timeout: float) -> None:
    """SIGTERM to the process group, SIGKILL after `timeout`; returns once it is gone, and its
    group with it (children that ignored SIGTERM, or outlived their leader)."""
    if not alive(instance):
        _reap(instance)
        kill_group(instance.pid)
        return
    try:
        os.killpg(instance.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    with anyio.move_on_after(timeout) as waiting:
        await wait(instance)
    if waiting.cancelled_caught:
        log.info("process %d did not stop within %gs: SIGKILL", instance.pid, timeout)
        try:
            os.killpg(instance.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with anyio.move_on_after(5):
            await wait(instance)
    kill_group(instance.pid)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
