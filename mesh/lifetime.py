"""Process lifetime: the one way a service stops, on SIGTERM or SIGINT, by cancelling its scope;
and waiting for the first of several events."""

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


async def first_of(*events: anyio.Event) -> None:
    """Wait until any of `events` is set."""
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(wait, event)
