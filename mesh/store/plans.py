"""Plans and their steps in the store.

A plan is written by the change that makes it (push, assign, unassign, secret) and then only by
the holder's planner, always in a transaction that first checks the seat's epoch (`fence`), so a
plan in progress can be continued by whichever controller holds the seat next.
"""

import hashlib
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from mesh.model import (
    Phase,
    PlanBuild,
    PlanSettings,
    PlanState,
    PlanStep,
    PlanSummary,
    Soak,
    StepState,
    Trigger,
)

OPEN: tuple[PlanState, ...] = ("pending", "building", "held", "rolling", "paused")
# A plan that has ended: it will never send a declaration again.
ENDED: tuple[PlanState, ...] = ("done", "failed", "reverted", "cancelled", "rejected")
# Plans whose change is in the catalog and not yet on every machine (a held plan's change is
# made in the catalog only when it is approved: services/controller/changes/modules.py).
CHANGING: tuple[PlanState, ...] = ("pending", "building", "rolling", "paused")
# What the planner takes: a `building` plan has no steps until its push's builds are done, a
# held one waits for its approval outside the queue, and a paused one keeps its turn (its
# change is in the catalog: a later plan would carry it to machines it has not reached).
READY: tuple[PlanState, ...] = ("pending", "rolling", "paused")


class Step(msgspec.Struct):
    machine: str
    tier: int
    state: StepState
    after: str
    after_body: bytes
    before: str | None = None
    before_body: bytes | None = None
    published: bool = False
    reverted: bool = False
    started: datetime | None = None
    finished: datetime | None = None
    error: str | None = None


class Approval(msgspec.Struct, kw_only=True):
    """One operator's approval of a held plan, bound to what the plan did then (its digest):
    once the plan does something else, it is void."""

    by: str
    at: datetime
    digest: str


# What a held plan will do when it is approved, by its trigger (services/controller/plans/
# approvals.py). Stored in the plan's `hold` without its tag: the plan's trigger is the tag.
class _Held(msgspec.Struct, kw_only=True):
    module: str
    approvals: list[Approval] = []  # given so far, in order (`mesh policy`: how many it needs)
    approved_by: str | None = None  # whose approval made the change


class HeldPush(_Held, tag="push", tag_field="trigger", kw_only=True):
    """A push held: its version is stored, made current when approved."""

    version: int  # the stored version's id


class HeldAssign(_Held, tag="assign", tag_field="trigger", kw_only=True):
    """An assign held: the machines it adds the module to when approved."""

    machines: list[str]


class HeldUnassign(_Held, tag="unassign", tag_field="trigger", kw_only=True):
    """An unassign held: the machines it takes the module from when approved."""

    machines: list[str]


class HeldRestart(_Held, tag="restart", tag_field="trigger", kw_only=True):
    """A restart held: the machines whose processes of the module it restarts when approved."""

    machines: list[str]


Held = HeldPush | HeldAssign | HeldUnassign | HeldRestart


def _held_json(hold: Held) -> str:
    return msgspec.json.encode(hold, order="sorted").decode()


def _held(trigger: str, stored: str | None) -> Held | None:
    if stored is None:
        return None
    return msgspec.convert({**json.loads(stored), "trigger": trigger}, Held)


class Plan(msgspec.Struct):
    id: int
    state: PlanState
    trigger: Trigger
    subject: str
    by: str
    epoch: int
    created: datetime
    started: datetime | None
    finished: datetime | None
    phase: Phase
    error: str | None
    settings: PlanSettings
    builds: list[PlanBuild]
    undo: dict[str, Any]
    steps: list[Step]
    # Steering (migration 007; docs/operations.md, Steering a change)
    hold: Held | None = None  # a held plan's catalog change, made when approved
    cancel: str | None = None  # why it is (being) cancelled
    soak_tier: int | None = None  # the soak in progress (`soak_until` set) or last passed
    soak_until: datetime | None = None
    paused_after: int | None = None  # the last tier after which it paused itself
    note: str = ""  # its push's --note (migration 014)


async def noted(conn: asyncpg.Connection, plan_id: int, note: str) -> None:
    """The change's note on its plan (`push --note`)."""
    await conn.execute("UPDATE plans SET note = $2 WHERE id = $1", plan_id, note)


async def create(
    conn: asyncpg.Connection,
    *,
    trigger: Trigger,
    subject: str,
    by: str,
    epoch: int,
    settings: PlanSettings,
    builds: list[PlanBuild],
    undo: dict[str, Any],
    steps: list[Step],
    state: PlanState = "pending",
    hold: Held | None = None,
) -> int:
    plan_id: int = await conn.fetchval(
        "INSERT INTO plans (trigger, subject, state, epoch, requested_by, settings, builds, undo,"
        " hold) VALUES ($1, $2, $8, $3, $4, $5::jsonb, $6::jsonb, $7::jsonb, $9::jsonb)"
        " RETURNING id",
        trigger, subject, epoch, by,
        msgspec.json.encode(settings).decode(),
        msgspec.json.encode(builds).decode(),
        json.dumps(undo, sort_keys=True), state,
        None if hold is None else _held_json(hold),
    )  # fmt: skip
    await _insert_steps(conn, plan_id, steps)
    return plan_id


async def _insert_steps(conn: asyncpg.Connection, plan_id: int, steps: list[Step]) -> None:
    await conn.executemany(
        "INSERT INTO plan_steps (plan_id, machine, tier, after, after_body)"
        " VALUES ($1, $2, $3, $4, $5)",
        [(plan_id, s.machine, s.tier, s.after, s.after_body) for s in steps],
    )


async def built(
    conn: asyncpg.Connection,
    plan_id: int,
    *,
    settings: PlanSettings,
    builds: list[PlanBuild],
    undo: dict[str, Any],
    steps: list[Step],
    hold: Held | None = None,
) -> bool:
    """A `building` plan whose builds are done gets its steps and waits its turn (`pending`),
    or, with `hold`, its approval (`held`); False if it is no longer building (a new holder
    failed it)."""
    done = await conn.fetchval(
        "UPDATE plans SET state = $5, settings = $2::jsonb, builds = $3::jsonb,"
        " undo = $4::jsonb, hold = $6::jsonb WHERE id = $1 AND state = 'building' RETURNING id",
        plan_id,
        msgspec.json.encode(settings).decode(),
        msgspec.json.encode(builds).decode(),
        json.dumps(undo, sort_keys=True),
        "pending" if hold is None else "held",
        None if hold is None else _held_json(hold),
    )
    if done is None:
        return False
    await _insert_steps(conn, plan_id, steps)
    return True


async def drop_building(conn: asyncpg.Connection, plan_id: int) -> None:
    """A `building` plan whose push turned out to change no machine: it was never a change."""
    await conn.execute("DELETE FROM plans WHERE id = $1 AND state = 'building'", plan_id)


async def fail_building(
    conn: asyncpg.Connection, error: str, *, plan_id: int | None = None, before_epoch: int = 0
) -> list[int]:
    """Fail one `building` plan (its build failed or was cut off), or every one recorded under
    an epoch older than `before_epoch` (their controller stopped mid-build); their ids."""
    rows = await conn.fetch(
        "UPDATE plans SET state = 'failed', finished = now(), error = $3"
        " WHERE state = 'building' AND (id = $1 OR epoch < $2) RETURNING id",
        plan_id,
        before_epoch,
        error,
    )
    return [r["id"] for r in rows]


_PLAN = (
    "id, state, trigger, subject, requested_by, epoch, created, started, finished, phase, error,"
    " settings, builds, undo, hold, cancel, soak_tier, soak_until, paused_after, note"
)


async def load(conn: asyncpg.Connection | asyncpg.Pool, plan_id: int) -> Plan | None:
    r = await conn.fetchrow(f"SELECT {_PLAN} FROM plans WHERE id = $1", plan_id)
    if r is None:
        return None
    rows = await conn.fetch(
        "SELECT machine, tier, state, after, after_body, before, before_body, published, reverted,"
        " started, finished, error FROM plan_steps WHERE plan_id = $1 ORDER BY tier, machine",
        plan_id,
    )
    steps = [
        Step(**{**dict(s), "after_body": bytes(s["after_body"]),
                "before_body": bytes(s["before_body"]) if s["before_body"] else None})
        for s in rows
    ]  # fmt: skip
    return _plan(r, steps)


def _plan(r: asyncpg.Record, steps: list[Step]) -> Plan:
    return Plan(
        id=r["id"], state=r["state"], trigger=r["trigger"], subject=r["subject"],
        by=r["requested_by"], epoch=r["epoch"], created=r["created"], started=r["started"],
        finished=r["finished"], phase=r["phase"], error=r["error"],
        settings=msgspec.json.decode(r["settings"], type=PlanSettings),
        builds=msgspec.json.decode(r["builds"], type=list[PlanBuild]),
        undo=json.loads(r["undo"]), steps=steps,
        hold=_held(r["trigger"], r["hold"]), cancel=r["cancel"],
        soak_tier=r["soak_tier"], soak_until=r["soak_until"], paused_after=r["paused_after"],
        note=r["note"],
    )  # fmt: skip


# --- what `plan` shows, a page of steps at a time (mesh/paging.py) ----------------------------


async def head(conn: asyncpg.Connection, plan_id: int) -> Plan | None:
    """The plan without its steps."""
    r = await conn.fetchrow(f"SELECT {_PLAN} FROM plans WHERE id = $1", plan_id)
    return None if r is None else _plan(r, [])


class TierCounts(msgspec.Struct, frozen=True):
    """One tier of a plan, counted: what its state is judged from."""

    tier: int
    total: int
    done: int  # done or skipped
    failed: bool  # a step failed
    reverted: bool  # a step got its `before` back
    moving: bool  # a step is applying or done


async def tiers(conn: asyncpg.Connection, plan_id: int) -> list[TierCounts]:
    rows = await conn.fetch(
        """
        SELECT tier, count(*) AS total,
               count(*) FILTER (WHERE state IN ('done', 'skipped')) AS done,
               bool_or(state = 'failed') AS failed, bool_or(reverted) AS reverted,
               bool_or(state IN ('applying', 'done')) AS moving
        FROM plan_steps WHERE plan_id = $1 GROUP BY tier ORDER BY tier
        """,
        plan_id,
    )
    return [TierCounts(**dict(r)) for r in rows]


async def step_views(
    conn: asyncpg.Connection, plan_id: int, *, after: tuple[int, str] | None, most: int
) -> list[PlanStep]:
    """At most `most` steps as `plan` shows them, by tier then machine, after the step `after`
    (tier, machine). Without the declarations' bodies: a page reads only what it shows."""
    tier, machine = after if after is not None else (-1, "")
    rows = await conn.fetch(
        "SELECT machine, tier, state, started, finished, error, before, after, reverted"
        " FROM plan_steps WHERE plan_id = $1 AND (tier, machine) > ($2, $3)"
        " ORDER BY tier, machine LIMIT $4",
        plan_id, tier, machine, most,
    )  # fmt: skip
    return [PlanStep(**dict(r)) for r in rows]


async def step_bodies(
    conn: asyncpg.Connection, plan_id: int, machines: list[str]
) -> dict[str, tuple[bytes | None, bytes]]:
    """The declarations these steps go from (None: not recorded yet, until the plan starts)
    and to, by machine."""
    rows = await conn.fetch(
        "SELECT machine, before_body, after_body FROM plan_steps"
        " WHERE plan_id = $1 AND machine = ANY($2::text[])",
        plan_id, machines,
    )  # fmt: skip
    return {
        r["machine"]: (bytes(r["before_body"]) if r["before_body"] else None,
                       bytes(r["after_body"]))
        for r in rows
    }  # fmt: skip


async def oldest_open(conn: asyncpg.Connection | asyncpg.Pool) -> int | None:
    """The plan the planner takes next: the one started (rolling, or paused: a new holder
    continues it), else the oldest pending (or paused before it started: the queue waits for
    it). Started first: a plan whose builds finished late, or that was approved late, is older
    than plans that may have started meanwhile, and two plans must never roll (or revert) at
    once."""
    return await conn.fetchval(
        "SELECT id FROM plans WHERE state = ANY($1::text[])"
        " ORDER BY started IS NOT NULL DESC, id LIMIT 1",
        list(READY),
    )


async def counts(conn: asyncpg.Connection | asyncpg.Pool) -> dict[str, int]:
    """How many plans are in each state (the controller's metrics)."""
    rows = await conn.fetch("SELECT state, count(*) AS n FROM plans GROUP BY state")
    return {r["state"]: r["n"] for r in rows}


async def expected(conn: asyncpg.Connection, machines: list[str]) -> dict[str, str]:
    """machine -> the digest it will have once the plans already recorded finish: the newest
    open plan's target where one exists, else its stored declaration."""
    found = {
        r["machine"]: r["digest"]
        for r in await conn.fetch(
            "SELECT machine, digest FROM declarations WHERE machine = ANY($1::text[])", machines
        )
    }
    # A plan that is reverting leaves its machines at `before`, not `after`; a step skipped
    # without being sent (a drained machine) leaves its machine at what it has.
    planned = await conn.fetch(
        "SELECT DISTINCT ON (s.machine) s.machine,"
        " CASE WHEN p.phase = 'revert' THEN coalesce(s.before, '') ELSE s.after END AS digest"
        " FROM plan_steps s JOIN plans p ON p.id = s.plan_id"
        " WHERE s.machine = ANY($1::text[]) AND p.state = ANY($2::text[])"
        " AND NOT (s.state = 'skipped' AND NOT s.published)"
        " ORDER BY s.machine, p.id DESC",
        machines,
        list(CHANGING),
    )
    found.update({r["machine"]: r["digest"] for r in planned})
    return found


async def set_plan(conn: asyncpg.Connection, plan_id: int, **fields: Any) -> None:
    """Update a plan's columns (names from this module only, never from a message)."""
    allowed = {"state", "phase", "started", "finished", "error"} | _STEERING
    assert set(fields) <= allowed, fields
    sets = ", ".join(f"{k} = ${i}" for i, k in enumerate(fields, start=2))
    await conn.execute(f"UPDATE plans SET {sets} WHERE id = $1", plan_id, *fields.values())


_STEERING = {"cancel", "soak_tier", "soak_until", "paused_after"}


async def set_steps(
    conn: asyncpg.Connection, plan_id: int, steps: list[Step], *, epoch: int
) -> None:
    """Write the given steps' state back, all in one statement."""
    await conn.executemany(
        """
        UPDATE plan_steps SET state = $3, before = $4, before_body = $5, after = $6,
            after_body = $7, published = $8, reverted = $9, started = $10, finished = $11,
            error = $12, epoch = $13, tier = $14
        WHERE plan_id = $1 AND machine = $2
        """,
        [
            (plan_id, s.machine, s.state, s.before, s.before_body, s.after, s.after_body,
             s.published, s.reverted, s.started, s.finished, s.error, epoch, s.tier)
            for s in steps
        ],
    )  # fmt: skip


async def recent(
    conn: asyncpg.Connection | asyncpg.Pool, limit: int, *, before: int | None = None
) -> list[PlanSummary]:
    """The newest `limit` plans, newest first; with `before`, those older than that plan."""
    rows = await conn.fetch(
        """
        WITH page AS (
            SELECT * FROM plans WHERE $2::bigint IS NULL OR id < $2 ORDER BY id DESC LIMIT $1
        )
        SELECT p.id, p.state, p.trigger, p.subject, p.requested_by, p.created, p.finished,
               p.phase, p.error, p.soak_tier, p.soak_until, p.cancel,
               count(s.machine) AS machines,
               count(s.machine) FILTER (WHERE s.state IN ('done', 'skipped')) AS done,
               min(s.tier) FILTER (WHERE s.state IN ('pending', 'applying')) AS tier
        FROM page p LEFT JOIN plan_steps s ON s.plan_id = p.id
        GROUP BY p.id, p.state, p.trigger, p.subject, p.requested_by, p.created, p.finished,
                 p.phase, p.error, p.soak_tier, p.soak_until, p.cancel
        ORDER BY p.id DESC
        """,
        limit,
        before,
    )
    return [_summary(r) for r in rows]


async def count(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    return await conn.fetchval("SELECT count(*) FROM plans")


def _summary(r: asyncpg.Record) -> PlanSummary:
    return PlanSummary(
        id=r["id"], state=r["state"], trigger=r["trigger"], subject=r["subject"],
        by=r["requested_by"], created=r["created"], finished=r["finished"],
        machines=r["machines"], done=r["done"],
        tier=r["tier"] if r["state"] in CHANGING else None, phase=r["phase"], failure=r["error"],
        soak=soak_shown(r["soak_tier"], r["soak_until"]), cancelled=r["cancel"],
    )  # fmt: skip


# --- steering (docs/operations.md, Steering a change) -------------------------------------------


def soak_shown(
    tier: int | None, until: datetime | None, *, now: datetime | None = None
) -> Soak | None:
    """The soak in progress as replies show it, with the seconds left now."""
    if tier is None or until is None:
        return None
    left = (until - (now or datetime.now(UTC))).total_seconds()
    return Soak(tier=tier, until=until, left=round(max(0.0, left), 1))


async def locked(conn: asyncpg.Connection, plan_id: int) -> Plan | None:
    """The plan without its steps, its row locked until the transaction ends: the operator's
    verbs and the planner's own moves (start, finish) take it first, so they come one after
    the other, each seeing what the one before wrote."""
    r = await conn.fetchrow(f"SELECT {_PLAN} FROM plans WHERE id = $1 FOR UPDATE", plan_id)
    return None if r is None else _plan(r, [])


async def set_hold(conn: asyncpg.Connection, plan_id: int, hold: Held) -> None:
    """A held plan's `hold` (its approvals so far); it stays held."""
    await conn.execute(
        "UPDATE plans SET hold = $2::jsonb WHERE id = $1 AND state = 'held'",
        plan_id, _held_json(hold),
    )  # fmt: skip


def digest_of(steps: Iterable[tuple[int, str, str]]) -> str:
    """A plan's change as one digest: sha256 over its steps' (tier, machine, new declaration's
    digest), in tier then machine order. The same steps, the same digest."""
    text = "".join(f"{tier} {machine} {after}\n" for tier, machine, after in sorted(steps))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


async def step_digest(conn: asyncpg.Connection, plan_id: int) -> str:
    """The digest of a plan's recorded steps (digest_of)."""
    rows = await conn.fetch(
        "SELECT tier, machine, after FROM plan_steps WHERE plan_id = $1", plan_id
    )
    return digest_of((r["tier"], r["machine"], r["after"]) for r in rows)


async def replace_steps(conn: asyncpg.Connection, plan_id: int, steps: list[Step]) -> None:
    """A held plan being approved: its steps as the catalog has them now."""
    await conn.execute("DELETE FROM plan_steps WHERE plan_id = $1", plan_id)
    await _insert_steps(conn, plan_id, steps)


async def approved(
    conn: asyncpg.Connection,
    plan_id: int,
    *,
    settings: PlanSettings,
    undo: dict[str, Any],
    hold: Held,
) -> None:
    """A held plan approved: its change made, it waits its turn; `hold` keeps who approved."""
    await conn.execute(
        "UPDATE plans SET state = 'pending', settings = $2::jsonb, undo = $3::jsonb,"
        " hold = $4::jsonb WHERE id = $1",
        plan_id,
        msgspec.json.encode(settings).decode(),
        json.dumps(undo, sort_keys=True),
        _held_json(hold),
    )


async def steered_of(conn: asyncpg.Connection, module: str) -> list[Plan]:
    """A module's held or paused plans (without their steps), oldest first: what a new change
    of the module supersedes. (A secret's plan names a secret, an undrain's a machine.)"""
    rows = await conn.fetch(
        f"SELECT {_PLAN} FROM plans WHERE subject = $1 AND trigger NOT IN ('secret', 'undrain')"
        " AND state IN ('held', 'paused') ORDER BY id FOR UPDATE",
        module,
    )
    return [_plan(r, []) for r in rows]


async def held_on(conn: asyncpg.Connection, machines: list[str]) -> list[Plan]:
    """The held plans with a step on one of `machines` (without their steps), oldest first,
    their rows locked: what a change of those machines' declarations moves under them."""
    rows = await conn.fetch(
        f"SELECT {_PLAN} FROM plans WHERE state = 'held' AND id IN (SELECT plan_id FROM"
        " plan_steps WHERE machine = ANY($1::text[])) ORDER BY id FOR UPDATE",
        machines,
    )
    return [_plan(r, []) for r in rows]


async def soaking(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    """How many plans are soaking now (the controller's metrics)."""
    return await conn.fetchval(
        "SELECT count(*) FROM plans WHERE soak_until IS NOT NULL AND state = ANY($1::text[])",
        list(CHANGING),
    )
