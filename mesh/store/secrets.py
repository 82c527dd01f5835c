"""Secrets in the store: per name a version (which goes into declarations) and the value sealed
under the mesh's key (mesh/auth/secretkeys.py), which only hosts get, opened.

The store never holds a value in plaintext, nor the key: a row is the value encrypted under its
data key and the data key wrapped under the key `key_id` names. Rows an older mesh stored in
plaintext (no `key_id`) are read as they are until the holder seals them at its takeover
(services/controller/catalog/secretkeys.py).

`mesh-secrets-key` (KEY_SECRET) is the key itself as a file the controllers' module is given:
never a row; its version is the key's generation (`secrets_key`), raised at each rotation.
"""

from datetime import datetime
from typing import Literal

import asyncpg
import msgspec

from mesh.auth.scopes import KEY_SECRET, SecretScope
from mesh.auth.secretkeys import KeyRing, Sealed
from mesh.store import db


class StoreKey(msgspec.Struct, frozen=True):
    key_id: str  # the key that wraps the secrets (its id)
    version: int  # its generation: KEY_SECRET's version in declarations
    changed_at: datetime


async def secret_versions(conn: asyncpg.Connection) -> dict[str, int]:
    versions = {
        r["name"]: r["version"] for r in await conn.fetch("SELECT name, version FROM secrets")
    }
    versions[KEY_SECRET] = await key_version(conn)
    return versions


async def key_version(conn: asyncpg.Connection) -> int:
    """KEY_SECRET's version: the key's generation (1 before a holder has recorded it)."""
    known = await store_key(conn)
    return known.version if known else 1


async def set_secret(
    conn: asyncpg.Connection,
    *,
    name: str,
    value: bytes,
    ring: KeyRing,
    by: str = "",
    modules: str | None = None,
) -> int:
    """Store a new version of `name`, sealed under the ring's active key; its version. `by`
    (the operator) and `modules` (a glob; None keeps the one it had) say who may use it
    (mesh/auth/scopes.py)."""
    current = await conn.fetchval("SELECT version FROM secrets WHERE name = $1 FOR UPDATE", name)
    version = (current or 0) + 1
    sealed = ring.seal(name=name, version=version, value=value)
    await conn.execute(
        """
        INSERT INTO secrets (name, value, data_key, key_id, version, set_by, modules)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT (name) DO UPDATE SET value = $2, data_key = $3, key_id = $4, version = $5,
            set_by = $6, modules = coalesce($7, secrets.modules), updated_at = now()
        """,
        name, sealed.value, sealed.data_key, sealed.key_id, version, by, modules,
    )  # fmt: skip
    return version


async def scopes(
    conn: asyncpg.Connection | asyncpg.Pool, names: list[str] | None = None
) -> dict[str, SecretScope]:
    """Who may use each secret that is set (those `names`, or all)."""
    rows = await conn.fetch(
        "SELECT name, modules, set_by FROM secrets WHERE $1::text[] IS NULL OR name = ANY($1)",
        names,
    )
    return {r["name"]: SecretScope(modules=r["modules"], set_by=r["set_by"]) for r in rows}


async def set_by(conn: asyncpg.Connection | asyncpg.Pool, operator: str) -> list[str]:
    """The secrets `operator` set last, by name."""
    rows = await conn.fetch("SELECT name FROM secrets WHERE set_by = $1 ORDER BY name", operator)
    return [r["name"] for r in rows]


async def secret(
    conn: asyncpg.Connection | asyncpg.Pool, name: str, *, ring: KeyRing
) -> tuple[int, bytes] | None:
    """The version and value of `name`, opened with `ring` (secretkeys.KeyMissing if it lacks
    the key); None if it was never set."""
    r = await conn.fetchrow(
        "SELECT version, value, data_key, key_id FROM secrets WHERE name = $1", name
    )
    if r is None:
        return None
    if r["key_id"] is None:  # an older mesh's plaintext, until the takeover seals it
        return r["version"], bytes(r["value"])
    sealed = Sealed(value=bytes(r["value"]), data_key=bytes(r["data_key"]), key_id=r["key_id"])
    return r["version"], ring.open(name=name, version=r["version"], sealed=sealed)


async def not_under(conn: asyncpg.Connection, key: str) -> list[str]:
    """The secrets not wrapped under `key` (plaintext, or under another key), by name."""
    rows = await conn.fetch(
        "SELECT name FROM secrets WHERE key_id IS DISTINCT FROM $1 ORDER BY name", key
    )
    return [r["name"] for r in rows]


async def key_ids(conn: asyncpg.Connection) -> dict[str | None, int]:
    """How many secrets each key wraps (None: plaintext)."""
    rows = await conn.fetch("SELECT key_id, count(*) AS n FROM secrets GROUP BY key_id")
    return {r["key_id"]: r["n"] for r in rows}


Resealed = Literal["sealed", "rewrapped"]


async def reseal(conn: asyncpg.Connection, name: str, *, ring: KeyRing) -> Resealed | None:
    """Bring `name` under the ring's active key: 'sealed' (it was plaintext), 'rewrapped' (its
    data key was under another key), or None (already under it, or gone)."""
    r = await conn.fetchrow(
        "SELECT version, value, data_key, key_id FROM secrets WHERE name = $1 FOR UPDATE", name
    )
    if r is None or r["key_id"] == ring.active:
        return None
    done: Resealed
    if r["key_id"] is None:
        sealed = ring.seal(name=name, version=r["version"], value=bytes(r["value"]))
        done = "sealed"
    else:
        old = Sealed(value=bytes(r["value"]), data_key=bytes(r["data_key"]), key_id=r["key_id"])
        sealed = ring.rewrap(name=name, sealed=old)
        done = "rewrapped"
    await conn.execute(
        "UPDATE secrets SET value = $2, data_key = $3, key_id = $4 WHERE name = $1",
        name, sealed.value, sealed.data_key, sealed.key_id,
    )  # fmt: skip
    return done


async def forget(conn: asyncpg.Connection, name: str) -> bool:
    return await conn.fetchval("DELETE FROM secrets WHERE name = $1 RETURNING true", name) or False


async def store_key(conn: asyncpg.Connection | asyncpg.Pool) -> StoreKey | None:
    return await db.one(conn, StoreKey, "SELECT key_id, version, changed_at FROM secrets_key")


async def set_store_key(conn: asyncpg.Connection, key: str) -> StoreKey:
    """Record `key` as the one that wraps the secrets; a change of key raises the generation."""
    r = await conn.fetchrow(
        """
        INSERT INTO secrets_key (key_id, version) VALUES ($1, 1)
        ON CONFLICT (only_row) DO UPDATE SET key_id = $1,
            version = secrets_key.version + (secrets_key.key_id <> $1)::int,
            changed_at = CASE WHEN secrets_key.key_id <> $1 THEN now()
                         ELSE secrets_key.changed_at END
        RETURNING key_id, version, changed_at
        """,
        key,
    )
    return StoreKey(**dict(r))
