"""How a controller stops: on a signal, or at the `handover` verb, and each last step on a deadline.

SIGTERM/SIGINT to the holder starts a handover, then the process exits; to a standby, or a second
time, it stops at once: a standby in the verb group (a handover under way) leaves it first,
passing on the requests it holds, so none is left unanswered. The `handover` verb ends the hold
the same way, and the controller then stands by again.
"""

import logging
import signal
from collections.abc import Awaitable

import anyio

from mesh.errors import reason
from mesh.lifetime import exit_by
from services.controller.seat.handover import VerbSubscriptions

log = logging.getLogger("mesh.controller")

STANDBY_LEAVE_WITHIN = 5.0  # a stopping standby's leave of the verb group (two drains)


class Stop:
    """Why the holder stops holding: a signal (then the process exits) or the `handover` verb
    (then it stands by again)."""

    def __init__(self) -> None:
        self.requested = anyio.Event()
        self.stand_by_after = False
        self.signalled = False

    def handover(self) -> None:
        self.stand_by_after = True
        self.requested.set()

    def signal(self) -> None:
        self.signalled = True
        self.requested.set()

    def may_keep(self) -> bool:
        """Whether the holder may keep the seat when no standby answers: at the verb, yes
        (releasing it to nobody leaves no holder, or one that cannot hear the bus); after a
        signal, no (the process exits)."""
        return self.stand_by_after and not self.signalled

    def kept(self) -> None:
        """The handover asked for did not happen: wait for the next request."""
        self.requested = anyio.Event()
        self.stand_by_after = False


class Stopping:
    """What a signal finds: the current hold's Stop (None while standing by), this controller's
    verb subscriptions, and whether a signal came already."""

    def __init__(self) -> None:
        self.hold: Stop | None = None
        self.verbs: VerbSubscriptions | None = None
        self.signalled = anyio.Event()

    async def on_signals(self, scope: anyio.CancelScope) -> None:
        """The signal handler: the first signal to the holder asks its hold to stop; any other
        cancels `scope` (the controller's)."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                name = signal.Signals(signum).name
                exit_by()  # the handover's steps have their deadlines; this bounds them all
                if self.signalled.is_set() or self.hold is None:
                    log.info("received %s: stopping", name)
                    if self.hold is None and self.verbs is not None and self.verbs.active:
                        with anyio.move_on_after(STANDBY_LEAVE_WITHIN):
                            passed = await self.verbs.leave()
                            log.info("left the verb group, %d request(s) passed on", passed)
                    scope.cancel()
                    return
                log.info("received %s: handing the seat over, then stopping", name)
                self.signalled.set()
                self.hold.signal()


async def attempt(what: str, step: Awaitable[object], *, within: float = 3.0) -> bool:
    """Whether `step` was done within its deadline (if not, a warning says why)."""
    try:
        with anyio.fail_after(within):
            await step
    except Exception as e:
        log.warning("while stopping, could not %s: %s", what, reason(e))
        return False
    return True
