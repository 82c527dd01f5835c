"""Calling controller verbs from the command line, with errors a user can act on; following a
list verb's pages (mesh/paging.py) to one whole list, for every client in programs/ and bench/."""

import argparse
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import msgspec
from nats.aio.client import Client

from mesh import bus, config, subjects, wire
from mesh.auth.creds import CredsError
from mesh.errors import MeshError
from mesh.model import (
    PAGE_MOST,
    DiffReply,
    ModulesReply,
    NodesReply,
    PlanReply,
    PlansReply,
    ToolsReply,
)

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


# --- lists, page after page ---------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """What a list verb's pages hold: the field of the items, and an item's identity. The
    whole list has one entry per identity: a later page's entry takes an earlier one's place
    (a machine moved to a later tier while the pages were read is shown at its new place), or
    is joined to it (`join`: a module on many machines comes in several entries)."""

    items: str
    key: Callable[[Any], object]
    join: Callable[[Any, Any], Any] = lambda old, new: new


def _join_module(old: Any, new: Any) -> Any:
    return msgspec.structs.replace(new, assigned=old.assigned + new.assigned)


LISTINGS: dict[type, Listing] = {
    NodesReply: Listing("nodes", key=lambda n: n.name),
    PlanReply: Listing("steps", key=lambda s: s.machine),
    PlansReply: Listing("plans", key=lambda p: p.id),
    ModulesReply: Listing("modules", key=lambda m: m.name, join=_join_module),
    DiffReply: Listing("machines", key=lambda m: m.machine),
    ToolsReply: Listing("tools", key=lambda t: (t.machine, t.server, t.name)),
}


async def every_page(
    ask_page: Callable[[Any], Awaitable[T]], request: Any, *, want: int | None = None
) -> T:
    """Ask for `request`'s first page (through `ask_page`, the caller's one request), then for
    the page after each, until the last: the last page holding every item in order, as if the
    controller had answered in one reply (`next` None). With `want`, at most that many items,
    asking only for the pages they need (`total` still says how many there are). The first
    page is asked for as `request` says (its default `limit` goes unsaid, so a controller from
    before pages answers it, whole); those after it as large as a request may (PAGE_MOST
    items): their bytes decide."""
    got: dict[object, Any] = {}
    after: str | None = None
    while True:
        asked = request
        if want is not None:  # one past it: the last entry may go on (a module's machines)
            asked = msgspec.structs.replace(asked, limit=min(PAGE_MOST, want + 1 - len(got)))
        elif after is not None:
            asked = msgspec.structs.replace(asked, limit=PAGE_MOST)
        page: Any = await ask_page(msgspec.structs.replace(asked, after=after))
        listing = LISTINGS[type(page)]
        for item in getattr(page, listing.items):
            key = listing.key(item)
            old = got.pop(key, None)
            got[key] = item if old is None else listing.join(old, item)
        if page.next is None or (want is not None and len(got) > want):
            break
        if page.next == after:  # a controller that does not move on would be asked forever
            raise CliError(f"the controller gave the same page twice (cursor {after[:40]})")
        after = page.next
    items = list(got.values())
    return msgspec.structs.replace(page, **{listing.items: items[:want], "next": None})


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


async def listed(
    args: argparse.Namespace,
    name: str,
    reply: type[T],
    request: Any,
    *,
    want: int | None = None,
    connection: Client | None = None,
    attempt: float = 1.0,
) -> T:
    """A list verb from the command line: every page (`every_page`), on one connection (this
    command's own, or `connection`); each page is tried as `ask` tries a verb, to --timeout."""
    url, creds = where(args)
    timeout = getattr(args, "timeout", 5.0)

    async def on(nc: Client) -> T:
        async def page(body: Any) -> T:
            return await ask(nc, url=url, verb=name, reply=reply, timeout=timeout,
                             body=wire.encode(body), attempt=attempt)  # fmt: skip

        return await every_page(page, request, want=want)

    if connection is not None:
        return await on(connection)
    async with connected(url=url, creds=creds, what=name) as nc:
        return await on(nc)
