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
