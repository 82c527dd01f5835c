"""Modules in the store: every pushed version, the current one per module, and assignments
(a module on a machine); taking a reverted plan's change of them back; a module's history (its
versions by number, each with the last plan that rolled it out) and going back to one."""

import json
from datetime import datetime

import asyncpg
import msgspec

from mesh.model import PlanState


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
    note: str = "",
) -> bool:
    """Make `version` the module's current one (history kept). False if it already was. A
    version pushed again keeps its row (and its number); its bundles are stored again by the
    push, so they count as kept."""
    vid = await keep_version(
        conn, module=module, version=version, manifest=manifest, bundles=bundles, by=by, note=note
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
    note: str = "",
) -> int:
    """Store a version (once) without making it current, as a held push does; its id. A
    version stored again keeps its row (and its number) and counts as kept: its push stored
    its bundles again. A note given replaces the version's; none keeps it."""
    return await conn.fetchval(
        """
        INSERT INTO module_versions (module, version, manifest, bundles, pushed_by, note)
        VALUES ($1, $2, $3, $4::jsonb, $5, $6)
        ON CONFLICT (module, version) DO UPDATE SET bundles_pruned = NULL,
            note = CASE WHEN $6 = '' THEN module_versions.note ELSE $6 END
        RETURNING id
        """,
        module,
        version,
        manifest,
        json.dumps(bundles, sort_keys=True),
        by,
        note,
    )


async def version_of(conn: asyncpg.Connection, version_id: int) -> StoredVersion:
    """A stored version by its id (a held push's, being approved)."""
    r = await conn.fetchrow(f"SELECT {_VERSION} FROM module_versions v WHERE v.id = $1", version_id)
    assert r is not None, version_id  # versions are never deleted
    return _version(r)


async def pushed_by(conn: asyncpg.Connection, *, module: str, version: str) -> str | None:
    """Who pushed that version of the module first (None: no such version)."""
    return await conn.fetchval(
        "SELECT pushed_by FROM module_versions WHERE module = $1 AND version = $2", module, version
    )


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


async def machines_of(conn: asyncpg.Connection, module: str) -> list[str]:
    """The machines a module is assigned to, by name."""
    rows = await conn.fetch(
        "SELECT machine FROM assignments WHERE module = $1 ORDER BY machine", module
    )
    return [r["machine"] for r in rows]


async def assigned_to(conn: asyncpg.Connection, machine: str) -> set[str]:
    """The modules assigned to one machine."""
    rows = await conn.fetch("SELECT module FROM assignments WHERE machine = $1", machine)
    return {r["module"] for r in rows}


async def assign(conn: asyncpg.Connection, *, module: str, machines: list[str]) -> None:
    await conn.executemany(
        "INSERT INTO assignments (module, machine) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        [(module, m) for m in machines],
    )


async def reassign(
    conn: asyncpg.Connection, module: str, machines: list[str], *, undo: bool
) -> list[str]:
    """Assign (or, `undo`, unassign) the module on these machines; those it moved."""
    had = {m for m, mods in (await assignments(conn)).items() if module in mods}
    moved = sorted(set(machines) & had) if undo else sorted(set(machines) - had)
    change = unassign if undo else assign
    await change(conn, module=module, machines=machines)
    return moved


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
    if trigger in ("push", "rollback") and module:
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


# --- a module's history, and going back ------------------------------------------------------


class HistoryRow(msgspec.Struct, frozen=True):
    """One version of a module as its history shows it."""

    id: int  # module_versions.id
    number: int  # 1 for the module's first version, then 2, 3, ... in the order first pushed
    digest: str  # its source archive's sha256 (module_versions.version)
    pushed_at: datetime
    pushed_by: str
    plan: int | None  # the last push, rollback or assign plan that rolled it out
    state: PlanState | None  # that plan's state
    current: bool
    # its bundles were deleted from the bundle store (services/controller/catalog/bundles.py)
    pruned: bool
    note: str = ""  # its push's --note


async def history(
    conn: asyncpg.Connection, module: str, *, below: int | None = None, most: int | None = None
) -> list[HistoryRow]:
    """The module's versions, newest (highest number) first: those numbered below `below`, at
    most `most` of them. A version's number is its place among the module's versions by id:
    rows are never deleted, so it never changes; a version pushed again keeps its row."""
    rows = await conn.fetch(
        """
        WITH v AS (
            SELECT id, version, pushed_at, pushed_by, note, bundles_pruned IS NOT NULL AS pruned,
                   row_number() OVER (ORDER BY id) AS number
            FROM module_versions WHERE module = $1
        ), rolled AS (
            -- A plan names the version it rolls out in `undo.to` once it is in the catalog; a
            -- held push's (or one cancelled while held) names it in `hold.version` alone; an
            -- assign's, the module's version when it was recorded, in `undo.version`.
            SELECT DISTINCT ON (vid) vid, id, state FROM (
                SELECT CASE WHEN jsonb_typeof(undo -> 'to') = 'number' THEN undo -> 'to'
                            WHEN trigger = 'assign' THEN undo -> 'version'
                            ELSE hold -> 'version' END AS vid, id, state
                FROM plans WHERE subject = $1 AND trigger IN ('push', 'rollback', 'assign')
            ) p WHERE vid IS NOT NULL
            ORDER BY vid, id DESC
        )
        SELECT v.id, v.number, v.version, v.pushed_at, v.pushed_by, v.pruned, v.note,
               coalesce(m.version_id = v.id, false) AS current, r.id AS plan, r.state
        FROM v
        LEFT JOIN modules m ON m.name = $1
        LEFT JOIN rolled r ON r.vid = to_jsonb(v.id)
        WHERE $2::bigint IS NULL OR v.number < $2
        ORDER BY v.number DESC LIMIT $3
        """,
        module,
        below,
        most,
    )
    return [_history_row(r) for r in rows]


def _history_row(r: asyncpg.Record) -> HistoryRow:
    return HistoryRow(
        id=r["id"], number=r["number"], digest=r["version"], pushed_at=r["pushed_at"],
        pushed_by=r["pushed_by"], plan=r["plan"], state=r["state"], current=r["current"],
        pruned=r["pruned"], note=r["note"],
    )  # fmt: skip


async def current_numbers(conn: asyncpg.Connection) -> dict[str, int]:
    """Each module's current version's number in its history (as `history` numbers them)."""
    rows = await conn.fetch(
        "SELECT m.name, (SELECT count(*) FROM module_versions o"
        " WHERE o.module = m.name AND o.id <= m.version_id) AS number FROM modules m"
    )
    return {r["name"]: r["number"] for r in rows}


async def version_count(conn: asyncpg.Connection, module: str) -> int:
    return await conn.fetchval("SELECT count(*) FROM module_versions WHERE module = $1", module)


async def stored_version(conn: asyncpg.Connection, version_id: int) -> StoredVersion | None:
    r = await conn.fetchrow(f"SELECT {_VERSION} FROM module_versions v WHERE v.id = $1", version_id)
    return _version(r) if r is not None else None


async def set_current(conn: asyncpg.Connection, *, module: str, version_id: int) -> None:
    """A registered module back at one of its versions (a rollback), whose bundles were found
    stored: they are in use again, and kept as the current version's."""
    await conn.execute(
        "UPDATE modules SET version_id = $2, updated_at = now() WHERE name = $1",
        module,
        version_id,
    )
    await conn.execute("UPDATE module_versions SET bundles_pruned = NULL WHERE id = $1", version_id)


# --- the bundles kept (services/controller/catalog/bundles.py) ------------------------------------


class OldVersion(msgspec.Struct, frozen=True):
    """A version past the number kept whose bundles are still stored."""

    id: int
    module: str
    number: int
    digests: frozenset[str]  # its source archive's and its stored bundles'


async def old_versions(
    conn: asyncpg.Connection, *, keep: int, most: int, after: int = 0
) -> tuple[list[OldVersion], set[str]]:
    """At most `most` versions, oldest first from just after the id `after`, that are neither
    among their module's newest `keep` nor its current one and whose bundles are still stored;
    and every digest the versions that are kept name (a bundle two versions share stays with
    the newer)."""
    rows = await conn.fetch(
        """
        SELECT v.id, v.module, v.version, v.bundles, v.bundles_pruned IS NOT NULL AS pruned,
               row_number() OVER (PARTITION BY v.module ORDER BY v.id) AS number,
               row_number() OVER (PARTITION BY v.module ORDER BY v.id DESC) > $1
                   AND m.name IS NULL AS old
        FROM module_versions v LEFT JOIN modules m ON m.version_id = v.id
        ORDER BY v.id
        """,
        keep,
    )
    old: list[OldVersion] = []
    kept: set[str] = set()
    for r in rows:
        stored = {d for d in json.loads(r["bundles"]).values() if d.startswith("sha256:")}
        digests = frozenset({r["version"], *stored})
        if not r["old"]:
            kept |= digests
        elif not r["pruned"] and r["id"] > after and len(old) < most:
            old.append(OldVersion(id=r["id"], module=r["module"], number=r["number"],
                                  digests=digests))  # fmt: skip
    return old, kept


async def still_named(
    conn: asyncpg.Connection, digests: list[str], *, ended: list[str]
) -> set[str]:
    """Those of `digests` that a machine's stored declaration names, or a plan whose state is
    not one of `ended` (its steps' declarations, or the bundles a push builds). A digest is
    looked for as the text it is in canonical JSON: the one spelling a declaration has."""
    rows = await conn.fetch(
        """
        SELECT d FROM unnest($1::text[]) AS d
        WHERE EXISTS (SELECT 1 FROM declarations WHERE position(convert_to(d, 'UTF8') IN body) > 0)
           OR EXISTS (
               SELECT 1 FROM plans p WHERE p.state <> ALL($2::text[])
               AND (position(d IN p.builds::text) > 0 OR EXISTS (
                   SELECT 1 FROM plan_steps s WHERE s.plan_id = p.id
                   AND (position(convert_to(d, 'UTF8') IN s.after_body) > 0
                        OR position(convert_to(d, 'UTF8') IN coalesce(s.before_body, ''::bytea))
                           > 0))))
        """,
        digests,
        ended,
    )
    return {r["d"] for r in rows}


async def mark_pruned(conn: asyncpg.Connection, version_ids: list[int]) -> None:
    await conn.execute(
        "UPDATE module_versions SET bundles_pruned = now() WHERE id = ANY($1::bigint[])",
        version_ids,
    )
