"""A machine's registration with the holder: written in batches with the others that came
meanwhile (a takeover's storm of ten thousand is a handful of transactions), answered from
memory when it says again what was written, and bounded per machine (REGISTER_BURST): a host
that registers in a loop costs a few rows and one log line a window, not one of each per message.
"""

import logging
import time
from collections.abc import Callable

import anyio
import asyncpg

from mesh import wire
from mesh.batching import Batches
from mesh.model import Register
from mesh.ratelimit import PerKey
from mesh.store import db, events, machines
from mesh.store.machines import MachineRow
from services.controller.fleet.fleet import CHECK_EVERY, REGISTER_BATCH, TRANSITIONS_LOGGED, Fleet

log = logging.getLogger(__name__)

# What one machine can make the holder write and log (mesh/ratelimit.py). A host registers at
# its start and once per new holder; one registering in a loop (a crash loop, or a compromised
# machine: 5,000 registrations were 5,000 rows and log lines) has REGISTER_BURST written at
# once, then one each REGISTER_EVERY seconds. The rest are answered from memory, the newest
# written when its turn comes, and counted in one line per window.
REGISTER_BURST = 3
REGISTER_EVERY = 10.0


class Registrations:
    def __init__(
        self, *, fleet: Fleet, pool: asyncpg.Pool, epoch: int,
        open_bus: Callable[[], bool] = lambda: False,
    ) -> None:  # fmt: skip
        self._fleet = fleet
        self._pool = pool
        self._epoch = epoch
        self._open_bus = open_bus  # asked at each registration: a server reload may add auth
        self._registered: dict[str, Register] = {}  # machine -> its last registration written
        self._registering = PerKey[str](burst=REGISTER_BURST, every=REGISTER_EVERY)
        self._held_back: dict[str, Register] = {}  # machine -> its newest registration not written
        self._late: set[str] = set()  # held-back registrations being written: said in the count
        self._claims_logged: set[str] = set()  # machines whose own tier/labels were not taken
        self._registrations: Batches[str, Register, MachineRow] = Batches(
            key=lambda req: req.name, write=self._register_batch, most=REGISTER_BATCH,
            stopped=lambda: wire.BadRequest(
                "the controller stopped holding the seat; try again", code="unavailable"
            ),
        )  # fmt: skip

    async def run(self) -> None:
        """Write registrations in batches, and the held-back ones as their turns come, until
        cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._registrations.run)
            while True:
                await anyio.sleep(CHECK_EVERY)
                self.write_held_back()
                self.say_held_back()

    async def register(self, req: Register) -> MachineRow:
        """Register a machine: written with the others that came meanwhile, in one batch. The
        same registration again, while the machine is up, is answered from memory: a host
        asking again because our answer came after its window (a cold start of ten thousand)
        would otherwise be written again, and again, each retry more work than the last. A
        known machine past its allowance (REGISTER_BURST) is answered from memory too, and its
        newest registration is written when its turn comes (`write_held_back`)."""
        if self._registered.get(req.name) == req and req.name in self._fleet.up_names:
            self._fleet.beat_at[req.name] = time.monotonic()  # registering is a sign of life
            return self._fleet.machines[req.name]
        known = self._fleet.machines.get(req.name)
        if known is not None and not self._registering.allows(req.name):
            self._held_back[req.name] = req
            self._registering.hold(req.name)
            self._fleet.beat_at[req.name] = time.monotonic()
            return known  # its tier and labels are the operator's: the answer is the same
        self._held_back.pop(req.name, None)  # this one is newer
        return await self._registrations.submit(req)

    def write_held_back(self) -> None:
        """Held-back registrations whose machine has its turn again, into the next batch
        (whose writer says its own failures: nobody waits for these)."""
        for name in [n for n in self._held_back if self._registering.allows(n)]:
            req = self._held_back.pop(name)
            if self._registrations.put(req) is None:
                return  # no longer writing: the seat's next holder hears from the host
            self._late.add(name)

    async def _register_batch(self, reqs: list[Register]) -> dict[str, MachineRow]:
        async with self._fleet.changing:
            try:
                return await self._write_registrations(reqs)
            except (*db.GONE, asyncpg.PostgresError) as e:
                # Said once for the batch; every host of it hears `unavailable` and asks again
                # after its pause (services/host/registration.py).
                log.warning("could not write %d registration(s); they will be asked again: "
                            "%s: %s", len(reqs), type(e).__name__, e)  # fmt: skip
                raise wire.BadRequest(
                    f"the store did not take the registration ({type(e).__name__}); try again",
                    code="unavailable",
                ) from None

    async def _write_registrations(self, reqs: list[Register]) -> dict[str, MachineRow]:
        trusted = self._open_bus()
        was = {req.name: self._fleet.machines.get(req.name) for req in reqs}
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await machines.register_many(
                conn,
                [
                    machines.Registration(
                        name=req.name, facts=req.facts, beat_interval=req.beat_interval,
                        version=req.version, claimed_tier=req.tier if trusted else None,
                        claimed_labels=req.labels if trusted else None,
                    )
                    for req in reqs
                ],
            )  # fmt: skip
            by_name = {row.name: row for row in rows}
            recorded: list[tuple[str, str | None, int | None, dict[str, object]]] = []
            for req in reqs:
                recorded.append(("machine.registered", req.name, self._epoch,
                                 {"tier": by_name[req.name].tier}))  # fmt: skip
                before = was[req.name]
                if before is not None and not before.up:
                    recorded.append(("machine.up", req.name, self._epoch, {}))
            await events.record_many(conn, recorded)
        now = time.monotonic()
        again, new = 0, 0
        for req in reqs:
            self._registering.spend(req.name)  # what was written counts, whoever asked for it
            row, before = by_name[req.name], was[req.name]
            self._fleet.machines[req.name] = row
            self._fleet.place(
                req.name, was=before.tier if before is not None else None, tier=row.tier
            )
            if req.applied:  # what it had when it asked: an applied event heard meanwhile is newer
                self._fleet.applied.setdefault(req.name, req.applied)
            self._fleet.touch(req.name)
            self._fleet.up_names.add(req.name)  # registering is a sign of life
            self._fleet.beat_at[req.name] = now
            self._fleet.unknown_logged.discard(req.name)
            self._registered[req.name] = req
            if before is None:
                self._fleet.relabelled(req.name, None, row.labels)
            if req.name in self._late:
                self._late.discard(req.name)  # said in its window's count (`say_held_back`)
            elif before is not None and before.up and before.tier == row.tier:
                again += 1  # a known machine saying hello to a new holder: counted, not logged
            else:
                new += 1  # named up to TRANSITIONS_LOGGED a batch: a cold start of thousands
                if new <= TRANSITIONS_LOGGED:
                    log.info("machine %s registered (tier %d, pid %d)", req.name, row.tier,
                             req.pid)  # fmt: skip
            self._log_claims(req, row)
        if new > TRANSITIONS_LOGGED:
            log.info("... and %d more machine(s) registered", new - TRANSITIONS_LOGGED)
        if again:
            log.info("%d machine(s) registered again%s", again,
                     f" (in a batch of {len(reqs)})" if len(reqs) > again else "")  # fmt: skip
        return by_name

    def _log_claims(self, req: Register, row: MachineRow) -> None:
        ignored = req.tier not in (None, row.tier) or (
            bool(req.labels) and req.labels != row.labels
        )
        if ignored and req.name not in self._claims_logged:
            self._claims_logged.add(req.name)
            log.info(
                "machine %s asked for tier %s and labels %s: it keeps tier %d and labels %s "
                "(the operator's: mesh tier, mesh label)",
                req.name, req.tier, req.labels, row.tier, row.labels,
            )  # fmt: skip

    def say_held_back(self) -> None:
        """Once per window, the machines held back in it: one line for each of the first few,
        with how many of its registrations were answered from memory; one for the rest."""
        registered = self._registering.held()
        if registered:
            named = sorted(registered.items(), key=lambda kv: -kv[1])
            for name, n in named[:TRANSITIONS_LOGGED]:
                log.warning(
                    "machine %s: %d registration(s) in the last %gs answered from memory, "
                    "not written (a machine's are written %d at once, then one each %gs, its "
                    "newest in turn): a host restarting in a loop, or one not behaving as a host",
                    name, n, REGISTER_EVERY, REGISTER_BURST, REGISTER_EVERY,
                )  # fmt: skip
            if len(named) > TRANSITIONS_LOGGED:
                log.warning("... and %d more machine(s) (%d registrations) held back likewise",
                            len(named) - TRANSITIONS_LOGGED,
                            sum(n for _, n in named[TRANSITIONS_LOGGED:]))  # fmt: skip
