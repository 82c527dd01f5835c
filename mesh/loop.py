"""Which event loop every piece runs on: asyncio's own, or uvloop with MESH_LOOP=uvloop.

Measured (docs/performance.md, Verbs over TLS): uvloop takes a few µs off each request the
controller answers, less than what the serving path's own work was (mesh/serving.py); and its
subprocesses refuse `user`, `group` and `extra_groups`, with which a host drops its processes,
checks and builds to their accounts and `mesh dev up` its pieces. So asyncio stays the default
and uvloop is there to choose (`pip install 'mesh[uvloop]'`), for a controller, the command line,
the console or `mesh mcp`, which start no such process; the pieces that do run on asyncio.
"""

import importlib.util
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from mesh.errors import MeshError

T = TypeVar("T")

CHOICES = ("asyncio", "uvloop")


class LoopError(MeshError):
    """MESH_LOOP names no loop we run on, or one that is not installed."""


def _has_uvloop() -> bool:
    """Found, not imported: a piece that runs on asyncio anyway loads none of it."""
    return importlib.util.find_spec("uvloop") is not None


def _asked() -> str:
    asked = os.environ.get("MESH_LOOP", "").strip().lower() or "asyncio"
    if asked not in CHOICES:
        raise LoopError(f"MESH_LOOP={asked[:32]!r}: choose one of {', '.join(CHOICES)}")
    return asked


def chosen() -> str:
    """The loop MESH_LOOP asks for, asyncio by default."""
    asked = _asked()
    if asked == "uvloop" and not _has_uvloop():
        raise LoopError("MESH_LOOP=uvloop: uvloop is not installed (pip install 'mesh[uvloop]')")
    return asked


def options(loop: str | None = None) -> dict[str, Any]:
    """anyio.run's backend options for `loop` (the chosen one by default)."""
    return {"use_uvloop": (loop or chosen()) == "uvloop"}


# Why this process runs on asyncio although MESH_LOOP chose uvloop (None: it runs on the
# chosen one): a host says it once it has started (a refusal stays one line).
set_aside: str | None = None


def run(main: Callable[..., Awaitable[T]], *args: Any, drops_accounts: bool = False) -> T:
    """anyio.run on the chosen loop; on asyncio's whatever is chosen for a piece that
    `drops_accounts` (starts processes as other accounts: a host, dev up, init), so one
    MESH_LOOP for a whole machine (a shared environment file) is safe."""
    global set_aside
    if not drops_accounts:
        loop = chosen()
    else:  # whether uvloop is installed does not matter (a host's new version may have none)
        loop = "asyncio"
        if _asked() == "uvloop":
            set_aside = (
                "MESH_LOOP=uvloop set aside: this piece runs on asyncio, since it starts "
                "processes as other accounts and uvloop's subprocesses cannot drop to one"
            )
    return anyio.run(main, *args, backend="asyncio", backend_options=options(loop))
