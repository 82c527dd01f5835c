"""The command line's side of asking verbs: where the bus is (flags, then the environment), one
verb or a whole list for one command, on the library's client (mesh/client/), and `CliError`,
what a command says in one line when the user's words are wrong."""

import argparse
from contextlib import nullcontext
from typing import Any, TypeVar

from nats.aio.client import Client

from mesh import config, wire
from mesh.client.asking import ask, connected
from mesh.client.changes import CHANGE_TIMEOUT
from mesh.client.pages import ask_list
from mesh.errors import MeshError

T = TypeVar("T")


class CliError(MeshError):
    """Printed as one line on stderr; the command exits 1."""


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
    """A list verb from the command line: every page (`ask_list`), on one connection (this
    command's own, or `connection`); each page is tried as `ask` tries a verb, to --timeout."""
    url, creds = where(args)
    on = nullcontext(connection) if connection else connected(url=url, creds=creds, what=name)
    async with on as nc:
        return await ask_list(nc, url=url, verb=name, reply=reply, request=request,
                              timeout=getattr(args, "timeout", 5.0), want=want,
                              attempt=attempt)  # fmt: skip
