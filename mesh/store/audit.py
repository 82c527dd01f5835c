"""The audit log and the operators the controller knows (migration 010): who asked for which
change, as the mesh verified it, and what each named operator may change."""

import asyncpg
import msgspec

from mesh.model import AuditEntry
from mesh.store import db


class OperatorRow(msgspec.Struct, frozen=True):
    name: str
    role: str
    modules: str | None
    removed: bool
    allow: list[str] = []  # what an admin granted beyond its modules' accounts (scopes.py)


async def record(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    who: str,
    verb: str,
    subject: str,
    outcome: str,
    detail: str = "",
    epoch: int | None = None,
) -> None:
    await conn.execute(
        "INSERT INTO audit (who, verb, subject, outcome, detail, epoch)"
        " VALUES ($1, $2, $3, $4, $5, $6)",
        who, verb, subject, outcome, detail, epoch,
    )  # fmt: skip


async def page(
    conn: asyncpg.Connection | asyncpg.Pool, *, before: int | None, limit: int, who: str | None
) -> list[tuple[int, AuditEntry]]:
    """The newest entries first, from before the id `before` (None: the newest), at most
    `limit`, of one operator when `who` says so; each with its id (the page's cursor)."""
    rows = await conn.fetch(
        """
        SELECT id, at, who, verb, subject, outcome, detail FROM audit
        WHERE ($1::bigint IS NULL OR id < $1) AND ($2::text IS NULL OR who = $2)
        ORDER BY id DESC LIMIT $3
        """,
        before, who, limit,
    )  # fmt: skip
    return [
        (
            r["id"],
            AuditEntry(
                at=r["at"],
                who=r["who"],
                verb=r["verb"],
                subject=r["subject"],
                outcome=r["outcome"],
                detail=r["detail"],
            ),
        )
        for r in rows
    ]


async def operator(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> OperatorRow | None:
    return await db.one(
        conn, OperatorRow,
        "SELECT name, role, modules, removed IS NOT NULL AS removed, allow FROM operators"
        " WHERE name = $1",
        name,
    )  # fmt: skip


async def add_operator(
    conn: asyncpg.Connection,
    *,
    name: str,
    role: str,
    modules: str | None,
    by: str,
    allow: list[str] | None = None,
) -> bool:
    """Record a new operator (or one removed before, again); False if one of that name is
    there and not removed."""
    added = await conn.fetchval(
        """
        INSERT INTO operators (name, role, modules, added_by, allow) VALUES ($1, $2, $3, $4, $5)
        ON CONFLICT (name) DO UPDATE SET role = $2, modules = $3, added_by = $4, added = now(),
            removed = NULL, removed_by = NULL, allow = $5
        WHERE operators.removed IS NOT NULL
        RETURNING name
        """,
        name, role, modules, by, allow or [],
    )  # fmt: skip
    return added is not None


async def remove_operator(conn: asyncpg.Connection, *, name: str, by: str) -> bool:
    """Mark the operator removed; False if there is none of that name (or it was removed)."""
    removed = await conn.fetchval(
        "UPDATE operators SET removed = now(), removed_by = $2"
        " WHERE name = $1 AND removed IS NULL RETURNING name",
        name,
        by,
    )
    return removed is not None


async def operators(conn: asyncpg.Connection | asyncpg.Pool) -> list[OperatorRow]:
    rows = await conn.fetch(
        "SELECT name, role, modules, removed IS NOT NULL AS removed, allow FROM operators"
        " WHERE removed IS NULL ORDER BY name"
    )
    return [OperatorRow(**dict(r)) for r in rows]


async def plan_trigger(
    conn: asyncpg.Connection | asyncpg.Pool, plan_id: int
) -> tuple[str, str] | None:
    """A plan's trigger (push, assign, ...) and subject (the module, machine or secret)."""
    r = await conn.fetchrow("SELECT trigger, subject FROM plans WHERE id = $1", plan_id)
    return (r["trigger"], r["subject"]) if r else None


OVER = ("done", "failed", "reverted", "cancelled")  # a plan in one of these changes nothing more


async def open_plans_of(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> list[int]:
    """The plans `name` asked for that are not over."""
    rows = await conn.fetch(
        "SELECT id FROM plans WHERE requested_by = $1 AND state <> ALL($2::text[]) ORDER BY id",
        name, list(OVER),
    )  # fmt: skip
    return [r["id"] for r in rows]
