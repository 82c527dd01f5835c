"""Calling controller verbs from the command line, with errors a user can act on."""

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from nats.aio.client import Client

from mesh import bus, subjects, wire

T = TypeVar("T")


class CliError(Exception):
    """Printed as one line on stderr; the command exits 1."""


HINT = "start a mesh with `mesh dev up`, or point MESH_NATS_URL (or --nats-url) at one"


@asynccontextmanager
async def connected(*, url: str, creds: str | None, what: str) -> AsyncIterator[Client]:
    try:
        nc = await bus.connect(url, name=f"mesh {what}", creds=creds, reconnect=False)
    except bus.Unreachable as e:
        raise CliError(f"{e}; {HINT}") from None
    try:
        yield nc
    finally:
        await nc.close()


async def ask(
    nc: Client,
    *,
    url: str,
    verb: str,
    reply: type[T],
    timeout: float,
    body: bytes = b"{}",
    attempt: float = 1.0,
) -> T:
    """One verb, retried over "no responders" until `timeout`. `attempt` bounds one try: a verb
    that changes things gets one long try, so a slow answer is not mistaken for a lost one."""
    try:
        data = await bus.request(
            nc,
            subjects.ctl(verb),
            body,
            deadline=time.monotonic() + timeout,
            attempt_timeout=attempt,
        )
    except bus.NoAnswer:
        raise CliError(
            f"no controller answered `{verb}` on {url} within {timeout:g}s; "
            "is a controller running? (`mesh dev up` starts one)"
        ) from None
    try:
        return wire.decode_reply(data, reply)
    except wire.RemoteError as e:
        raise CliError(f"{verb}: {e}" if e.code != "refused" else str(e)) from None


async def call(
    *, url: str, creds: str | None, verb: str, reply: type[T], timeout: float, body: bytes = b"{}"
) -> T:
    async with connected(url=url, creds=creds, what=verb) as nc:
        return await ask(nc, url=url, verb=verb, reply=reply, timeout=timeout, body=body)
