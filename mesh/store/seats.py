"""The seat's row: who holds it and the epoch, incremented at every takeover, and the fence.

Every write of the seat's holder runs in a transaction that first checks the epoch (`fence`):
a paused old holder that wakes up after a takeover can change nothing.
"""

from datetime import datetime

import asyncpg
import msgspec

from mesh import wire
from mesh.store import db


class SeatRow(msgspec.Struct):
    name: str
    epoch: int
    holder: str | None
    pid: int | None
    host: str | None
    since: datetime | None


async def take(
    conn: asyncpg.Connection, *, seat: str, holder: str, pid: int, host: str, at_least: int = 0
) -> SeatRow:
    """Increment the epoch (to `at_least` if that is higher: an epoch the bus has seen) and
    name the new holder. Call only while holding the seat's lock."""
    r = await conn.fetchrow(
        """
        UPDATE seats SET epoch = GREATEST(epoch + 1, $5), holder = $2, pid = $3, host = $4,
            since = now()
        WHERE name = $1 RETURNING name, epoch, holder, pid, host, since
        """,
        seat,
        holder,
        pid,
        host,
        at_least,
    )
    if r is None:
        raise RuntimeError(f"seat {seat!r} is missing from the store (migrations not applied?)")
    return SeatRow(**dict(r))


async def read(conn: asyncpg.Connection | asyncpg.Pool, *, seat: str) -> SeatRow | None:
    query = "SELECT name, epoch, holder, pid, host, since FROM seats WHERE name = $1"
    return await db.one(conn, SeatRow, query, seat)


class Fenced(wire.BadRequest):
    """The seat moved on: this controller's epoch is no longer the store's. As an answer to a
    verb it says to try again (the client's retry finds the new holder)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}: the seat moved to another controller; try again",
                         code="unavailable")  # fmt: skip


async def fence(conn: asyncpg.Connection, *, epoch: int, seat: str = "mesh-controller") -> None:
    current = await conn.fetchval("SELECT epoch FROM seats WHERE name = $1 FOR SHARE", seat)
    if current != epoch:
        raise Fenced(f"the seat is at epoch {current}, this controller holds {epoch}")
