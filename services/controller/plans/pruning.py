"""The holder keeps the event log bounded: events past the configured age, and all but the
newest configured number, are deleted every `every` seconds (mesh.config.EventsKept).

Only the holder prunes, and each run is fenced by its epoch like its other writes. A run
deletes at most PRUNE_MOST rows for each reason, in one short transaction, so it never holds the
store for long; a backlog (a store that grew before pruning existed, or a lowered bound) goes
in runs of that size PRUNE_AGAIN apart, and is said in one line when it is cleared.
"""

import logging

import anyio
import asyncpg

from mesh.config import EventsKept
from mesh.errors import reason
from mesh.store import db, events, seats
from services.controller import metrics

log = logging.getLogger(__name__)

PRUNE_MOST = 5000  # rows per reason and run: 7 ms of the store for both, at a million rows
PRUNE_AGAIN = 1.0  # seconds between runs while a backlog lasts
PRUNE_WITHIN = 30.0  # a run the store has not done by then is given up, and tried next time


async def keep_pruned(pool: asyncpg.Pool, *, epoch: int, kept: EventsKept) -> None:
    """Until cancelled (the hold ends): a run every `kept.every` seconds, the first one after
    that long too (a takeover has more urgent work for the store)."""
    if kept.max_age is None and kept.max_count is None:
        return
    backlog = [0, 0]  # deleted since the last line, by age and by count
    wait = kept.every
    while True:
        await anyio.sleep(wait)
        full = False
        try:
            with anyio.fail_after(PRUNE_WITHIN):
                async with pool.acquire() as conn, conn.transaction():
                    await seats.fence(conn, epoch=epoch)
                    by_age, by_count = await events.prune(
                        conn, older_than=kept.max_age, keep=kept.max_count, most=PRUNE_MOST
                    )
        except (*db.GONE, asyncpg.PostgresError) as e:
            # A store that is gone is for the seat's lock to notice (seat/lock.py); a fenced run
            # (seats.Fenced) is not caught: the seat moved on, and this hold ends.
            log.warning("could not prune events (next try in %gs): %s", kept.every, reason(e))
        else:
            metrics.EVENTS_PRUNED.labels("age").inc(by_age)
            metrics.EVENTS_PRUNED.labels("count").inc(by_count)
            backlog[0] += by_age
            backlog[1] += by_count
            full = PRUNE_MOST in (by_age, by_count)
            if not full and any(backlog):
                log.info("pruned %d event(s): %d older than %s, %d beyond the newest %s",
                         sum(backlog), backlog[0], _age(kept.max_age), backlog[1],
                         kept.max_count)  # fmt: skip
                backlog = [0, 0]
        wait = PRUNE_AGAIN if full else kept.every


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "any age"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
