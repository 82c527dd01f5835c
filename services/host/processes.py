"""The exec driver: starting, watching, adopting and stopping one OS process.

A process runs without a shell, as its account (setuid/setgid and the account's supplementary
groups), in its own session and process group. Its output goes through a pipe to a log writer
(`logwriter.py`, a process of its own that outlives the host as the process does), which appends
to its log file and rotates it by size while it runs. Every instance is recorded (pid + kernel
start time) so a restarted host adopts it instead of starting it again; `os.pidfd_open` watches
a process whether or not it is our child. A tool server is started the same way, but with its
stdin and stdout as pipes to the host (MCP over stdio) and only its stderr to its log.
"""

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import anyio
import msgspec

from services.host import limits, logwriter

log = logging.getLogger(__name__)

# A process's log: output.log and at most LOG_KEEP older files (output.log.1 …), each at most
# LOG_MAX_BYTES. The environment of the host may set both (tests use small ones).
LOG_MAX_BYTES = int(os.environ.get("MESH_PROCESS_LOG_BYTES", 10 * 2**20))
LOG_KEEP = int(os.environ.get("MESH_PROCESS_LOG_KEEP", 3))
PIPE_BUF = 4096  # a write of at most this many bytes to a pipe is never split (POSIX: >= 512)
LOG_WRITER = Path(logwriter.__file__)


class Instance(msgspec.Struct):
    """One running OS process of a declared process."""

    pid: int
    start_time: int  # clock ticks since boot (/proc/<pid>/stat field 22): pid reuse is no match
    spec: str  # digest of the declared process it runs
    child: bool = True  # started by this host process (we reap it) or adopted
    # Its cgroup's folders (services/host/limits.py), kept for a next host: it stays in them.
    cgroups: dict[str, str] = {}


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


_children: dict[int, subprocess.Popen] = {}
_writers: list[subprocess.Popen] = []  # log writers this host started, until reaped
_writer_of: dict[int, subprocess.Popen] = {}  # an instance's (by pid), until it has exited


def _reap_writers() -> None:
    """Collect the log writers that have exited (each does once its process is gone)."""
    _writers[:] = [w for w in _writers if w.poll() is None]


def _log_writer(log_file: Path) -> tuple[int, subprocess.Popen]:
    """Start the log writer of one instance; the write end of its pipe, for the process."""
    read_end, write_end = os.pipe()
    try:
        writer = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LOG_WRITER), str(log_file), str(LOG_MAX_BYTES),
             str(LOG_KEEP)],
            stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
            env={}, start_new_session=True, close_fds=True,
        )  # fmt: skip
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    _writers.append(writer)
    return write_end, writer


async def drained(instance: Instance, *, within: float) -> None:
    """Until the log writer of an instance that has exited has written all it printed (it
    ends with the pipe), at most `within` seconds: its last lines are then in its log."""
    writer = _writer_of.pop(instance.pid, None)
    if writer is None:  # an adopted instance's: another host started its writer
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        await anyio.to_thread.run_sync(writer.wait, within)


def credentials(uid: int | None, gid: int | None, groups: Sequence[int] = ()) -> dict:
    """subprocess arguments that drop to the account (as root; in dev mode, nothing to drop)."""
    if uid is None or os.geteuid() != 0:
        return {}
    return {"user": uid, "group": gid, "extra_groups": list(groups)}


class Pipes(NamedTuple):
    """The host's ends of a piped process's stdin and stdout (non-blocking; the host's to close)."""

    stdin: int  # written by the host
    stdout: int  # read by the host


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
    piped: bool = False,
    cgroups: Mapping[str, str] | None = None,
    files_max: int | None = None,
    marker: bytes = b"",
) -> tuple[Instance, Pipes | None]:
    """Start `argv`, its output (stdout and stderr) to its log; raises OSError (e.g. no such
    file) for the caller to report. `piped`: its stdin and stdout are pipes to the host
    instead (a tool server: MCP over stdio), whose ends are returned, and only its stderr goes
    to its log; those pipes end with this host process, so no next one can adopt it.
    `cgroups`, `files_max`: the child joins that cgroup and takes that open-files limit before
    it drops to its account and execs (services/host/limits.py). `marker`: a line the log
    gets first (the host's: a start, a restart and why)."""
    cgroups = dict(cgroups or {})
    if cgroups or files_max is not None:
        who: dict = {"preexec_fn": limits.entering(cgroups, files=files_max, uid=uid, gid=gid,
                                                   groups=groups)}  # fmt: skip
    else:
        who = credentials(uid, gid, groups)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.parent.chmod(0o700)  # output may carry secrets: the host's (root's) alone
    _reap_writers()
    out, writer = _log_writer(log_file)
    ours: list[int] = []  # the host's ends of the pipes, closed if the start fails
    try:
        if marker:
            os.write(out, marker[:PIPE_BUF])  # one write, whole: nothing else writes yet
        if piped:
            child_in, host_in = os.pipe()
            ours.append(host_in)
            host_out, child_out = os.pipe()
            ours.append(host_out)
            stdio: dict = {"stdin": child_in, "stdout": child_out, "stderr": out}
        else:
            stdio = {"stdin": subprocess.DEVNULL, "stdout": out, "stderr": subprocess.STDOUT}
        try:
            proc = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
                **stdio,
                **who,
            )
        finally:
            if piped:  # the child holds its ends now
                os.close(child_in)
                os.close(child_out)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        os.close(out)  # the process holds it now; without it, the writer reads to the end
    # Held until we reap it ourselves: a collected Popen of a live process would be reaped by
    # the subprocess module behind our back, and its exit code lost.
    _children[proc.pid] = proc
    _writer_of[proc.pid] = writer
    started = start_time(proc.pid)
    instance = Instance(
        pid=proc.pid, start_time=started or 0, spec=spec, child=True, cgroups=cgroups
    )
    if not piped:
        return instance, None
    for fd in ours:
        os.set_blocking(fd, False)
    return instance, Pipes(stdin=ours[0], stdout=ours[1])


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
    _reap_writers()
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
