"""Calling controller verbs from the command line, with errors a user can act on."""

import argparse
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from nats.aio.client import Client

from mesh import bus, config, subjects, wire
from mesh.auth.creds import CredsError
from mesh.errors import MeshError

T = TypeVar("T")


class CliError(MeshError):
    """Printed as one line on stderr; the command exits 1."""


HINT = "start a mesh with `mesh dev up`, or point MESH_NATS_URL (or --nats-url) at one"
CREDS_HINT = "with `mesh dev up`, `source DIR/env` sets both (default DIR: .mesh/dev)"


@asynccontextmanager
async def connected(*, url: str, creds: str | None, what: str) -> AsyncIterator[Client]:
    """A connection for one command. If the server refuses one of its publishes or
    subscriptions (these credentials may not do `what`), the command stops at once with a
    `forbidden` error instead of waiting for an answer that cannot come."""
    refused: list[str] = []
    with anyio.CancelScope() as scope:

        def denied(action: str) -> None:
            refused.append(action)
            scope.cancel()

        try:
            nc = await bus.connect(
                url, name=f"mesh {what}", creds=creds, reconnect=False, denied=denied
            )
        except bus.Unreachable as e:
            raise CliError(f"{e}; {HINT}") from None
        except bus.Unauthorized as e:
            raise CliError(f"{e}; {CREDS_HINT}") from None
        except CredsError as e:
            raise CliError(str(e)) from None
        try:
            yield nc
        finally:
            with anyio.CancelScope(shield=True):
                await nc.close()
    if refused:
        raise CliError(
            f"forbidden: the credentials {creds or '(none)'} do not allow `{what}` "
            f"(NATS refused to let them {refused[0]})"
        )


RETRIED = ("unavailable", "busy")  # error replies that say "try again": retried to the deadline
RETRY_FIRST = 0.1  # then doubled, up to RETRY_MOST
RETRY_MOST = 1.0
LAST_TRY = 0.1  # what is left of the deadline for the try after the last pause


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
    """One verb, retried over "no responders", `unavailable` and `busy` until `timeout`.
    `attempt` bounds one try: a verb that changes things gets one long try, so a slow answer is
    not mistaken for a lost one."""
    if len(body) > nc.max_payload:  # nats-py would raise MaxPayloadError at the first try
        raise CliError(
            f"{verb}: the request is {len(body)} bytes, more than the NATS server takes "
            f"({nc.max_payload}); see Limits in docs/verbs.md"
        )
    deadline = time.monotonic() + timeout
    pause = RETRY_FIRST
    while True:
        try:
            data = await bus.request(
                nc, subjects.ctl(verb), body, deadline=deadline, attempt_timeout=attempt
            )
        except bus.NoAnswer:
            raise CliError(
                f"no controller answered `{verb}` on {url} within {timeout:g}s; "
                "is a controller running? (`mesh dev up` starts one)"
            ) from None
        try:
            return wire.decode_reply(data, reply)
        except wire.RemoteError as e:
            # The seat was moving (a handover, a controller stopping), or the controller had
            # as many slow verbs in flight as it takes (nothing was done): ask again, later.
            left = deadline - time.monotonic()
            if e.code in RETRIED and left > 2 * LAST_TRY:
                await anyio.sleep(min(pause, left - LAST_TRY))  # a last try fits before it
                pause = min(pause * 2, RETRY_MOST)
                continue
            raise CliError(f"{verb}: {e}" if e.code != "refused" else str(e)) from None


CHANGE_TIMEOUT = 900.0  # a push may wait for a build (10 minutes by default) and then some


def where(args: argparse.Namespace) -> tuple[str, str | None]:
    """The NATS URL and credentials file the command line and environment select."""
    creds = config.creds(getattr(args, "creds", None))
    return config.nats_url(getattr(args, "nats_url", None), creds), creds


async def verb(
    args: argparse.Namespace, name: str, reply: type[T], body: Any = None, *, changes: bool = False
) -> T:
    """One verb. One that changes things is tried once per answer window (`attempt` = the whole
    timeout): a slow answer must not be taken for a lost request and sent again."""
    url, creds = where(args)
    timeout = getattr(args, "timeout", CHANGE_TIMEOUT if changes else 5.0)
    async with connected(url=url, creds=creds, what=name) as nc:
        return await ask(
            nc, url=url, verb=name, reply=reply, timeout=timeout,
            body=wire.encode(body) if body is not None else b"{}",
            attempt=timeout if changes else 1.0,
        )  # fmt: skip
