"""Process lifetime: the one way a service stops, on SIGTERM or SIGINT, by cancelling its scope;
the bound on how long stopping may take; and waiting for the first of several events."""

import logging
import os
import signal
import threading
import time

import anyio

log = logging.getLogger("mesh")

# Every piece exits within this of its first SIGTERM, whatever its bus or store does
# (docs/operations.md): its last steps each have a shorter deadline of their own, and this is
# the bound behind them all.
STOP_WITHIN = 10.0
# The watchdog's own bound, below the promise: it starts when the loop hears the signal, which
# may be a moment after it came, and the exit itself takes a moment (a test saw 10.05 s).
EXIT_BY = STOP_WITHIN - 1.0


def exit_by(within: float = EXIT_BY) -> None:
    """Make sure this process is gone `within` seconds from now: if it is still running then
    (a last step that ignored its deadline, a library task that does not end when cancelled),
    say so in one line and exit at once (status 1). A daemon thread, so it needs nothing of
    the event loop, which is what may be stuck; started once, at the first signal."""
    global _watchdog
    if _watchdog is not None:
        return

    def wait_then_exit() -> None:
        time.sleep(within)  # a thread of its own: its sleep is the bound, not a synchronisation
        # Straight to stderr: a logging handler's lock may be what the stuck thread holds.
        said = f"{time.strftime('%H:%M:%S')} mesh: still running {within:g}s after being asked "
        os.write(2, f"{said}to stop: exiting now\n".encode())
        os._exit(1)

    _watchdog = threading.Thread(target=wait_then_exit, name="exit-by", daemon=True)
    _watchdog.start()


_watchdog: threading.Thread | None = None


async def stop_on_signals(scope: anyio.CancelScope, *, bound: bool = True) -> None:
    """Cancel `scope` at the first SIGTERM or SIGINT; with `bound`, the process exits within
    STOP_WITHIN of it whatever happens (`mesh dev up`, which stops its children one after
    another, is not bound)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            log.info("received %s: stopping", signal.Signals(signum).name)
            if bound:
                exit_by()
            scope.cancel()
            return


async def first_of(*events: anyio.Event) -> None:
    """Wait until any of `events` is set."""
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)
