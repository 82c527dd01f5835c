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
    drained: bool = False  # skipped by every plan (`mesh drain`)


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
        drained=r["drained"],
    )


async def all_machines(conn: asyncpg.Connection | asyncpg.Pool) -> list[MachineRow]:
    rows = await conn.fetch(
        "SELECT name, tier, labels, facts, up, last_seen, beat_interval, version, drained"
        " FROM machines ORDER BY name"
    )
    return [_row(r) for r in rows]


class Registration(msgspec.Struct, frozen=True):
    """One machine's registration. It refreshes facts and liveness only: the tier and labels
    decide what a machine gets, so they are the operator's. A machine's first registration
    takes its placement (`mesh machine add --tier --label`, `mesh tier`, `mesh label` before it
    registered), else `claimed_tier` / `claimed_labels` (the host's own word, given only on a
    mesh without authentication), else tier 2 and no labels. `version` is the agent's running
    mesh; "" (an agent that does not say) is kept as unknown."""

    name: str
    facts: Facts
    beat_interval: float
    version: str = ""
    claimed_tier: int | None = None
    claimed_labels: dict[str, str] | None = None


async def register_many(
    conn: asyncpg.Connection, registrations: list[Registration]
) -> list[MachineRow]:
    """Insert or refresh machines, in one statement: a takeover's storm of registrations is
    written in batches (services/controller/fleet/fleet.py). Names must be distinct; the rows come
    back in no given order."""
    if not registrations:
        return []
    registrations = sorted(registrations, key=lambda r: r.name)  # rows locked in one order
    rows = await conn.fetch(
        """
        WITH input AS (
            SELECT * FROM unnest($1::text[], $2::int[], $3::text[], $4::text[],
                                 $5::float8[], $6::text[])
                AS i(name, claimed_tier, claimed_labels, facts, beat_interval, version)
        ), placed AS (
            DELETE FROM placements p USING input i WHERE p.name = i.name
            RETURNING p.name, p.tier, p.labels
        )
        INSERT INTO machines (name, tier, labels, facts, up, last_seen, beat_interval, version)
        SELECT i.name, coalesce(pl.tier, i.claimed_tier, 2),
               coalesce(pl.labels, i.claimed_labels::jsonb, '{}'::jsonb), i.facts::jsonb, true,
               now(), i.beat_interval, nullif(i.version, '')
        FROM input i LEFT JOIN placed pl ON pl.name = i.name
        ON CONFLICT (name) DO UPDATE SET
            facts = excluded.facts,
            up = true,
            last_seen = now(),
            beat_interval = excluded.beat_interval,
            version = excluded.version
        RETURNING name, tier, labels, facts, up, last_seen, beat_interval, version, drained
        """,
        [r.name for r in registrations],
        [r.claimed_tier for r in registrations],
        [
            json.dumps(r.claimed_labels, sort_keys=True) if r.claimed_labels is not None else None
            for r in registrations
        ],
        [msgspec.json.encode(r.facts).decode() for r in registrations],
        [r.beat_interval for r in registrations],
        [r.version for r in registrations],
    )
    return [_row(r) for r in rows]


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


async def set_drained(conn: asyncpg.Connection, *, name: str, drained: bool) -> None:
    await conn.execute("UPDATE machines SET drained = $2 WHERE name = $1", name, drained)


async def wanted_while_drained(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, str]:
    """Drained machine -> the digest the catalog composed for it when a plan last skipped it
    for the drain (its newest step, if that one was skipped unsent): what `nodes` shows as
    wanted until it is undrained. A drained machine no plan has skipped wants what it has."""
    rows = await conn.fetch(
        """
        SELECT m.name, s.after FROM machines m
        CROSS JOIN LATERAL (
            SELECT after, state, published FROM plan_steps WHERE machine = m.name
            ORDER BY plan_id DESC LIMIT 1
        ) s
        WHERE m.drained AND s.state = 'skipped' AND NOT s.published
        """
    )
    return {r["name"]: r["after"] for r in rows}


async def set_up_many(conn: asyncpg.Connection, changes: list[tuple[str, bool, datetime]]) -> None:
    """Machines up or down, with their last-seen times, in one statement: (name, up, last_seen)
    each; the names distinct."""
    if not changes:
        return
    await conn.execute(
        """
        UPDATE machines AS m SET up = s.up, last_seen = s.at
        FROM unnest($1::text[], $2::bool[], $3::timestamptz[]) AS s(name, up, at)
        WHERE m.name = s.name
        """,
        [c[0] for c in changes],
        [c[1] for c in changes],
        [c[2] for c in changes],
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
