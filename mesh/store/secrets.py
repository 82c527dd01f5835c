"""Secrets in the store: a value and its version per name (the version goes into
declarations, the value only to hosts)."""

import asyncpg


async def secret_versions(conn: asyncpg.Connection) -> dict[str, int]:
    return {r["name"]: r["version"] for r in await conn.fetch("SELECT name, version FROM secrets")}


async def set_secret(conn: asyncpg.Connection, *, name: str, value: bytes) -> int:
    return await conn.fetchval(
        """
        INSERT INTO secrets (name, value, version) VALUES ($1, $2, 1)
        ON CONFLICT (name) DO UPDATE SET value = $2, version = secrets.version + 1,
            updated_at = now()
        RETURNING version
        """,
        name,
        value,
    )


async def secret(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> tuple[int, bytes] | None:
    r = await conn.fetchrow("SELECT version, value FROM secrets WHERE name = $1", name)
    return (r["version"], bytes(r["value"])) if r else None
