"""Migrations: numbered, applied once, and safe when two controllers start together."""

import asyncio

import asyncpg

from mesh.store.migrate import migrate, migrations


def test_migrations_are_numbered_in_order() -> None:
    versions = [v for v, _, _ in migrations()]
    assert versions == sorted(versions)
    assert versions[0] == 1


async def test_two_controllers_migrating_together_do_not_race(database_url: str) -> None:
    a = await asyncpg.connect(database_url)
    b = await asyncpg.connect(database_url)
    try:
        applied = await asyncio.gather(migrate(a), migrate(b))
        everything = [v for v, _, _ in migrations()]
        # exactly one of them applied everything; the other found nothing left to do
        assert sorted(applied, key=len) == [[], everything]
        rows = await a.fetch("SELECT version FROM schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == everything
        assert await a.fetchval("SELECT epoch FROM seats WHERE name = 'mesh-controller'") == 0
        assert await migrate(a) == []
    finally:
        await a.close()
        await b.close()
