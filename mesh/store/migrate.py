"""Numbered migrations (`migrations/NNN_name.sql`), applied in order under an advisory lock.

Two controllers starting together both call `migrate`; the lock makes the second wait and then
find nothing left to do, instead of racing to create the same tables.
"""

import logging
import re
from importlib import resources

import asyncpg

log = logging.getLogger(__name__)

MIGRATION_LOCK = 0x6D657368_0001  # "mesh" + 1: one key for all migrations
_FILE = re.compile(r"(\d{3})_[a-z0-9_]+\.sql")


def migrations() -> list[tuple[int, str, str]]:
    """(version, file name, SQL) for every migration shipped with the package, in order."""
    found = []
    for entry in resources.files("mesh.store").joinpath("migrations").iterdir():
        m = _FILE.fullmatch(entry.name)
        if m:
            found.append((int(m.group(1)), entry.name, entry.read_text()))
    found.sort()
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"two migrations share a number: {versions}")
    return found


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply what is missing; return the versions applied now."""
    applied_now: list[int] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in migrations():
            if version in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
                )
            log.info("store: applied migration %s", name)
            applied_now.append(version)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
    return applied_now
