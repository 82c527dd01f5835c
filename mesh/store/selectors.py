"""Standing placements by label (migration 016): a module goes to every machine whose labels
match one of its selectors, whenever it registers or is labelled (services/controller/changes/
following.py)."""

import json

import asyncpg
import msgspec


class Selector(msgspec.Struct, frozen=True):
    module: str
    labels: dict[str, str]
    by: str  # the operator who asked for it

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels.items())


async def record(conn: asyncpg.Connection, *, module: str, labels: dict[str, str], by: str) -> bool:
    """Keep the selector; False if it was kept already."""
    done = await conn.fetchval(
        "INSERT INTO selectors (module, labels, by) VALUES ($1, $2::jsonb, $3)"
        " ON CONFLICT DO NOTHING RETURNING true",
        module, json.dumps(labels, sort_keys=True), by,
    )  # fmt: skip
    return bool(done)


async def forget(conn: asyncpg.Connection, *, module: str, labels: dict[str, str]) -> bool:
    """Drop the selector; False if there was none."""
    done = await conn.fetchval(
        "DELETE FROM selectors WHERE module = $1 AND labels = $2::jsonb RETURNING true",
        module, json.dumps(labels, sort_keys=True),
    )  # fmt: skip
    return bool(done)


async def every(conn: asyncpg.Connection | asyncpg.Pool) -> list[Selector]:
    rows = await conn.fetch("SELECT module, labels, by FROM selectors ORDER BY module, labels")
    return [Selector(module=r["module"], labels=json.loads(r["labels"]), by=r["by"]) for r in rows]
