"""The event log: one row per meaningful thing that happened (seat taken, machine up/down, ...)."""

import json
from datetime import datetime
from typing import Any

import asyncpg
import msgspec


class Event(msgspec.Struct):
    id: int
    at: datetime
    kind: str
    machine: str | None
    epoch: int | None
    detail: dict[str, Any]


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


async def recent(
    conn: asyncpg.Connection | asyncpg.Pool, *, machine: str | None = None, limit: int = 100
) -> list[Event]:
    rows = await conn.fetch(
        "SELECT id, at, kind, machine, epoch, detail FROM events"
        " WHERE $1::text IS NULL OR machine = $1 ORDER BY id DESC LIMIT $2",
        machine,
        limit,
    )
    return [
        Event(
            id=r["id"],
            at=r["at"],
            kind=r["kind"],
            machine=r["machine"],
            epoch=r["epoch"],
            detail=json.loads(r["detail"]),
        )
        for r in reversed(rows)
    ]
