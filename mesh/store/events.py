"""The event log: one row per meaningful thing that happened (seat taken, machine up/down, ...),
and its pruning by age and count (the holder runs it: services/controller/plans/pruning.py)."""

import json
from typing import Any

import asyncpg


async def record(
    conn: asyncpg.Connection | asyncpg.Pool,
    kind: str,
    *,
    machine: str | None = None,
    epoch: int | None = None,
    **detail: Any,
) -> None:
    await conn.execute(
        "INSERT INTO events (kind, machine, epoch, detail) VALUES ($1, $2, $3, $4::jsonb)",
        kind,
        machine,
        epoch,
        json.dumps(detail, default=str),
    )


async def record_many(
    conn: asyncpg.Connection | asyncpg.Pool,
    rows: list[tuple[str, str | None, int | None, dict[str, Any]]],
) -> None:
    """Several events in one statement: (kind, machine, epoch, detail) each, in order."""
    if not rows:
        return
    await conn.execute(
        """
        INSERT INTO events (kind, machine, epoch, detail)
        SELECT kind, machine, epoch, detail::jsonb
        FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[])
            WITH ORDINALITY AS e(kind, machine, epoch, detail, n)
        ORDER BY n
        """,
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [json.dumps(r[3], default=str) for r in rows],
    )


async def prune(
    conn: asyncpg.Connection, *, older_than: float | None, keep: int | None, most: int
) -> tuple[int, int]:
    """Delete events older than `older_than` seconds (by the server's clock), then all but the
    newest `keep`: at most `most` of each, oldest first; how many went for each reason. None
    keeps all. "The newest `keep`" are those whose id is within `keep` of the highest: ids are
    unique, so never more than `keep` remain (fewer where a rolled-back insert left a gap),
    and finding them costs an index lookup, not a count of the table. (`= ANY(ARRAY(…))`, not
    `IN (…)`: PostgreSQL joins an `IN` against the whole table, 250 ms at a million rows.)"""
    by_age = by_count = 0
    if older_than is not None:
        by_age = _deleted(
            await conn.execute(
                """
                DELETE FROM events WHERE id = ANY(ARRAY(
                    SELECT id FROM events WHERE at < now() - make_interval(secs => $1)
                    ORDER BY at LIMIT $2))
                """,
                older_than,
                most,
            )
        )
    if keep is not None:
        by_count = _deleted(
            await conn.execute(
                """
                DELETE FROM events WHERE id = ANY(ARRAY(
                    SELECT id FROM events WHERE id <= (SELECT max(id) FROM events) - $1
                    ORDER BY id LIMIT $2))
                """,
                keep,
                most,
            )
        )
    return by_age, by_count


def _deleted(status: str) -> int:
    return int(status.rsplit(" ", 1)[-1])  # "DELETE 42"
