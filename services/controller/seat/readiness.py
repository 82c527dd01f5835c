"""The controller's own readiness, for the check of its module (`mesh controller ready`).

When the host runs the controller as a process, `$MESH_FILES` is its private folder: the
controller writes `ready` there every second, saying whether it holds the seat or stands by
ready to take it. The check passes only on a fresh file from a live process, so a controller
that hangs, or lost NATS or its lock session, stops passing within seconds.
"""

import json
import os
import time
from pathlib import Path

import anyio

from mesh.model import SeatRole

EVERY = 1.0
STALE_AFTER = 5.0
READY: tuple[SeatRole, ...] = ("holding", "standby")


def default_file() -> Path | None:
    folder = os.environ.get("MESH_FILES")
    return Path(folder) / "ready" if folder else None


class Readiness:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.state: SeatRole = "starting"
        self.epoch = 0

    def set(self, state: SeatRole, epoch: int = 0) -> None:
        self.state, self.epoch = state, epoch
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        body = {"pid": os.getpid(), "state": self.state, "epoch": self.epoch, "at": time.time()}
        tmp = self.path.with_name(".ready.tmp")
        try:
            tmp.write_text(json.dumps(body))
            tmp.replace(self.path)
        except OSError:
            pass  # the check then fails on a stale file, which is the truth

    async def keep_writing(self) -> None:
        while True:
            self._write()
            await anyio.sleep(EVERY)


def problem(path: Path) -> str | None:
    """None when the controller that writes `path` holds the seat or stands by ready."""
    try:
        found = json.loads(path.read_text())
        pid, state, at = int(found["pid"]), str(found["state"]), float(found["at"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path}: no readiness ({e})"
    age = time.time() - at
    if age > STALE_AFTER:
        return f"{path}: written {age:.0f}s ago by pid {pid}: not alive"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"{path}: pid {pid} is gone"
    except PermissionError:
        pass  # alive, another account's
    if state not in READY:
        return f"controller pid {pid} is {state}"
    return None
