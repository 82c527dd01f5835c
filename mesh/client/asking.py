"""Asking the controller's verbs: a connection for one client, one verb asked with retries (over
"no responders", `unavailable` and `busy`, to a deadline), and a probe's pages.

Every failure a person can act on is a `VerbFailed`: a MeshError, so the command line prints it
as its one line, the console shows it on the page and `mesh mcp` returns it as a tool error.
"""

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from nats.aio.client import Client

from mesh import bus, subjects, wire
from mesh.auth.creds import CredsError
from mesh.auth.policy import READ_VERBS
from mesh.errors import MeshError

T = TypeVar("T")


class VerbFailed(MeshError):
    """A verb that could not be asked, or that its server refused. `code` is the server's error
    code (`not_found`, `forbidden`, ...: docs/verbs.md), None when none answered."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


HINT = "start a mesh with `mesh dev up`, or point MESH_NATS_URL (or --nats-url) at one"
CREDS_HINT = "with `mesh dev up`, `source DIR/env` sets both (default DIR: .mesh/dev)"


@asynccontextmanager
async def connected(*, url: str, creds: str | None, what: str) -> AsyncIterator[Client]:
    """A connection for one client. If the server refuses one of its publishes or
    subscriptions (these credentials may not do `what`), the client stops at once with a
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
        except (bus.Untrusted, bus.Unauthorized) as e:  # a mesh is there: settings missing
            raise VerbFailed(f"{e}; {CREDS_HINT}") from None
        except bus.Unreachable as e:
            raise VerbFailed(f"{e}; {HINT}") from None
        except CredsError as e:
            raise VerbFailed(str(e)) from None
        try:
            yield nc
        finally:
            # Bounded: nats-py's close awaits the socket's drain and close, unbounded (a
            # command whose plan was done stayed running, the nemesis's seed 6 on main).
            await bus.close(nc, drain=False)
    if refused:
        raise VerbFailed(
            f"forbidden: the credentials {creds or '(none)'} do not allow `{what}` "
            f"(NATS refused to let them {refused[0]})",
            code="forbidden",
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
        raise VerbFailed(
            f"{verb}: the request is {len(body)} bytes, more than the NATS server takes "
            f"({nc.max_payload}); see Limits in docs/verbs.md",
            code="too_large",
        )
    deadline = time.monotonic() + timeout
    pause = RETRY_FIRST
    subject = subject_of(nc, verb)
    while True:
        try:
            data = await bus.request(nc, subject, body, deadline=deadline, attempt_timeout=attempt)
        except bus.NoAnswer:
            raise VerbFailed(
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
            said = f"{verb}: {e}" if e.code != "refused" else str(e)
            raise VerbFailed(said, code=e.code) from None


def subject_of(nc: Client, verb: str) -> str:
    """Where `verb` is asked: a read on `mesh.ctl.<verb>` (every client's, the console's and
    `nats req`'s), anything else on the operator's own `mesh.op.<name>.<verb>`, the one subject
    the server lets only this operator publish on (docs/security.md, who asked). A connection
    without operator credentials (a bus without authentication) asks on `mesh.ctl.<verb>`."""
    operator = bus.operator_of(nc)
    if operator is None or verb in READ_VERBS:
        return subjects.ctl(verb)
    return subjects.op(operator, verb)


def probing(
    nc: Client, verb: str, reply: type[T], *, within: float
) -> Callable[[Any], Awaitable[T]]:
    """Pages asked as a probe asks (`mesh dev up` waiting for its mesh): each one request,
    retried over "no responders" for `within` seconds; bus.NoAnswer or wire.RemoteError else."""

    async def page(body: Any) -> T:
        data = await bus.request(
            nc, subjects.ctl(verb), wire.encode(body), deadline=time.monotonic() + within
        )
        return wire.decode_reply(data, reply)

    return page
