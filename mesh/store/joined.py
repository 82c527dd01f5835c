"""Machines that joined with a token (migration 013): the key each was admitted with, the token
and the grant, so a revocation finds the key and a lost answer can be given again."""

import json

import asyncpg
import msgspec

from mesh.model import Grant


class Joined(msgspec.Struct, frozen=True):
    name: str
    public: str
    token_id: str
    grant: Grant


async def get(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> Joined | None:
    r = await conn.fetchrow(
        "SELECT name, public_key, token_id, tier, labels, control, site FROM joined_machines"
        " WHERE name = $1",
        name,
    )
    if r is None:
        return None
    grant = Grant(tier=r["tier"], labels=json.loads(r["labels"]), control=r["control"],
                  site=r["site"])  # fmt: skip
    return Joined(name=r["name"], public=r["public_key"], token_id=r["token_id"], grant=grant)


async def record(
    conn: asyncpg.Connection, *, name: str, public: str, token_id: str, grant: Grant
) -> None:
    await conn.execute(
        "INSERT INTO joined_machines (name, public_key, token_id, tier, labels, control, site)"
        " VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7)",
        name, public, token_id, grant.tier, json.dumps(grant.labels, sort_keys=True),
        grant.control, grant.site,
    )  # fmt: skip


async def forget(conn: asyncpg.Connection, name: str) -> str | None:
    """Forget the machine; the key it had joined with (None: it had not joined)."""
    return await conn.fetchval(
        "DELETE FROM joined_machines WHERE name = $1 RETURNING public_key", name
    )
