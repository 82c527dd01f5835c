"""An operator's placement of a machine: its tier and labels (`mesh tier`, `mesh label`, also
of a machine that has not registered yet: its first registration takes them), and its drain.
Each a fenced transaction with its event; memory follows the store, under the lock the fleet's
registrations take.
"""

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import asyncpg

from mesh import wire
from mesh.model import labels_said
from mesh.store import events, machines, seats
from services.controller.fleet.fleet import Fleet
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_LABELS = 64  # as a registration could carry (mesh.model.Labels)


class Placing:
    def __init__(self, *, fleet: Fleet, pool: asyncpg.Pool, epoch: int) -> None:
        self._fleet = fleet
        self._pool = pool
        self._epoch = epoch

    @contextlib.asynccontextmanager
    async def _placing(
        self, name: str
    ) -> AsyncIterator[tuple[asyncpg.Connection, machines.Placement | None]]:
        """A fenced transaction changing machine `name`'s tier or labels, with its placement
        (as stored, or the default) if it has not registered: None if it has (`machines`)."""
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            if name in self._fleet.machines:
                yield conn, None
            else:
                yield conn, await machines.placement(conn, name) or machines.Placement()

    async def set_tier(self, name: str, tier: int, audit: Audit) -> tuple[int, bool]:
        """Move a machine to another tier (plans recorded from now on use it), or place one
        that has not registered yet; the old tier, and whether it is registered."""
        async with self._fleet.changing:
            m = self._fleet.machines.get(name)
            async with self._placing(name) as (conn, placed):
                if placed is not None:
                    was = placed.tier
                    await machines.place(conn, name=name, tier=tier, labels=placed.labels)
                else:
                    was = m.tier
                    await machines.set_tier(conn, name=name, tier=tier)
                await events.record(conn, "machine.tier", machine=name, epoch=self._epoch,
                                    tier=tier, was=was, registered=m is not None)  # fmt: skip
                await audit.write(conn, detail=f"tier {tier} (was {was})")
            if m is not None:
                self._fleet.place(name, was=m.tier, tier=tier)
                m.tier = tier
        log.info("machine %s moved from tier %d to tier %d%s", name, was, tier,
                 "" if m is not None else " (for its first registration)")  # fmt: skip
        return was, m is not None

    async def set_labels(
        self, name: str, *, add: dict[str, str], remove: list[str], audit: Audit
    ) -> tuple[dict[str, str], dict[str, str], bool]:
        """Set and remove labels of a machine, or of one that has not registered yet (its first
        registration takes them); (labels, the labels it had, whether it is registered)."""
        both = sorted(set(add) & set(remove))
        if both:
            raise wire.BadRequest(f"label {both[0]}: both set and removed")
        async with self._fleet.changing:
            m = self._fleet.machines.get(name)
            async with self._placing(name) as (conn, placed):
                was = dict((placed or m).labels)  # type: ignore[union-attr]  # one of the two
                labels = {k: v for k, v in {**was, **add}.items() if k not in remove}
                if len(labels) > MAX_LABELS:
                    raise wire.BadRequest(
                        f"labels: machine {name} would carry {len(labels)} labels, "
                        f"at most {MAX_LABELS}"
                    )
                if placed is not None:
                    await machines.place(conn, name=name, tier=placed.tier, labels=labels)
                else:
                    await machines.set_labels(conn, name=name, labels=labels)
                await events.record(conn, "machine.labels", machine=name, epoch=self._epoch,
                                    labels=labels, was=was, registered=m is not None)  # fmt: skip
                await audit.write(
                    conn, detail=f"labels {labels_said(labels)} (were {labels_said(was)})"[:200]
                )
            if m is not None:
                m.labels = labels
                self._fleet.relabelled(name, was, labels)
        log.info("machine %s labels %s (were %s)%s", name, labels, was,
                 "" if m is not None else " for its first registration")  # fmt: skip
        return labels, was, m is not None

    async def set_drained(
        self,
        name: str,
        *,
        drained: bool,
        by: str,
        then: Callable[[asyncpg.Connection], Awaitable[T]],
    ) -> tuple[bool, T]:
        """Drain a machine (or undrain it) in one fenced transaction with its event and `then`
        (the plan that brings an undrained machine up to date); whether it was drained before,
        and what `then` gave. Memory follows the store, under the lock registrations take: a
        registration written meanwhile carries the flag as the store has it."""
        async with self._fleet.changing:
            m = self._fleet.machines.get(name)
            if m is None:
                raise wire.BadRequest(f"machine {name} is not registered", code="not_found")
            was = m.drained
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                await machines.set_drained(conn, name=name, drained=drained)
                await events.record(conn, "machine.drained" if drained else "machine.undrained",
                                    machine=name, epoch=self._epoch, by=by, was=was)  # fmt: skip
                then_gave = await then(conn)
            m.drained = drained
        log.info("machine %s %s%s", name, "drained" if drained else "undrained",
                 "" if was != drained else " (it already was)")  # fmt: skip
        return was, then_gave
