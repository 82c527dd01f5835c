"""The host agent hands itself over to a new version of itself (the process named mesh-host).

The agent being replaced is the one that applies the change, so the two agents agree over a
socket pair the old one passes to the new one (`--successor-fd`):

1. The old agent has applied everything else of the declaration. It starts the new agent from
   the new bundle with the arguments it was itself started with, in a session of its own.
2. The new agent connects to NATS and says `ready`. It exits at once if it cannot: then the old
   agent, which has changed nothing, reports the step `agent` failed and runs on (the safe
   failure); the plan stops and reverts as any plan.
3. The old agent stops being the agent: its verbs drain, it stops beating and supervising
   (its processes keep running: stopping an agent never stops them), it leaves NATS, and it
   says `go`.
4. The new agent adopts every process (same pids), serves, registers, applies the declaration
   (now naming its own bundle: nothing left to do) and says `running`. The old agent exits.
   Should the new agent die between `go` and `running`, the old one kills it and runs itself
   again from the start (exec, same pid), adopting everything back, and reports the failure.

A failure is remembered in ROOT/state/agent-failed.json for that bundle, so the agent does not
try the same bundle again and again while the plan reverts; applying its own bundle forgets it.
The new agent's pid is in ROOT/agent.pid (`mesh dev up` follows it there). Under systemd, the
new agent tells the service manager its pid (MAINPID) before the old one exits.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.to_thread

from mesh import version
from mesh.errors import MeshError

log = logging.getLogger(__name__)

FLAG = "--successor-fd"
START_WITHIN = 30.0  # the new agent's start, until it says ready
GO_WITHIN = 30.0  # the new agent's wait for the old one to let go
RUNNING_WITHIN = 60.0  # from go until the new agent runs the machine


class Failed(MeshError):
    """The new agent did not take over; the old one runs on."""


def own_key() -> str:
    """This agent's bundle key in a declaration: `mesh:sha256:…`, or `mesh:installed`."""
    return f"mesh:{version.running()}"


def pid_file(root: Path) -> Path:
    return root / "agent.pid"


def _failures(root: Path) -> Path:
    return root / "state" / "agent-failed.json"


def failure(root: Path, key: str) -> str | None:
    """Why handing over to bundle `key` failed here before, if it did."""
    try:
        found = json.loads(_failures(root).read_text())
        return str(found["error"]) if found.get("bundle") == key else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def record_failure(root: Path, key: str, error: str) -> None:
    path = _failures(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"bundle": key, "error": error}))
    tmp.replace(path)


def forget_failure(root: Path) -> None:
    _failures(root).unlink(missing_ok=True)


def relaunch_args(argv: list[str]) -> list[str]:
    """This agent's own arguments (after the program), without a successor's socket."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == FLAG:
            skip = True
        elif not word.startswith(FLAG + "="):
            out.append(word)
    return out


async def _line(sock: socket.socket, within: float) -> bytes:
    """One line from the other agent; b"" when it closed its end (exited) or time ran out."""

    def read() -> bytes:
        sock.settimeout(within)
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = sock.recv(64)
                if not chunk:
                    return b""
                data += chunk
        except (TimeoutError, OSError):
            return b""
        return data.strip()

    return await anyio.to_thread.run_sync(read, abandon_on_cancel=True)


def _send(sock: socket.socket, word: bytes) -> bool:
    try:
        sock.sendall(word + b"\n")
        return True
    except OSError:
        return False


class Started:
    """The new agent, started and ready; the old one still runs the machine."""

    def __init__(self, key: str, proc: subprocess.Popen, sock: socket.socket, bundle: Path) -> None:
        self.key = key  # the bundle's key in the declaration
        self.proc = proc
        self.sock = sock
        self.bundle = bundle

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: it and nothing else
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()


def _exit_of(proc: subprocess.Popen, *, waited: str, within: float) -> str:
    """What became of the new agent, which closed its end or said nothing for `within` s: its
    exit (given a moment to end, once its socket closed), or the word it never said."""
    try:
        code = proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return f"did not say it was {waited} within {within:g}s"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _spawn(argv: list[str], fd: int) -> subprocess.Popen:
    # Its output goes where ours goes; its own session, so stopping us never stops it.
    return subprocess.Popen(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, start_new_session=True)


async def start(key: str, bundle: Path, args: list[str]) -> Started:
    """Start the new agent from `bundle` and wait until it is ready; raise Failed otherwise
    (it is then stopped, and nothing of this agent has changed)."""
    mine, theirs = socket.socketpair()
    argv = [str(bundle / "mesh"), *args, FLAG, str(theirs.fileno())]
    log.info("starting the new host agent from %s", bundle)
    try:
        proc = await anyio.to_thread.run_sync(_spawn, argv, theirs.fileno())
    except OSError as e:
        mine.close()
        raise Failed(f"the new agent ({bundle.name}) could not start: {e}") from None
    finally:
        theirs.close()
    started = Started(key, proc, mine, bundle)
    said = await _line(mine, START_WITHIN)
    if said != b"ready":
        why = await anyio.to_thread.run_sync(
            lambda: _exit_of(proc, waited="ready", within=START_WITHIN)
        )
        started.kill()
        raise Failed(f"the new agent ({bundle.name}, pid {proc.pid}) {why}; its output is in "
                     "this host's log; this agent runs on")  # fmt: skip
    return started


class Handing:
    """The old agent's side, as its apply calls it (Applier's `hand_over`): start the new agent
    from a bundle; once it is ready, stop everything of this agent (`scope`: the agent's task
    group) and leave `started` for `commit`, which the agent calls once it has stopped."""

    def __init__(self, args: list[str], scope: anyio.CancelScope) -> None:
        self._args = args  # this agent's own arguments, given to the new one
        self._scope = scope
        self.started: Started | None = None  # the new agent, once it said it is ready

    async def __call__(self, key: str, bundle: Path) -> None:
        """Raises Failed, changing nothing."""
        self.started = await start(key, bundle, self._args)
        self._scope.cancel()
        await anyio.sleep_forever()  # cancelled: the apply ends here, nothing saved


async def commit(started: Started, root: Path) -> None:
    """Let go: the new agent takes the machine. Returns once it runs it; if it dies first, it
    is killed and this agent runs itself again (exec: the same pid) to take everything back."""
    pid = started.proc.pid
    if _send(started.sock, b"go") and await _line(started.sock, RUNNING_WITHIN) == b"running":
        log.info("handed this machine over to the new agent (pid %d, %s)", pid, started.key)
        started.sock.close()
        return
    what = _exit_of(started.proc, waited="running", within=RUNNING_WITHIN)
    why = f"the new agent ({started.bundle.name}, pid {pid}) {what} after it was handed the " \
          "machine; the old agent took it back"  # fmt: skip
    started.kill()
    record_failure(root, started.key, why)
    log.error("%s: running again from the start", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    # The same interpreter, flags and arguments, less a successor's socket (long closed).
    os.execv(sys.executable, relaunch_args(sys.orig_argv))


class Successor:
    """The new agent's side: told by the old one when the machine is its own."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)

    async def ready_then_wait(self) -> None:
        """Say ready; return once the old agent let go. Raise Failed if it does not."""
        if not _send(self.sock, b"ready") or await _line(self.sock, GO_WITHIN) != b"go":
            raise Failed(f"the agent that started this one did not let go within {GO_WITHIN:g}s")

    def running(self) -> None:
        _send(self.sock, b"running")
        self.sock.close()
        notify_manager()


def notify_manager() -> None:
    """Under systemd (Type=notify, NotifyAccess=all): this process is the service's main one,
    and ready (an agent's first start says so once registered; a new version once it runs)."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where:
        return
    address = "\0" + where[1:] if where.startswith("@") else where
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(f"MAINPID={os.getpid()}\nREADY=1".encode(), address)
    except OSError as e:
        log.warning("could not tell the service manager our pid: %s", e)
