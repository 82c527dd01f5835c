"""The mesh's policy: how many approvals a held plan needs (`mesh policy`; migration 018). One
row, written by the holder in a fenced transaction, read as each approval is counted."""

from datetime import datetime

import asyncpg
import msgspec


class Policy(msgspec.Struct):
    approvals: int = 1
    set_by: str | None = None
    set_at: datetime | None = None


async def policy(conn: asyncpg.Connection | asyncpg.Pool) -> Policy:
    row = await conn.fetchrow("SELECT approvals, set_by, set_at FROM policy")
    return Policy() if row is None else Policy(**dict(row))


async def set_approvals(conn: asyncpg.Connection, approvals: int, *, by: str) -> Policy:
    row = await conn.fetchrow(
        "UPDATE policy SET approvals = $1, set_by = $2, set_at = now()"
        " RETURNING approvals, set_by, set_at",
        approvals, by,
    )  # fmt: skip
    return Policy(**dict(row))
