"""Opening connections to the store, with keepalives so a dead peer cannot hold a lock for long."""

import socket

import asyncpg

from mesh.errors import MeshError

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


class StoreUnreachable(MeshError):
    """PostgreSQL did not accept a connection; the message says where it tried."""


def _where(url: str) -> str:
    # Never echo a password back: keep only what follows the '@'.
    return url.rsplit("@", 1)[-1]


async def connect(url: str, *, timeout: float = 5.0) -> asyncpg.Connection:
    try:
        conn = await asyncpg.connect(url, timeout=timeout, server_settings=KEEPALIVES)
    except (OSError, TimeoutError, asyncpg.PostgresError) as e:
        raise StoreUnreachable(f"cannot reach PostgreSQL at {_where(url)}: {e}") from None
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
    try:
        return await asyncpg.create_pool(
            url, min_size=1, max_size=size, timeout=timeout, server_settings=KEEPALIVES
        )
    except (OSError, TimeoutError, asyncpg.PostgresError) as e:
        raise StoreUnreachable(f"cannot reach PostgreSQL at {_where(url)}: {e}") from None
