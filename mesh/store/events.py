"""The event log: one row per meaningful thing that happened (seat taken, machine up/down, ...)."""

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
