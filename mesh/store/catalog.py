"""Modules, assignments, secrets, declarations, builds and plans in the store.

Every write of the seat's holder runs in a transaction that first checks the epoch (`fence`):
a paused old holder that wakes up after a takeover can change nothing.
"""

import json
from datetime import datetime

import asyncpg
import msgspec

from mesh import wire


class Fenced(wire.BadRequest):
    """The seat moved on: this controller's epoch is no longer the store's. As an answer to a
    verb it says to try again (the client's retry finds the new holder)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}: the seat moved to another controller; try again",
                         code="unavailable")  # fmt: skip


async def fence(conn: asyncpg.Connection, *, epoch: int, seat: str = "mesh-controller") -> None:
    current = await conn.fetchval("SELECT epoch FROM seats WHERE name = $1 FOR SHARE", seat)
    if current != epoch:
        raise Fenced(f"the seat is at epoch {current}, this controller holds {epoch}")


class StoredVersion(msgspec.Struct):
    id: int
    module: str
    version: str
    manifest: str
    bundles: dict[str, str]
    pushed_at: datetime
    pushed_by: str


def _version(r: asyncpg.Record) -> StoredVersion:
    return StoredVersion(
        id=r["id"],
        module=r["module"],
        version=r["version"],
        manifest=r["manifest"],
        bundles=json.loads(r["bundles"]),
        pushed_at=r["pushed_at"],
        pushed_by=r["pushed_by"],
    )


_VERSION = "v.id, v.module, v.version, v.manifest, v.bundles, v.pushed_at, v.pushed_by"


async def current_modules(conn: asyncpg.Connection) -> dict[str, StoredVersion]:
    rows = await conn.fetch(
        f"SELECT {_VERSION} FROM modules m JOIN module_versions v ON v.id = m.version_id"
    )
    return {r["module"]: _version(r) for r in rows}


async def record_version(
    conn: asyncpg.Connection,
    *,
    module: str,
    version: str,
    manifest: str,
    bundles: dict[str, str],
    by: str,
) -> bool:
    """Make `version` the module's current one (history kept). False if it already was."""
    vid = await conn.fetchval(
        """
        INSERT INTO module_versions (module, version, manifest, bundles, pushed_by)
        VALUES ($1, $2, $3, $4::jsonb, $5)
        ON CONFLICT (module, version) DO UPDATE SET module = excluded.module
        RETURNING id
        """,
        module,
        version,
        manifest,
        json.dumps(bundles, sort_keys=True),
        by,
    )
    current = await conn.fetchval("SELECT version_id FROM modules WHERE name = $1", module)
    if current == vid:
        return False
    await conn.execute(
        """
        INSERT INTO modules (name, version_id) VALUES ($1, $2)
        ON CONFLICT (name) DO UPDATE SET version_id = $2, updated_at = now()
        """,
        module,
        vid,
    )
    return True


async def assignments(conn: asyncpg.Connection) -> dict[str, set[str]]:
    """machine -> modules assigned to it."""
    found: dict[str, set[str]] = {}
    for r in await conn.fetch("SELECT module, machine FROM assignments"):
        found.setdefault(r["machine"], set()).add(r["module"])
    return found


async def assign(conn: asyncpg.Connection, *, module: str, machines: list[str]) -> None:
    await conn.executemany(
        "INSERT INTO assignments (module, machine) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        [(module, m) for m in machines],
    )


async def unassign(conn: asyncpg.Connection, *, module: str, machines: list[str]) -> None:
    await conn.execute(
        "DELETE FROM assignments WHERE module = $1 AND machine = ANY($2::text[])", module, machines
    )


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


async def declarations(
    conn: asyncpg.Connection, machines: list[str] | None = None
) -> dict[str, tuple[str, bytes, int]]:
    """machine -> (digest, canonical body, epoch)."""
    rows = await conn.fetch(
        "SELECT machine, digest, body, epoch FROM declarations"
        " WHERE $1::text[] IS NULL OR machine = ANY($1::text[])",
        machines,
    )
    return {r["machine"]: (r["digest"], bytes(r["body"]), r["epoch"]) for r in rows}


async def digests(conn: asyncpg.Connection) -> dict[str, str]:
    return {
        r["machine"]: r["digest"]
        for r in await conn.fetch("SELECT machine, digest FROM declarations")
    }


async def write_declarations(
    conn: asyncpg.Connection, bodies: dict[str, tuple[str, bytes]], *, epoch: int
) -> None:
    """machine -> (digest, body), in one statement."""
    await conn.executemany(
        """
        INSERT INTO declarations (machine, digest, body, epoch) VALUES ($1, $2, $3, $4)
        ON CONFLICT (machine) DO UPDATE SET digest = $2, body = $3, epoch = $4, updated_at = now()
        """,
        [(m, d, b, epoch) for m, (d, b) in sorted(bodies.items())],
    )


async def undo(conn: asyncpg.Connection, trigger: str, change: dict, *, plan_id: int) -> str:
    """Take back the catalog change a reverted plan made; what was done, in words. A later
    change of the same module stands: it was asked for after this one."""
    module = change.get("module")
    if trigger in ("assign", "unassign"):
        later = await conn.fetchval(
            "SELECT min(id) FROM plans WHERE id > $1 AND subject = $2"
            " AND trigger IN ('assign', 'unassign')",
            plan_id,
            module,
        )
        if later is not None:
            return f"module {module}'s assignment changed again since (plan {later}): it stands"
    if trigger == "push" and module:
        now = await conn.fetchval("SELECT version_id FROM modules WHERE name = $1", module)
        if now != change["to"]:
            return f"module {module} was pushed again since: its newer version stands"
        if change["from"] is None:
            await conn.execute("DELETE FROM assignments WHERE module = $1", module)
            await conn.execute("DELETE FROM modules WHERE name = $1", module)
            return f"module {module} is unregistered again (this was its first push)"
        await conn.execute(
            "UPDATE modules SET version_id = $2, updated_at = now() WHERE name = $1",
            module,
            change["from"],
        )
        return f"module {module} is back at its previous version"
    if trigger == "assign" and module:
        await unassign(conn, module=module, machines=change["machines"])
        return f"module {module} is unassigned again from {', '.join(change['machines'])}"
    if trigger == "unassign" and module:
        await assign(conn, module=module, machines=change["machines"])
        return f"module {module} is assigned again to {', '.join(change['machines'])}"
    return "nothing to take back"


MAX_LOG_TAIL = 4096  # bytes of a build's last lines kept in its row (a builder sends no more)


def clip_tail(text: str, limit: int = MAX_LOG_TAIL) -> str:
    """The end of `text`, at most `limit` bytes: a builder's reply is not trusted to be short."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return "…" + data[-(limit - 3) :].decode(errors="ignore")  # "…" is 3 bytes


class BuildRow(msgspec.Struct):
    key: str
    module: str
    bundle: str
    state: str
    digest: str | None
    builder: str | None
    log_tail: str
    log_object: str | None


async def build(conn: asyncpg.Connection | asyncpg.Pool, key: str) -> BuildRow | None:
    r = await conn.fetchrow(
        "SELECT key, module, bundle, state, digest, builder, log_tail, log_object"
        " FROM builds WHERE key = $1",
        key,
    )
    return BuildRow(**dict(r)) if r else None


async def last_build(
    conn: asyncpg.Connection | asyncpg.Pool, *, module: str, bundle: str | None
) -> BuildRow | None:
    r = await conn.fetchrow(
        "SELECT key, module, bundle, state, digest, builder, log_tail, log_object FROM builds"
        " WHERE module = $1 AND ($2::text IS NULL OR bundle = $2) ORDER BY started DESC LIMIT 1",
        module,
        bundle,
    )
    return BuildRow(**dict(r)) if r else None


async def start_build(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    key: str,
    module: str,
    bundle: str,
    source: str,
    builder: str,
) -> None:
    await conn.execute(
        """
        INSERT INTO builds (key, module, bundle, source, builder, state)
        VALUES ($1, $2, $3, $4, $5, 'running')
        ON CONFLICT (key) DO UPDATE SET builder = $5, state = 'running', started = now(),
            finished = NULL, digest = NULL
        """,
        key,
        module,
        bundle,
        source,
        builder,
    )


async def finish_build(
    conn: asyncpg.Connection | asyncpg.Pool,
    *,
    key: str,
    ok: bool,
    digest: str | None,
    tail: str,
    log_object: str | None,
) -> None:
    await conn.execute(
        "UPDATE builds SET state = $2, digest = $3, log_tail = $4, log_object = $5,"
        " finished = now() WHERE key = $1",
        key,
        "done" if ok else "failed",
        digest,
        clip_tail(tail),
        log_object,
    )
