"""Process lifetime: the one way a service stops, on SIGTERM or SIGINT, by cancelling its scope."""

import logging
import signal

import anyio

log = logging.getLogger("mesh")


async def stop_on_signals(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            log.info("received %s: stopping", signal.Signals(signum).name)
            scope.cancel()
            return
