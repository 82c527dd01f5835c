"""Calling a controller verb from the command line, with errors a user can act on."""

import time
from typing import TypeVar

from mesh import bus, subjects, wire

T = TypeVar("T")


class CliError(Exception):
    """Printed as one line on stderr; the command exits 1."""


HINT = "start a mesh with `mesh dev up`, or point MESH_NATS_URL (or --nats-url) at one"


async def call(
    *, url: str, creds: str | None, verb: str, reply: type[T], timeout: float, body: bytes = b"{}"
) -> T:
    try:
        nc = await bus.connect(url, name=f"mesh {verb}", creds=creds, reconnect=False)
    except bus.Unreachable as e:
        raise CliError(f"{e}; {HINT}") from None
    try:
        data = await bus.request(nc, subjects.ctl(verb), body, deadline=time.monotonic() + timeout)
    except bus.NoAnswer:
        raise CliError(
            f"no controller answered `{verb}` on {url} within {timeout:g}s; "
            "is a controller running? (`mesh dev up` starts one)"
        ) from None
    finally:
        await nc.close()
    try:
        return wire.decode_reply(data, reply)
    except wire.RemoteError as e:
        raise CliError(f"{verb}: {e} ({e.code})") from None
