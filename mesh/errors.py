"""The one base class of errors a person can act on from their words alone.

A command turns any `MeshError` into one line on stderr and exit code 1; anything else is a bug,
reported as an internal error. Library, services and programs raise subclasses named for what
went wrong (`Unreachable`, `SeatLost`, `RegistrationRefused`, ...), so the command line needs to
know none of them, and no layer imports a higher one to catch its exceptions.
"""

from asyncio import CancelledError


class MeshError(Exception):
    """A failure whose message says what happened and, where it can, what to do."""


def reason(e: BaseException) -> str:
    """An exception in words: its message, or what it is where it has none."""
    if str(e):
        return str(e)
    return "no answer in time" if isinstance(e, TimeoutError) else type(e).__name__


def leaf(e: BaseException) -> BaseException:
    """The one exception inside nested groups (anyio wraps task failures). Where several tasks
    failed with errors we name (a holder woken from a pause finds both its store session and
    NATS gone), one MeshError says them all."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    if isinstance(e, BaseExceptionGroup):
        # Cancellations are what the first failure did to the other tasks, not a cause.
        leaves = [x for x in map(leaf, e.exceptions) if not isinstance(x, CancelledError)]
        if len(leaves) == 1:
            return leaves[0]
        if all(isinstance(x, MeshError) for x in leaves):
            return MeshError("; ".join(dict.fromkeys(str(x) for x in leaves)))
        return next((x for x in leaves if not isinstance(x, MeshError)), e)
    return e
