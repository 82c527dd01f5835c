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
    """Store a new version of `name`, sealed under the ring's active key, the one it had kept
    as its previous (migration 015); its version. `by` (the operator) and `modules` (a glob;
    None keeps the one it had) say who may use it (mesh/auth/scopes.py)."""
    # Past the previous one too: after a revert that is the version taken back, and a number
    # names one value only (a host's declaration digest changes with it).
    highest = await conn.fetchval(
        "SELECT greatest(version, prev_version) FROM secrets WHERE name = $1 FOR UPDATE", name
    )
    version = (highest or 0) + 1
    sealed = ring.seal(name=name, version=version, value=value)
    # In DO UPDATE, `secrets.x` is the row as it was: the current version becomes the previous.
    await conn.execute(
        """
        INSERT INTO secrets (name, value, data_key, key_id, version, set_by, modules)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        ON CONFLICT (name) DO UPDATE SET value = $2, data_key = $3, key_id = $4, version = $5,
            set_by = $6, modules = coalesce($7, secrets.modules), updated_at = now(),
            prev_version = secrets.version, prev_value = secrets.value,
            prev_data_key = secrets.data_key, prev_key_id = secrets.key_id
        """,
        name, sealed.value, sealed.data_key, sealed.key_id, version, by, modules,
    )  # fmt: skip
    return version


async def undo(conn: asyncpg.Connection, change: dict) -> str:
    """Take back a reverted plan's `secret set`: the previous version current again (the one
    taken back kept as the previous, so its number is never given again), unless the secret was
    set again since (that newer version stands); in words."""
    name, was, to = change.get("secret"), change.get("from"), change.get("to")
    if name is None:  # a rotation of the key: nothing of the catalog to take back
        return "nothing to take back"
    if was is None:
        return f"secret {name} had no version before {to}: it stays at {to}"
    back = await conn.fetchval(
        """
        UPDATE secrets SET version = prev_version, value = prev_value, data_key = prev_data_key,
            key_id = prev_key_id, updated_at = now(), prev_version = version,
            prev_value = value, prev_data_key = data_key, prev_key_id = key_id
        WHERE name = $1 AND version = $2 AND prev_version = $3 RETURNING true
        """,
        name, to, was,
    )  # fmt: skip
    if not back:
        return f"secret {name} was set again since (or deleted): as it is now, it stands"
    return f"secret {name} is back at version {was}"


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
    conn: asyncpg.Connection | asyncpg.Pool, name: str, *, ring: KeyRing, version: int | None = None
) -> tuple[int, bytes] | None:
    """The version and value of `name` (its `version` while that is the previous one kept,
    else the current), opened with `ring` (secretkeys.KeyMissing if it lacks the key); None if
    it was never set."""
    r = await conn.fetchrow(
        "SELECT version, value, data_key, key_id, prev_version, prev_value, prev_data_key,"
        " prev_key_id FROM secrets WHERE name = $1",
        name,
    )
    if r is None:
        return None
    prev = version is not None and version != r["version"] and version == r["prev_version"]
    at = "prev_" if prev else ""
    if r[f"{at}key_id"] is None:  # an older mesh's plaintext, until the takeover seals it
        return r[f"{at}version"], bytes(r[f"{at}value"])
    sealed = Sealed(value=bytes(r[f"{at}value"]), data_key=bytes(r[f"{at}data_key"]),
                    key_id=r[f"{at}key_id"])  # fmt: skip
    return r[f"{at}version"], ring.open(name=name, version=r[f"{at}version"], sealed=sealed)


async def not_under(conn: asyncpg.Connection, key: str) -> list[str]:
    """The secrets not wrapped under `key` (plaintext, or under another key), by name."""
    rows = await conn.fetch(
        "SELECT name FROM secrets WHERE key_id IS DISTINCT FROM $1"
        " OR (prev_version IS NOT NULL AND prev_key_id IS DISTINCT FROM $1) ORDER BY name",
        key,
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
        "SELECT version, value, data_key, key_id, prev_version, prev_value, prev_data_key,"
        " prev_key_id FROM secrets WHERE name = $1 FOR UPDATE",
        name,
    )
    if r is None:
        return None
    done: Resealed | None = None
    for at in ("", "prev_"):  # the current version, and the previous one kept
        if r[f"{at}version"] is None or r[f"{at}key_id"] == ring.active:
            continue
        if r[f"{at}key_id"] is None:
            sealed = ring.seal(name=name, version=r[f"{at}version"], value=bytes(r[f"{at}value"]))
            done = done or "sealed"
        else:
            old = Sealed(value=bytes(r[f"{at}value"]), data_key=bytes(r[f"{at}data_key"]),
                         key_id=r[f"{at}key_id"])  # fmt: skip
            sealed = ring.rewrap(name=name, sealed=old)
            done = done or "rewrapped"
        await conn.execute(
            f"UPDATE secrets SET {at}value = $2, {at}data_key = $3, {at}key_id = $4"
            " WHERE name = $1",
            name, sealed.value, sealed.data_key, sealed.key_id,
        )  # fmt: skip
    return done


class SetSecret(msgspec.Struct, frozen=True):
    """A secret that is set, as `secret list` shows it (never its value)."""

    name: str
    version: int
    set_by: str
    updated_at: datetime
    modules: str | None  # the glob of modules that may name it


async def listed(conn: asyncpg.Connection) -> list[SetSecret]:
    """Every secret that is set, by name, with the key of the secrets as one of them."""
    rows = [
        SetSecret(**dict(r))
        for r in await conn.fetch("SELECT name, version, set_by, updated_at, modules FROM secrets")
    ]
    key = await store_key(conn)
    if key is not None:
        rows.append(SetSecret(name=KEY_SECRET, version=key.version, set_by="",
                              updated_at=key.changed_at, modules=None))  # fmt: skip
    return sorted(rows, key=lambda r: r.name)


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
