"""A flush that gives up before its PONG comes back leaves the connection working (issue 29).

nats-py answers each PONG by setting the result of the oldest flush's future; one whose flush
was cancelled (a hold's round trips cancelled at its end) or timed out raised InvalidStateError
in its read loop, which ended: the connection received nothing more until its own pings found
it stale 10-15 s later. mesh.bus replaces that step (`_process_pong`). Real nats-server."""

import anyio
import nats

from mesh import bus  # noqa: F401 (its import is what makes a late PONG harmless)


async def test_a_cancelled_flush_does_not_stop_the_connection_reading(nats_url) -> None:
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe("late.pong")
        for _ in range(20):  # each a PING whose flush is gone before its PONG is read
            with anyio.move_on_after(0):
                await nc.flush(timeout=5)
        await nc.publish("late.pong", b"still reading")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"still reading"
        await nc.flush(timeout=5)  # and the round trips still pair up
    finally:
        await nc.close()
