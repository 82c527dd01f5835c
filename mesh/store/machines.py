"""Machines in the store: registration, placements (the operator's tier and labels), liveness
transitions, last-seen times."""

import json
from datetime import datetime

import asyncpg
import msgspec

from mesh.model import Facts


class MachineRow(msgspec.Struct):
    name: str
    tier: int
    labels: dict[str, str]
    facts: Facts | None
    up: bool
    last_seen: datetime | None
    beat_interval: float
    version: str | None = None  # the host agent's running mesh; None: it never said


def _row(r: asyncpg.Record) -> MachineRow:
    facts = msgspec.json.decode(r["facts"], type=Facts) if r["facts"] else None
    return MachineRow(
        name=r["name"],
        tier=r["tier"],
        labels=json.loads(r["labels"]),
        facts=facts,
        up=r["up"],
        last_seen=r["last_seen"],
        beat_interval=r["beat_interval"],
        version=r["version"],
    )


async def all_machines(conn: asyncpg.Connection | asyncpg.Pool) -> list[MachineRow]:
    rows = await conn.fetch(
        "SELECT name, tier, labels, facts, up, last_seen, beat_interval, version FROM machines"
        " ORDER BY name"
    )
    return [_row(r) for r in rows]


async def register(
    conn: asyncpg.Connection,
    *,
    name: str,
    facts: Facts,
    beat_interval: float,
    version: str = "",
    claimed_tier: int | None = None,
    claimed_labels: dict[str, str] | None = None,
) -> MachineRow:
    """Insert or refresh a machine. A registration refreshes facts and liveness only: the tier
    and labels decide what a machine gets, so they are the operator's. A machine's first
    registration takes its placement (`mesh machine add --tier --label`, `mesh tier`, `mesh
    label` before it registered), else `claimed_tier` / `claimed_labels` (the host's own word,
    passed only on a mesh without authentication), else tier 2 and no labels. `version` is
    the agent's running mesh; "" (an agent that does not say) is kept as unknown."""
    r = await conn.fetchrow(
        """
        WITH placed AS (DELETE FROM placements WHERE name = $1 RETURNING tier, labels)
        INSERT INTO machines (name, tier, labels, facts, up, last_seen, beat_interval, version)
        VALUES (
            $1,
            coalesce((SELECT tier FROM placed), $2, 2),
            coalesce((SELECT labels FROM placed), $3::jsonb, '{}'::jsonb),
            $4::jsonb, true, now(), $5, nullif($6, '')
        )
        ON CONFLICT (name) DO UPDATE SET
            facts = excluded.facts,
            up = true,
            last_seen = now(),
            beat_interval = excluded.beat_interval,
            version = excluded.version
        RETURNING name, tier, labels, facts, up, last_seen, beat_interval, version
        """,
        name,
        claimed_tier,
        json.dumps(claimed_labels, sort_keys=True) if claimed_labels is not None else None,
        msgspec.json.encode(facts).decode(),
        beat_interval,
        version,
    )
    assert r is not None
    return _row(r)


class Placement(msgspec.Struct):
    """What the operator decided for a machine that has not registered yet."""

    tier: int = 2
    labels: dict[str, str] = {}


async def placement(conn: asyncpg.Connection, name: str) -> Placement | None:
    r = await conn.fetchrow("SELECT tier, labels FROM placements WHERE name = $1", name)
    return Placement(tier=r["tier"], labels=json.loads(r["labels"])) if r else None


async def place(conn: asyncpg.Connection, *, name: str, tier: int, labels: dict[str, str]) -> None:
    """Record where a machine that has not registered yet goes (its first registration takes it)."""
    await conn.execute(
        """
        INSERT INTO placements (name, tier, labels) VALUES ($1, $2, $3::jsonb)
        ON CONFLICT (name) DO UPDATE SET tier = excluded.tier, labels = excluded.labels, at = now()
        """,
        name,
        tier,
        json.dumps(labels, sort_keys=True),
    )


async def set_tier(conn: asyncpg.Connection, *, name: str, tier: int) -> None:
    await conn.execute("UPDATE machines SET tier = $2 WHERE name = $1", name, tier)


async def set_labels(conn: asyncpg.Connection, *, name: str, labels: dict[str, str]) -> None:
    await conn.execute(
        "UPDATE machines SET labels = $2::jsonb WHERE name = $1",
        name,
        json.dumps(labels, sort_keys=True),
    )


async def set_up(conn: asyncpg.Connection, *, name: str, up: bool, last_seen: datetime) -> None:
    await conn.execute(
        "UPDATE machines SET up = $2, last_seen = $3 WHERE name = $1", name, up, last_seen
    )


async def touch_many(conn: asyncpg.Connection, seen: dict[str, datetime]) -> None:
    """Record last-seen times in one round trip (heartbeats are batched, not written one by one)."""
    if not seen:
        return
    await conn.execute(
        """
        UPDATE machines AS m SET last_seen = s.at
        FROM unnest($1::text[], $2::timestamptz[]) AS s(name, at)
        WHERE m.name = s.name AND (m.last_seen IS NULL OR m.last_seen < s.at)
        """,
        list(seen),
        list(seen.values()),
    )
