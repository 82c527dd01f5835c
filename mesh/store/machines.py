"""Machines in the store: registration, liveness transitions, last-seen times."""

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
    )


async def all_machines(conn: asyncpg.Connection | asyncpg.Pool) -> list[MachineRow]:
    rows = await conn.fetch(
        "SELECT name, tier, labels, facts, up, last_seen, beat_interval FROM machines ORDER BY name"
    )
    return [_row(r) for r in rows]


async def register(
    conn: asyncpg.Connection,
    *,
    name: str,
    tier: int | None,
    labels: dict[str, str],
    facts: Facts,
    beat_interval: float,
) -> MachineRow:
    """Insert or refresh a machine. The tier is set by the first registration (2 if it names
    none); after that only `mesh tier` moves a machine, so a host's restart cannot."""
    r = await conn.fetchrow(
        """
        INSERT INTO machines (name, tier, labels, facts, up, last_seen, beat_interval)
        VALUES ($1, coalesce($2, 2), $3::jsonb, $4::jsonb, true, now(), $5)
        ON CONFLICT (name) DO UPDATE SET
            labels = excluded.labels,
            facts = excluded.facts,
            up = true,
            last_seen = now(),
            beat_interval = excluded.beat_interval
        RETURNING name, tier, labels, facts, up, last_seen, beat_interval
        """,
        name,
        tier,
        json.dumps(labels, sort_keys=True),
        msgspec.json.encode(facts).decode(),
        beat_interval,
    )
    assert r is not None
    return _row(r)


async def set_tier(conn: asyncpg.Connection, *, name: str, tier: int) -> None:
    await conn.execute("UPDATE machines SET tier = $2 WHERE name = $1", name, tier)


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
