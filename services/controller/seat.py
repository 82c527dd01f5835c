"""The seat's lock: a PostgreSQL advisory lock held on a dedicated session connection.

Whoever holds the lock holds the seat; the session ending (exit, crash, lost network with the
server's keepalives) releases it, and a standby blocked in `pg_advisory_lock` gets it at once.
Never take it through a transaction-pooling proxy: the lock belongs to the session.
"""

import logging

import anyio
import asyncpg

from mesh.store import db

log = logging.getLogger(__name__)

SEAT_LOCK = 0x6D657368_5EA7  # "mesh" + "seat"
PING_EVERY = 1.0
PING_DEADLINE = 3.0


class SeatLost(Exception):
    """The session holding the lock failed: the seat may be someone else's now."""


class SeatLock:
    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self.conn: asyncpg.Connection | None = None

    async def try_acquire(self) -> bool:
        """Connect and try the lock without waiting; True if it is ours now."""
        self.conn = await db.connect(self._url)
        return bool(await self.conn.fetchval("SELECT pg_try_advisory_lock($1)", SEAT_LOCK))

    async def wait(self) -> None:
        """Block until the holder lets go. Cancellable: asyncpg cancels the query server-side."""
        assert self.conn is not None
        await self.conn.execute("SELECT pg_advisory_lock($1)", SEAT_LOCK)

    async def watch(self) -> None:
        """Return never; raise SeatLost as soon as the lock's session stops answering."""
        assert self.conn is not None
        while True:
            await anyio.sleep(PING_EVERY)
            try:
                with anyio.fail_after(PING_DEADLINE):
                    await self.conn.fetchval("SELECT 1")
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
                raise SeatLost(f"the seat's store session failed: {e or type(e).__name__}") from e

    async def release(self) -> None:
        """Close the session: the lock goes with it, even if the unlock itself cannot be sent."""
        conn, self.conn = self.conn, None
        if conn is None or conn.is_closed():
            return
        try:
            with anyio.fail_after(2):
                await conn.close()
        except Exception:  # a dead socket: terminate is local and cannot fail
            conn.terminate()
