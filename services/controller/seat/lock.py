"""The seat's lock: a PostgreSQL advisory lock held on a dedicated session connection.

Whoever holds the lock holds the seat; the session ending (exit, crash, lost network with the
server's keepalives) releases it, and a standby blocked in `pg_advisory_lock` gets it at once.
A paused holder (SIGSTOP, a frozen VM) keeps its socket and its kernel answers keepalives, so
the holder's `watch` sets `idle_session_timeout` on its session and pings every PING_EVERY:
the server ends a session silent for IDLE_LIMIT, which hands the lock to the standby.
Never take it through a transaction-pooling proxy: the lock belongs to the session.
"""

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import asyncpg

from mesh.errors import MeshError, reason
from mesh.store import db

log = logging.getLogger(__name__)
T = TypeVar("T")

SEAT_LOCK = 0x6D657368_5EA7  # "mesh" + "seat"
# The server ends the lock's session IDLE_LIMIT after its last query: a holder cut off from the
# store (or paused) loses the lock that long after its last ping, and no sooner, so these
# bound the window a cut from the store costs (docs/operations.md). A holder's event loop is
# kept from running that late by shedding (docs/architecture.md, Liveness).
PING_EVERY = 0.5
PING_DEADLINE = 1.0
IDLE_LIMIT = 2.0
_IDLE_LIMIT = f"SET idle_session_timeout = {int(IDLE_LIMIT * 1000)}"
FRESH_FOR = PING_EVERY + PING_DEADLINE  # < IDLE_LIMIT: a seat confirmed this recently is ours
RECONNECT_MAX = 1.0  # a standby whose session failed connects again at least this often


class SeatLost(MeshError):
    """The session holding the lock failed: the seat may be someone else's now."""


class SeatLock:
    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self.conn: asyncpg.Connection | None = None
        self._confirmed = float("-inf")  # when (monotonic) the session last answered, holding

    async def _connect(self) -> asyncpg.Connection:
        """The lock's session, with the server's idle limit on it from the start: a grant of
        the lock that never reaches us (cut from the store as the holder let go) leaves the
        session idle, and the server ends it IDLE_LIMIT later, so the seat goes to the next in
        line instead of waiting for our link (the nemesis: 8.3 s with no holder)."""
        conn = await db.connect(self._url)
        await conn.execute(_IDLE_LIMIT)
        return conn

    async def try_acquire(self) -> bool:
        """Connect and try the lock without waiting; True if it is ours now."""
        self.conn = await self._connect()
        got = bool(await self.conn.fetchval("SELECT pg_try_advisory_lock($1)", SEAT_LOCK))
        if got:
            self._confirmed = time.monotonic()
        return got

    async def wait(self) -> None:
        """Block until the holder lets go. Cancellable: asyncpg cancels the query server-side.
        A session that fails while waiting (the store restarted) is opened again, so a standby
        outlives a store outage and takes the seat when the store is back."""
        backoff, told = 0.1, False
        while True:
            try:
                if self.conn is None:
                    self.conn = await self._connect()
                    if told:
                        log.info("standby: the store answers again; waiting for the seat")
                await self.conn.execute("SELECT pg_advisory_lock($1)", SEAT_LOCK)
                self._confirmed = time.monotonic()
                return
            except db.GONE as e:
                if not told:
                    log.info("standby: the store session failed (%s); connecting again",
                             reason(e))  # fmt: skip
                    told = True
                if self.conn is not None:
                    self.conn.terminate()
                    self.conn = None
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX)

    async def watch(self) -> None:
        """Return never; raise SeatLost as soon as the lock's session stops answering, or at
        once when its connection ends (a server that died closes it): from that moment the
        seat is not `fresh`, so no verb is answered with a seat that may be someone else's."""
        assert self.conn is not None
        with anyio.CancelScope() as ended:

            def on_end(_conn: object) -> None:
                self._confirmed = float("-inf")
                ended.cancel()

            conn = self.conn
            conn.add_termination_listener(on_end)
            try:
                await self._ping()
            except Exception as e:  # any failure: a session closed by the server while we
                # were paused fails the next query with asyncpg's InternalClientError
                raise SeatLost(f"the seat's store session failed: {reason(e)}") from e
            finally:  # a hold watches again after its load: one listener at a time
                conn.remove_termination_listener(on_end)
        raise SeatLost("the seat's store session failed: its connection ended")

    async def _ping(self) -> None:
        assert self.conn is not None
        await self._ask(_IDLE_LIMIT)
        # An answer of the session like any ping: a takeover that took seconds to load must
        # not leave the seat looking stale until the first ping.
        self._confirmed = time.monotonic()
        while True:
            await anyio.sleep(PING_EVERY)
            await self._ask("SELECT 1")
            self._confirmed = time.monotonic()

    async def kept_while(self, work: Callable[[], Awaitable[T]]) -> T:
        """`work()`, which must not use the lock's session, while that session is pinged as
        the watch pings it: the server ends a session idle for IDLE_LIMIT, and a take waits on
        the bus (a stream electing its leader) longer than that."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ping)
            result = await work()
            tg.cancel_scope.cancel()
        return result

    async def _ask(self, query: str) -> None:
        """One ping, bounded by PING_DEADLINE and shielded from the watch's own cancellation: a
        watch cancelled (a takeover's load done) stops between pings, never in the middle of
        one, which would leave the session busy for the next query on it."""
        assert self.conn is not None
        with anyio.CancelScope(shield=True), anyio.fail_after(PING_DEADLINE):
            await self.conn.execute(query)

    async def confirm(self) -> None:
        """Ask the session once, now: a takeover that took longer than FRESH_FOR to load must
        not start serving with a seat that looks stale (each verb would be passed on to the
        group, back to us, until the watch's first ping)."""
        assert self.conn is not None
        try:
            await self._ask("SELECT 1")
        except Exception as e:
            raise SeatLost(f"the seat's store session failed: {reason(e)}") from e
        self._confirmed = time.monotonic()

    def fresh(self) -> bool:
        """The session answered within FRESH_FOR: the seat is still ours. False in a holder
        woken from a pause (SIGSTOP) before its next ping finds the session gone: it must not
        answer with a seat that may be someone else's by now."""
        return self.conn is not None and time.monotonic() - self._confirmed < FRESH_FOR

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
