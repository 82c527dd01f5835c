"""Modules in the store: every pushed version, the current one per module, and assignments
(a module on a machine); taking a reverted plan's change of them back."""

import json
from datetime import datetime

import asyncpg
import msgspec


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


async def rebundle(conn: asyncpg.Connection, *, version_id: int, bundles: dict[str, str]) -> None:
    """A version's bundles, stored again (a bundle lost from the store and built again as
    other bytes: the same source, another digest)."""
    await conn.execute(
        "UPDATE module_versions SET bundles = $2::jsonb WHERE id = $1",
        version_id,
        json.dumps(bundles, sort_keys=True),
    )


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
    vid = await keep_version(
        conn, module=module, version=version, manifest=manifest, bundles=bundles, by=by
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


async def keep_version(
    conn: asyncpg.Connection,
    *,
    module: str,
    version: str,
    manifest: str,
    bundles: dict[str, str],
    by: str,
) -> int:
    """Store a version (once) without making it current, as a held push does; its id."""
    return await conn.fetchval(
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


async def version_of(conn: asyncpg.Connection, version_id: int) -> StoredVersion:
    """A stored version by its id (a held push's, being approved)."""
    r = await conn.fetchrow(f"SELECT {_VERSION} FROM module_versions v WHERE v.id = $1", version_id)
    assert r is not None, version_id  # versions are never deleted
    return _version(r)


async def assignments(conn: asyncpg.Connection) -> dict[str, set[str]]:
    """machine -> modules assigned to it."""
    found: dict[str, set[str]] = {}
    for r in await conn.fetch("SELECT module, machine FROM assignments"):
        found.setdefault(r["machine"], set()).add(r["module"])
    return found


async def assigned_after(
    conn: asyncpg.Connection, *, after: tuple[str, str] | None, most: int
) -> list[tuple[str, str]]:
    """At most `most` assignments (module, machine) after `after`, by module then machine, in
    byte order ("C"), which is Python's order of the names: `modules` walks them beside the
    modules it sorts itself."""
    module, machine = after if after is not None else ("", "")
    rows = await conn.fetch(
        'SELECT module, machine FROM assignments WHERE (module COLLATE "C", machine COLLATE "C")'
        ' > ($1, $2) ORDER BY module COLLATE "C", machine COLLATE "C" LIMIT $3',
        module, machine, most,
    )  # fmt: skip
    return [(r["module"], r["machine"]) for r in rows]


async def assign(conn: asyncpg.Connection, *, module: str, machines: list[str]) -> None:
    await conn.executemany(
        "INSERT INTO assignments (module, machine) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        [(module, m) for m in machines],
    )


async def unassign(conn: asyncpg.Connection, *, module: str, machines: list[str]) -> None:
    await conn.execute(
        "DELETE FROM assignments WHERE module = $1 AND machine = ANY($2::text[])", module, machines
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
