"""Which event loop every piece runs on: uvloop where it is installed, else asyncio's own.

Measured (docs/performance.md, Verbs): over TLS the controller's `status` costs less CPU a
request on uvloop, whose transports read and write in C; the rest of the serving path is the
same. `MESH_LOOP=asyncio` (or `uvloop`) chooses; the default is uvloop when it imports, so a
machine without its wheel (it has none for some platforms) still runs, on asyncio.
"""

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
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def chosen() -> str:
    """The loop MESH_LOOP asks for, or the default: uvloop when installed."""
    asked = os.environ.get("MESH_LOOP", "").strip().lower()
    if not asked:
        return "uvloop" if _has_uvloop() else "asyncio"
    if asked not in CHOICES:
        raise LoopError(f"MESH_LOOP={asked[:32]!r}: choose one of {', '.join(CHOICES)}")
    if asked == "uvloop" and not _has_uvloop():
        raise LoopError("MESH_LOOP=uvloop: uvloop is not installed (pip install uvloop)")
    return asked


def options(loop: str | None = None) -> dict[str, Any]:
    """anyio.run's backend options for `loop` (the chosen one by default)."""
    return {"use_uvloop": (loop or chosen()) == "uvloop"}


def run(main: Callable[..., Awaitable[T]], *args: Any) -> T:
    """anyio.run on the chosen loop."""
    return anyio.run(main, *args, backend="asyncio", backend_options=options())
