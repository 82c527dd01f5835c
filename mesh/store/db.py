"""Opening connections to the store, with keepalives so a dead peer cannot hold a lock for long.

`MESH_DATABASE_URL` may list several servers, as libpq reads it:
`postgresql://user@h1:5432,h2:5432/mesh?target_session_attrs=read-write`. They are tried in
order, each with the whole timeout; with `target_session_attrs=read-write` (or `primary`) a
session that lands on a read-only server (a standby) is closed and the next one tried, so the
seat's lock and every write always go to the primary. Failing all of them, the error names
every server tried and why each was refused. Never point it at a transaction-pooling proxy: the
seat's advisory lock belongs to one session.
"""

import logging
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import asyncpg

from mesh.errors import MeshError, reason

T = TypeVar("T")


class _OneLine(logging.Filter):
    # asyncpg's pool logs each failed reconnect with a traceback (ten lines every few seconds
    # while the store is away); the reason says it all, on the line of the event.
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            record.msg, record.args = f"{record.getMessage()}: {reason(record.exc_info[1])}", ()
            record.exc_info = record.exc_text = None
        return True


logging.getLogger("asyncpg.pool").addFilter(_OneLine())

# Server-side TCP keepalives: a controller that vanished without closing its socket loses its
# session (and the seat's advisory lock) within about idle + interval * count seconds.
KEEPALIVES = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    # A paused process (SIGSTOP, a frozen VM) keeps its sockets, so keepalives do not end its
    # sessions: one stopped inside a transaction would hold the seat's row (`fence` reads it
    # FOR SHARE) and block the next holder's epoch increment until it woke up.
    "idle_in_transaction_session_timeout": "5s",
    "application_name": "mesh",
}

# Refusals of one server that say nothing about the next: try it.
_NEXT = (
    OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
)  # fmt: skip


class StoreUnreachable(MeshError):
    """PostgreSQL did not accept a connection; the message says where it tried."""


# A session that is gone, or a store that is (re)starting or cut off: worth trying again later.
GONE = (
    OSError, TimeoutError, StoreUnreachable, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.InterfaceError,
)  # fmt: skip


def _where(url: str) -> str:
    """The URL without its credentials: the server(s), the database and the options other than
    a password (never echoed back, whether in the user part or in the query)."""
    parts = urllib.parse.urlsplit(url)
    servers = parts.netloc.rsplit("@", 1)[-1]
    query = "&".join(
        p for p in parts.query.split("&") if p and p.split("=", 1)[0].lower() != "password"
    )
    return servers + parts.path + (f"?{query}" if query else "")


def servers(url: str) -> list[str]:
    """The `host[:port]` entries of the URL's server list, in order ([] if it names none:
    a Unix socket or a `host=` option, left to asyncpg)."""
    servers = urllib.parse.urlsplit(url).netloc.rsplit("@", 1)[-1]
    return [s for s in servers.split(",") if s]


def _host_port(server: str) -> tuple[str, int | None]:
    if server.startswith("["):  # [v6]:port
        host, _, rest = server[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = server.partition(":")
    return urllib.parse.unquote(host), int(port) if port else None


def _why(e: BaseException) -> str:
    if isinstance(e, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return "a read-only server (a standby), closed"
    if isinstance(e, TimeoutError):
        return "no answer in time"
    return reason(e)


async def _open(url: str, *, timeout: float, **kwargs: Any) -> asyncpg.Connection:
    """One session on the first server of the list that takes it (and suits the URL's
    `target_session_attrs`); StoreUnreachable naming every server and its refusal otherwise."""
    listed = servers(url)
    if len(listed) <= 1:
        try:
            return await asyncpg.connect(url, timeout=timeout, **kwargs)
        except _NEXT as e:
            raise StoreUnreachable(f"cannot reach PostgreSQL at {_where(url)}: {_why(e)}") from None
    refused = []
    for server in listed:
        host, port = _host_port(server)
        try:
            # host and port given override the URL's list; the rest of the URL still applies.
            return await asyncpg.connect(url, host=host, port=port, timeout=timeout, **kwargs)
        except _NEXT as e:
            refused.append(f"{server}: {_why(e)}")
    raise StoreUnreachable(
        f"cannot reach a usable PostgreSQL at {_where(url)}: tried " + "; ".join(refused)
    )


async def connect(url: str, *, timeout: float = 5.0) -> asyncpg.Connection:
    conn = await _open(url, timeout=timeout, server_settings=KEEPALIVES)
    _client_keepalives(conn)
    return conn


def _client_keepalives(conn: asyncpg.Connection) -> None:
    """Our side of the same: a standby blocked on the seat's lock learns within about 11 s
    that the server vanished (no reset, no answer), instead of waiting on a dead socket."""
    sock = conn._transport.get_extra_info("socket") if conn._transport else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def pool(url: str, *, size: int = 4, timeout: float = 5.0) -> asyncpg.Pool:
    """Every connection of the pool, including those it opens again after a failover, is
    opened as `connect` opens one: the servers in order, the primary only if so asked."""
    try:
        return await asyncpg.create_pool(
            url, min_size=1, max_size=size, timeout=timeout, server_settings=KEEPALIVES,
            connect=_open,
        )  # fmt: skip
    except _NEXT as e:
        raise StoreUnreachable(f"cannot reach PostgreSQL at {_where(url)}: {_why(e)}") from None


async def one(
    conn: asyncpg.Connection | asyncpg.Pool, kind: Callable[..., T], query: str, *args: object
) -> T | None:
    """The row `query` finds, as `kind` (its columns by name), or None: every store module's
    lookup of one row."""
    r = await conn.fetchrow(query, *args)
    return kind(**dict(r)) if r else None
