"""The holder's changes to the catalog: push, assign, unassign, setting a secret, a rollback to
an earlier version, and draining a machine out of the plans (and undraining it).

Each change runs in one transaction that checks the seat's epoch, records the change,
recomposes the affected machines' declarations (a conflict rolls everything back and names both
modules) and records a plan with one step per machine whose declaration changes. The planner
(`planner.py`) rolls the plan out tier by tier; it stores and publishes each declaration
(`publishing.py`) when the machine's turn comes. One change at a time.

A push whose bundles must be built records its plan as `building` first and builds outside the
one-change lock (a build may take minutes; assign, unassign and secrets do not wait for it);
then, under the lock, it registers the version with the built digests and composes as the
catalog is then, and the plan gets its steps and waits its turn (`pending`). Pushes of one
module wait for each other, so they register in the order they came.

The steps of a push before anything is stored (reading its source, packing its bundles,
registering its version) are `pushing.py`'s: the dry run (`views.py`, `diff`) takes them too.
"""

import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from mesh import blobs, wire
from mesh.auth.signing import Signing
from mesh.model import (
    CHANGED_LISTED,
    AssignRequest,
    ChangeReply,
    DrainReply,
    DrainRequest,
    MachineChanged,
    PlanBuild,
    PlanSettings,
    PlanState,
    PushRequest,
    RollbackRequest,
    RotateKeyReply,
    RotateKeyRequest,
    SecretSetRequest,
    SteerReply,
    SteerRequest,
)
from mesh.modules import gate
from mesh.modules.manifest import Manifest
from mesh.store import events, modules, plans, seats, secrets
from services.controller import build_requests, operators, scoping, secretkeys, steering
from services.controller import rollback as versions
from services.controller.fleet import Fleet, tell_changed
from services.controller.publishing import Manifests, Publisher
from services.controller.pushing import (
    ToBuild,
    pack_bundles,
    read_source,
    register,
    settings_of,
)
from services.controller.secretkeys import Keys

log = logging.getLogger(__name__)

NAMED = 5  # machines a change's message (and log line) names; the rest are counted


def named(machines: list[str]) -> str:
    """Machines in a message: a few by name, the rest as a number (thousands of names would
    make a message, and a log line, the size of the fleet)."""
    if len(machines) <= NAMED:
        return ", ".join(machines)
    return f"{', '.join(machines[:NAMED])} and {len(machines) - NAMED} more"


def replied(
    *,
    plan: int | None,
    changed: list[str],
    message: str,
    version: str | None = None,
    state: PlanState | None = None,
) -> ChangeReply:
    """A change's reply, bounded whatever the fleet's size: the first CHANGED_LISTED machines
    whose declarations change, and how many there are (the plan's steps list every one)."""
    return ChangeReply(plan=plan, machines=changed[:CHANGED_LISTED], message=message,
                       version=version, changed=len(changed), state=state)  # fmt: skip


class _PushesOf:
    """One lock per module, held by a push from its first look at the catalog to its
    registration; forgotten when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[anyio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def __call__(self, module: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(module, (anyio.Lock(), 0))
        self._locks[module] = (lock, users + 1)
        try:
            if lock.locked():
                log.info("a push of %s waits for an earlier push of %s", module, module)
            async with lock:
                yield
        finally:
            lock, users = self._locks[module]
            if users == 1:
                del self._locks[module]
            else:
                self._locks[module] = (lock, users - 1)


class Changes:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        nc: Client,
        obs: ObjectStore,
        fleet: Fleet,
        epoch: int,
        manifests: Manifests,
        publisher: Publisher,
        signing: Signing,
        keys: Keys,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._signing = signing  # builds are requested signed (mesh.auth.signing)
        self._keys = keys  # the key the secrets are sealed under (secretkeys.py)
        self._wake = wake  # tells the planner a plan was recorded
        self._pool = pool
        self._nc = nc
        self._obs = obs
        self._fleet = fleet
        self._epoch = epoch
        self._manifests = manifests
        self._publisher = publisher  # composes the machines' declarations
        self._one_change = anyio.Lock()
        self._pushes_of = _PushesOf()

    async def _steps(self, conn: asyncpg.Connection, machines: Iterable[str]) -> list[plans.Step]:
        """A step for each machine whose composition differs from what it will have once the
        plans before it finish."""
        composed = await self._publisher.compose(conn, machines)
        expected = await plans.expected(conn, sorted(composed))
        return [
            plans.Step(
                machine=m, tier=self._fleet.machines[m].tier, state="pending", after=d, after_body=b
            )
            for m, (d, b) in composed.items()
            if expected.get(m) != d
        ]

    @property
    def one_change(self) -> anyio.Lock:
        """Held by each change while it records (steering.py takes it to cancel; the holder
        pruning bundles takes it so none goes between a rollback's check and its plan)."""
        return self._one_change

    async def _plan(
        self, conn: asyncpg.Connection, machines: Iterable[str], **how: Any
    ) -> tuple[int | None, list[str]]:
        """`_recorded`, and the change's audit entry in the same transaction (operators.py):
        every change the catalog makes records its plan here, or that it has none."""
        plan, changed = await self._recorded(conn, machines, **how)
        await operators.audited(
            conn,
            detail=f"plan {plan}"
            if plan is not None
            else "no plan: no machine's declaration changes",
        )
        return plan, changed

    async def _recorded(
        self,
        conn: asyncpg.Connection,
        machines: Iterable[str],
        *,
        trigger: str,
        subject: str,
        by: str,
        settings: PlanSettings,
        undo: dict[str, Any],
        builds: list[PlanBuild] | None = None,
        building: int | None = None,
        hold: dict[str, Any] | None = None,
        steps: list[plans.Step] | None = None,
    ) -> tuple[int | None, list[str]]:
        """Record a plan for the machines whose composition differs from what they will have
        once the plans before it finish; (None, []) when there are none. `building`: the
        push's plan recorded while it built, which gets these steps (or goes, if none). With
        `hold` (the change its approval makes), the plan is `held`, with the `steps` a dry
        run of the change found, even none (changes.py: held changes)."""
        if steps is None:
            steps = await self._steps(conn, machines)
        kept = hold is not None  # a held change is recorded whatever it changes
        if building is not None:
            if not steps and not kept:
                await plans.drop_building(conn, building)
                return None, []
            if not await plans.built(
                conn, building, settings=settings, builds=builds or [], undo=undo, steps=steps,
                hold=hold,
            ):  # fmt: skip
                raise await _stopped_building(conn, building)
            return building, [s.machine for s in steps]
        if not steps and not kept:
            return None, []
        plan_id = await plans.create(
            conn, trigger=trigger, subject=subject, by=by, epoch=self._epoch, settings=settings,
            builds=builds or [], undo=undo, steps=steps, state="held" if kept else "pending",
            hold=hold,
        )  # fmt: skip
        return plan_id, [s.machine for s in steps]

    def _select(
        self, *, machines: list[str], tier: int | None, labels: dict[str, str]
    ) -> list[str]:
        """Machines by name, plus every machine that matches all the given selectors."""
        for name in machines:
            if name not in self._fleet.machines:
                raise wire.BadRequest(f"machine {name} is not registered", code="not_found")
        chosen = set(machines)
        if tier is not None or labels:
            chosen |= {
                m.name
                for m in self._fleet.machines.values()
                if (tier is None or m.tier == tier)
                and all(m.labels.get(k) == v for k, v in labels.items())
            }
        return sorted(chosen)

    # --- a push ----------------------------------------------------------------------------

    async def _build(self, module: str, todo: list[ToBuild]) -> dict[str, str]:
        """Run the builds on a builder host: bundle name -> the built bundle's digest."""
        digests: dict[str, str] = {}
        for b in todo:
            digests[b.name] = await build_requests.build(
                nc=self._nc, signing=self._signing, pool=self._pool, obs=self._obs,
                fleet=self._fleet, key=b.key,
                module=module, name=b.name, bundle=b.bundle, source=b.source,
            )  # fmt: skip
        return digests

    async def _building(
        self, manifest: Manifest, req: PushRequest, bundles: dict[str, str], todo: list[ToBuild]
    ) -> int:
        """Record the push's plan as `building` (no steps yet: they are composed once the
        builds are done), so `mesh plan` shows what the push is doing."""
        building = {b.name for b in todo}
        async with self._pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self._epoch)
            return await plans.create(
                conn, trigger="push", subject=manifest.module.name, by=req.by,
                epoch=self._epoch, settings=settings_of(manifest),
                builds=[PlanBuild(bundle=b, digest=d, built=b in building)
                        for b, d in sorted(bundles.items())],
                undo={"module": manifest.module.name}, steps=[], state="building",
            )  # fmt: skip

    async def _not_built(self, plan_id: int, e: BaseException) -> None:
        """A building plan whose builds failed (or whose push was cut off) ends `failed`."""
        why = str(e).splitlines()[0] if isinstance(e, wire.BadRequest) else (
            f"the push stopped while building ({type(e).__name__})"
        )  # fmt: skip
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                await plans.fail_building(conn, why, plan_id=plan_id)
        except Exception as failed:  # the next holder fails it at takeover
            log.warning("could not record that plan %d failed to build: %s", plan_id, failed)

    async def _record_push(
        self,
        manifest: Manifest,
        req: PushRequest,
        bundles: dict[str, str],
        *,
        built: set[str],
        building: int | None,
    ) -> tuple[int | None, list[str]] | None:
        """Register the version with its bundles' digests and record its plan, under the
        one-change lock; None if the version is already the current one."""
        name = manifest.module.name
        async with self._one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                if building is not None and not await _still_building(conn, building):
                    raise await _stopped_building(conn, building)  # cancelled, or failed
                # Read again: a revert may have moved the module while it built. The machines
                # are composed now, from the catalog as it is, with what was built.
                current = (await modules.current_modules(conn)).get(name)
                if current is not None and current.version == req.source:
                    if building is not None:
                        await plans.drop_building(conn, building)
                    return None
                old = await self._supersede(conn, name, by=req.by)
                current = (await modules.current_modules(conn)).get(name)  # a paused one undone
                builds = [PlanBuild(bundle=b, digest=d, built=b in built)
                          for b, d in sorted(bundles.items())]  # fmt: skip
                if req.hold:
                    recorded = await self._hold_push(
                        conn, manifest, req, bundles, builds=builds, building=building
                    )
                else:
                    targets = await register(
                        conn, fleet=self._fleet, manifest=manifest, text=req.manifest,
                        version=req.source, bundles=bundles, by=req.by,
                    )  # fmt: skip
                    now = (await modules.current_modules(conn))[name]
                    recorded = await self._plan(
                        conn, targets, trigger="push", subject=name, by=req.by,
                        settings=settings_of(manifest),
                        undo={"module": name, "from": current.id if current else None,
                              "to": now.id},
                        builds=builds, building=building,
                    )  # fmt: skip
                await self._superseded(conn, old, plan=recorded[0], what=f"a push of {name}")
                return recorded

    async def _restore(
        self, manifest: Manifest, req: PushRequest, data: bytes, current: modules.StoredVersion
    ) -> ChangeReply | None:
        """The current version pushed again, with bundles of it missing from the bundle store
        (lost with JetStream's data, or purged): stored again from the source, built again
        where they were built. A build that gives other bytes than before changes the
        version's bundles, and its machines get them in a plan. None: nothing was missing."""
        name = manifest.module.name
        missing = [
            b for b, d in sorted(current.bundles.items())
            if d.startswith("sha256:") and not await blobs.has(self._obs, d)
        ]  # fmt: skip
        if not missing:
            return None
        bundles, todo = await pack_bundles(
            pool=self._pool, obs=self._obs, manifest=manifest, data=data, dry=False
        )
        # What is still stored stays as it is; only what is missing is stored or built again.
        bundles |= {b: d for b, d in current.bundles.items() if b not in missing}
        bundles |= await self._build(name, [b for b in todo if b.name in missing])
        log.info("push of %s %s: restored %s missing from the bundle store", name,
                 req.source[:19], named(missing))  # fmt: skip
        what = f"{name} {req.source[:19]}: restored {len(missing)} bundle(s) ({named(missing)})"
        changed = {b: d for b, d in bundles.items() if current.bundles.get(b) != d}
        if not changed:
            return replied(plan=None, changed=[], message=f"{what}; no machine changes",
                           version=req.source)  # fmt: skip
        async with self._one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                await modules.rebundle(conn, version_id=current.id, bundles=bundles)
                targets = sorted(m for m, mods in (await modules.assignments(conn)).items()
                                 if name in mods)  # fmt: skip
                plan, machines = await self._plan(
                    conn, targets, trigger="push", subject=name, by=req.by,
                    settings=settings_of(manifest),
                    undo={"module": name, "from": current.id, "to": current.id},
                    builds=[PlanBuild(bundle=b, digest=d, built=b in changed)
                            for b, d in sorted(bundles.items())],
                )  # fmt: skip
        self._wake()
        return replied(plan=plan, changed=machines, version=req.source,
                       message=f"{what}, built again as other bytes; plan {plan} changes "
                       f"{len(machines)} machine(s)")  # fmt: skip

    # --- verbs -----------------------------------------------------------------------------

    async def push(self, req: PushRequest) -> ChangeReply:
        manifest, data = await read_source(
            nc=self._nc, manifest_text=req.manifest, source=req.source, upload=req.upload
        )
        name = manifest.module.name
        async with self._pool.acquire() as conn:
            await scoping.check_push(conn, manifests=self._manifests, manifest=manifest,
                                     by=req.by)  # fmt: skip
        if req.upload is not None:  # the archive kept with its bundles, as a client once put it
            await blobs.put(self._obs, data)
            await blobs.unstage(self._nc, req.upload, bucket=blobs.UPLOADS)
        unchanged = replied(plan=None, changed=[], message="no change", version=req.source)
        # Pushes of this module in the order they came (a later one never registers before an
        # earlier one that is still building); other changes do not wait for the builds.
        async with self._pushes_of(name):
            async with self._pool.acquire() as conn:
                current = (await modules.current_modules(conn)).get(name)
            if current is not None and current.version == req.source:
                return await self._restore(manifest, req, data, current) or unchanged
            bundles, todo = await pack_bundles(
                pool=self._pool, obs=self._obs, manifest=manifest, data=data, dry=False
            )
            if todo:
                build_requests.builder(self._fleet)  # none up: refused before any plan is recorded
            building = await self._building(manifest, req, bundles, todo) if todo else None
            try:
                bundles |= await self._build(name, todo)
                recorded = await self._record_push(
                    manifest, req, bundles, built={b.name for b in todo}, building=building
                )
            except BaseException as e:  # a failed build, a conflict, the push cut off
                if building is not None:
                    with anyio.CancelScope(shield=True):
                        await self._not_built(building, e)
                raise
        if recorded is None:
            return unchanged
        plan, changed = recorded
        self._wake()
        log.info("pushed %s %s: plan %s for %d machine(s)%s", name, req.source[:19], plan,
                 len(changed), " (held)" if req.hold else "")  # fmt: skip
        if req.hold:
            return replied(plan=plan, changed=changed, version=req.source, state="held",
                           message=f"{name} {req.source[:19]}: {_held(plan, changed)}")  # fmt: skip
        message = (
            f"{name} {req.source[:19]}: plan {plan} changes {len(changed)} machine(s)"
            if changed
            else f"{name} {req.source[:19]} registered; no machine's declaration changes"
        )
        return replied(plan=plan, changed=changed, message=message, version=req.source)

    async def assign(self, req: AssignRequest, *, undo: bool = False) -> ChangeReply:
        trigger = "unassign" if undo else "assign"
        async with self._one_change:
            machines = self._select(machines=req.machines, tier=req.tier, labels=req.labels)
            if not machines:
                raise wire.BadRequest("no machine matches", code="not_found")
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                old = await self._supersede(conn, req.module, by=req.by)
                current = (await modules.current_modules(conn)).get(req.module)
                if current is None:
                    raise wire.BadRequest(
                        f"module {req.module} has not been pushed", code="not_found"
                    )
                settings = settings_of(self._manifests.of(current))
                if req.hold:
                    plan, changed = await self._hold_assign(
                        conn, req, machines, trigger=trigger, settings=settings
                    )
                else:
                    moved = await self._reassign(conn, req.module, machines, undo=undo)
                    plan, changed = await self._plan(
                        conn, machines, trigger=trigger, subject=req.module, by=req.by,
                        settings=settings, undo={"module": req.module, "machines": moved},
                    )  # fmt: skip
                await self._superseded(conn, old, plan=plan, what=f"an {trigger} of {req.module}")
        self._wake()
        verb = "unassigned from" if undo else "assigned to"
        log.info("%s %s %s: plan %s%s", req.module, verb, named(machines), plan,
                 " (held)" if req.hold else "")  # fmt: skip
        if req.hold:
            return replied(plan=plan, changed=changed, state="held",
                           message=f"{req.module} to be {verb} {named(machines)}: "
                           + _held(plan, changed))  # fmt: skip
        return replied(
            plan=plan,
            changed=changed,
            message=f"{req.module} {verb} {named(machines)}; "
            + (f"plan {plan} changes {len(changed)} machine(s)" if changed else "no change"),
        )

    async def _reassign(
        self, conn: asyncpg.Connection, module: str, machines: list[str], *, undo: bool
    ) -> list[str]:
        """Assign (or, `undo`, unassign) the module on these machines; those it moved."""
        had = {m for m, mods in (await modules.assignments(conn)).items() if module in mods}
        moved = sorted(set(machines) & had) if undo else sorted(set(machines) - had)
        change = modules.unassign if undo else modules.assign
        await change(conn, module=module, machines=machines)
        return moved

    # --- held changes, their approval, and superseding (see the section at the end) ---------

    async def _hold_push(
        self,
        conn: asyncpg.Connection,
        manifest: Manifest,
        req: PushRequest,
        bundles: dict[str, str],
        *,
        builds: list[PlanBuild],
        building: int | None,
    ) -> tuple[int | None, list[str]]:
        """A held push: the version stored (not current) and its plan `held`."""
        name = manifest.module.name
        async with _tried(conn):
            targets = await register(
                conn, fleet=self._fleet, manifest=manifest, text=req.manifest,
                version=req.source, bundles=bundles, by=req.by,
            )  # fmt: skip
            steps = await self._steps(conn, targets)
        version = await modules.keep_version(
            conn, module=name, version=req.source, manifest=req.manifest, bundles=bundles,
            by=req.by,
        )  # fmt: skip
        recorded = await self._plan(
            conn, targets, trigger="push", subject=name, by=req.by,
            settings=settings_of(manifest), undo={"module": name}, builds=builds,
            building=building, hold={"module": name, "version": version}, steps=steps,
        )  # fmt: skip
        await events.record(conn, "plan.held", epoch=self._epoch, plan=recorded[0], by=req.by)
        return recorded

    async def _hold_assign(
        self,
        conn: asyncpg.Connection,
        req: AssignRequest,
        machines: list[str],
        *,
        trigger: str,
        settings: PlanSettings,
    ) -> tuple[int | None, list[str]]:
        """A held assign or unassign: its plan `held`, the machines kept for its approval."""
        async with _tried(conn):
            await self._reassign(conn, req.module, machines, undo=trigger == "unassign")
            steps = await self._steps(conn, machines)
        recorded = await self._plan(
            conn, machines, trigger=trigger, subject=req.module, by=req.by, settings=settings,
            undo={"module": req.module}, hold={"module": req.module, "machines": machines},
            steps=steps,
        )  # fmt: skip
        await events.record(conn, "plan.held", epoch=self._epoch, plan=recorded[0], by=req.by)
        return recorded

    async def approve(self, req: SteerRequest) -> SteerReply:
        """Make a held plan's change and put it in the queue (`pending`); with no machine to
        change by now, it ends `done`. A conflict the catalog has come to since refuses the
        approval (the plan stays held)."""
        async with self._one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                p = steering.found(await plans.locked(conn, req.id), req.id)
                if p.state != "held" or p.hold is None:
                    raise steering.refused(p, steering.why_not_approved(p))
                targets, undo, settings = await self._make(conn, p)
                steps = await self._steps(conn, targets)
                await plans.replace_steps(conn, p.id, steps)
                hold = {**p.hold, "approved_by": req.by}
                await plans.approved(conn, p.id, settings=settings, undo=undo, hold=hold)
                state: PlanState = "pending"
                if not steps:
                    state = "done"
                    await plans.set_plan(conn, p.id, state=state, finished=datetime.now(UTC))
                await events.record(conn, "plan.approved", epoch=self._epoch, plan=p.id,
                                    by=req.by, machines=len(steps))  # fmt: skip
                await operators.audited(conn, detail=f"plan {p.id} {state}")
        self._wake()
        log.info("plan %d approved by %s: %d machine(s)", p.id, req.by or "?", len(steps))
        what = f"it changes {len(steps)} machine(s)" if steps else "no machine changes now"
        return SteerReply(plan=p.id, state=state, message=f"plan {p.id} approved: {what}")

    async def _make(
        self, conn: asyncpg.Connection, p: plans.Plan
    ) -> tuple[list[str], dict[str, Any], PlanSettings]:
        """A held plan's change, made in the catalog: its machines, its undo, its settings."""
        assert p.hold is not None
        module = p.hold["module"]
        current = (await modules.current_modules(conn)).get(module)
        if p.trigger == "push":
            v = await modules.version_of(conn, p.hold["version"])
            manifest = gate.parse(v.manifest)
            targets = await register(
                conn, fleet=self._fleet, manifest=manifest, text=v.manifest, version=v.version,
                bundles=v.bundles, by=v.pushed_by,
            )  # fmt: skip
            now = (await modules.current_modules(conn))[module]
            undo = {"module": module, "from": current.id if current else None, "to": now.id}
            if current is not None and current.id == now.id:
                undo["to"] = None  # it was current already: nothing to take back
            return targets, undo, settings_of(manifest)
        if current is None:
            raise wire.BadRequest(
                f"module {module} is no longer registered: plan {p.id} cannot be approved "
                f"(cancel it: mesh plan cancel {p.id})", code="conflict",
            )  # fmt: skip
        machines = [m for m in p.hold["machines"] if m in self._fleet.machines]
        moved = await self._reassign(conn, module, machines, undo=p.trigger == "unassign")
        undo = {"module": module, "machines": moved}
        return machines, undo, settings_of(self._manifests.of(current))

    async def _supersede(self, conn: asyncpg.Connection, module: str, *, by: str) -> list[int]:
        """Cancel the module's held and paused plans: a newer change of the module supersedes
        them (a paused one's changed machines get their old declarations back first, its
        catalog change is taken back at once). Their ids; `_superseded` names the newer plan."""
        old = await plans.steered_of(conn, module)
        for p in old:
            why = f"superseded by a newer change of module {module}"
            await steering.cancelled(conn, p, why=why, epoch=self._epoch, by=by)
            log.info("plan %d (%s %s, %s) superseded", p.id, p.trigger, module, p.state)
        return [p.id for p in old]

    async def _superseded(
        self, conn: asyncpg.Connection, old: list[int], *, plan: int | None, what: str
    ) -> None:
        for plan_id in old:
            why = f"superseded by {f'plan {plan}' if plan else f'{what}, which changed no machine'}"
            await plans.set_plan(conn, plan_id, cancel=why)
            await events.record(conn, "plan.superseded", epoch=self._epoch, plan=plan_id,
                                by_plan=plan)  # fmt: skip

    async def secret_set(self, req: SecretSetRequest) -> ChangeReply:
        try:
            value = base64.b64decode(req.value, validate=True)
        except ValueError:  # binascii.Error, or text that is not ASCII
            raise wire.BadRequest("value: not base64") from None
        if req.name == secrets.KEY_SECRET:
            raise wire.BadRequest(
                f"name: {req.name} is the key of the secrets, never stored: it is the "
                "controllers' key file (mesh secret rotate-key makes a new one)"
            )
        ring = self._keys.usable()
        async with self._one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                version = await secrets.set_secret(conn, name=req.name, value=value, ring=ring,
                                                   by=req.by, modules=req.modules)  # fmt: skip
                # A secret's old value is not kept, so there is nothing to revert to.
                plan, changed = await self._plan(
                    conn, await modules.assignments(conn), trigger="secret", subject=req.name,
                    by=req.by, settings=PlanSettings(auto_revert=False), undo={},
                )  # fmt: skip
        self._wake()
        log.info("secret %s set (version %d): plan %s", req.name, version, plan)
        return replied(
            plan=plan,
            changed=changed,
            message=f"secret {req.name} is at version {version}; "
            + (
                f"plan {plan} changes {len(changed)} machine(s)"
                if changed
                else "no machine's declaration changes"
            ),
        )

    # --- going back to a version; machines out of the plans and back ---------------------------

    async def rollback(self, req: RollbackRequest) -> ChangeReply:
        """The module back at an earlier version (rollback.py) through an ordinary plan of
        its machines: the catalog names that version again, each machine is composed with it,
        and the plan rolls tier by tier (and reverts) as a push's does. Nothing is built: the
        version's bundles must still be stored (bundles.py keeps the newest versions'). A
        rollback is a newer change of the module: it supersedes the module's held and paused
        plans (a paused push taken back may already bring the machines to that version)."""
        name = req.module
        async with self._pushes_of(name):  # after a push of the module still building
            async with self._pool.acquire() as conn:
                rows = await modules.history(conn, name)
            target = versions.pick(rows, module=name, to=req.to)
            current = versions.current(rows, module=name)
            what = f"{name} version {target.number} ({target.digest[:19]})"
            async with self._one_change:
                if target.id != current.id:
                    await self._still_stored(name, target)
                async with self._pool.acquire() as conn, conn.transaction():
                    await seats.fence(conn, epoch=self._epoch)
                    now = (await modules.current_modules(conn)).get(name)
                    if now is None or now.id != current.id:  # a revert moved it meanwhile
                        raise wire.BadRequest(
                            f"module {name} changed version meanwhile: ask again", code="conflict"
                        )
                    old = await self._supersede(conn, name, by=req.by)
                    plan, changed = await self._roll_back(conn, req, target, current)
                    await self._superseded(conn, old, plan=plan, what=f"a rollback of {name}")
        if plan is None and not old:
            return replied(plan=None, changed=[], version=target.digest,
                           message=f"{what} is the current version: no change")  # fmt: skip
        self._wake()
        log.info("%s: back from version %d: plan %s for %d machine(s)%s", what, current.number,
                 plan, len(changed), f", superseding plan(s) {old}" if old else "")  # fmt: skip
        gone = f"; superseded {_plans(old)}" if old else ""
        if plan is None:  # the superseded plans' own cancel brings the machines back
            return replied(plan=None, changed=[], version=target.digest,
                           message=f"{what} is the current version again{gone}")  # fmt: skip
        return replied(
            plan=plan, changed=changed, version=target.digest,
            message=f"{what}, back from version {current.number}: "
            + (f"plan {plan} changes {len(changed)} machine(s)" if changed
               else "no machine's declaration changes") + gone,
        )  # fmt: skip

    async def _roll_back(
        self,
        conn: asyncpg.Connection,
        req: RollbackRequest,
        target: modules.HistoryRow,
        was: modules.HistoryRow,
    ) -> tuple[int | None, list[str]]:
        """The catalog at `target` and the plan of the module's machines (no plan when the
        module is at `target` already, after its held and paused plans were superseded)."""
        name = req.module
        now = (await modules.current_modules(conn)).get(name)
        if now is None:  # its first push was paused, and is cancelled now: nothing ran before
            raise wire.BadRequest(
                f"module {name} has no version to go back to once its paused first push is "
                "cancelled: cancel that plan instead (mesh plan cancel)", code="conflict",
            )  # fmt: skip
        if now.id == target.id:
            return None, []
        stored = await modules.stored_version(conn, target.id)
        assert stored is not None  # versions are never deleted
        await modules.set_current(conn, module=name, version_id=target.id)
        targets = sorted(m for m, mods in (await modules.assignments(conn)).items()
                         if name in mods)  # fmt: skip
        plan, changed = await self._plan(
            conn, targets, trigger="rollback", subject=name, by=req.by,
            settings=settings_of(self._manifests.of(stored)),
            undo={"module": name, "from": now.id, "to": target.id},
        )  # fmt: skip
        await events.record(
            conn, "module.rollback", epoch=self._epoch, module=name, by=req.by,
            to=target.number, digest=target.digest, was=was.number, plan=plan,
        )  # fmt: skip
        return plan, changed

    async def _still_stored(self, module: str, v: modules.HistoryRow) -> None:
        """Refuse a rollback to a version whose bundles are gone from the bundle store (pruned,
        or lost with JetStream's data): its machines could not fetch them."""
        async with self._pool.acquire() as conn:
            stored = await modules.stored_version(conn, v.id)
        assert stored is not None
        for bundle, digest in sorted(stored.bundles.items()):
            if digest.startswith("sha256:") and not await blobs.has(self._obs, digest):
                why = "pruned: only the newest versions' are kept" if v.pruned else "gone"
                raise wire.BadRequest(
                    f"module {module} version {v.number}: bundle {bundle} ({digest[:19]}) is no "
                    f"longer in the bundle store ({why}); push that version's folder again",
                    code="not_found",
                )

    async def drain(self, req: DrainRequest, *, undo: bool = False) -> DrainReply:
        """Drain a machine (every plan skips it; it keeps what it runs), or undrain it: then a
        plan brings it up to date if what the catalog composes for it differs from what it
        has (or will have once the plans already recorded finish)."""
        name = req.machine

        async def up_to_date(conn: asyncpg.Connection) -> int | None:
            if not undo:
                await operators.audited(conn, detail="drained")
                return None
            plan, _ = await self._plan(
                conn, [name], trigger="undrain", subject=name, by=req.by,
                settings=await self._settings_of_machine(conn, name), undo={},
            )  # fmt: skip
            return plan

        async with self._one_change:
            was, plan = await self._fleet.set_drained(
                name, drained=not undo, by=req.by, then=up_to_date
            )
        if undo and plan is None:
            self._fleet.wants_what_it_is_sent(name)  # nothing left to bring it
        self._wake()
        await tell_changed(self._nc, MachineChanged(machine=name, drained=not undo))
        if undo:
            message = f"machine {name} undrained" + (
                f": plan {plan} brings it up to date" if plan is not None else ": it is up to date"
            )
        else:
            message = (f"machine {name} drained: every plan skips it, and it keeps what it runs "
                       f"until `mesh undrain {name}`")  # fmt: skip
        if was == (not undo):
            message += f" (it already was {'drained' if was else 'undrained'})"
        return DrainReply(machine=name, drained=not undo, was=was, message=message, plan=plan)

    async def _settings_of_machine(self, conn: asyncpg.Connection, machine: str) -> PlanSettings:
        """An undrain's plan: as patient as the most patient module on the machine, reverting
        only if every one of them would."""
        current = await modules.current_modules(conn)
        mine = sorted((await modules.assignments(conn)).get(machine, ()))
        manifests = [settings_of(self._manifests.of(current[m])) for m in mine if m in current]
        if not manifests:
            return PlanSettings()
        return PlanSettings(
            deadline=max(s.deadline for s in manifests),
            auto_revert=all(s.auto_revert for s in manifests),
        )

    # --- the key of the secrets (`mesh secret rotate-key`) ----------------------------------

    async def secret_rotate_key(self, req: RotateKeyRequest) -> RotateKeyReply:
        """One change at a time, like setting a secret: none is sealed under the old key
        while the rotation moves every secret off it (secretkeys.rotate)."""

        async def plan(key: str) -> tuple[int | None, list[str]]:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                # The entry says what changed: the key (a plan's own line would say "no change"
                # where no machine's declaration names the key's file).
                await operators.audited(conn, detail=f"the secrets under key {key}")
                # Its new file for every machine whose declaration names the key.
                return await self._plan(
                    conn, await modules.assignments(conn), trigger="secret",
                    subject=secrets.KEY_SECRET, by=req.by,
                    settings=PlanSettings(auto_revert=False), undo={},
                )  # fmt: skip

        async with self._one_change:
            reply = await secretkeys.rotate(
                self._pool, self._keys, req, epoch=self._epoch, plan=plan
            )
        self._wake()
        return reply


# --- held changes and their approval (docs/operations.md, Steering a change) -------------------
#
# A held change is recorded but not made: its plan (`held`) keeps the steps a dry run of the
# change found (what it would change, in a savepoint rolled back) and, in `hold`, the change
# to make (a push's stored version, an assign's machines). So nothing composes it meanwhile:
# no machine gets it, whatever plan rolls before its approval. Approving makes the change in
# the catalog, as the push or assign would have, composes its machines again from the catalog
# as it is then, and puts the plan in the queue (`pending`). A newer change of the same module
# (push, assign, unassign) supersedes the module's held and paused plans: they are cancelled
# (a paused one reverts first), naming the plan that superseded them.


async def _still_building(conn: asyncpg.Connection, plan_id: int) -> bool:
    """The push's plan is still `building` (its row locked until the change is recorded)."""
    p = await plans.locked(conn, plan_id)
    return p is not None and p.state == "building"


async def _stopped_building(conn: asyncpg.Connection, plan_id: int) -> wire.BadRequest:
    """Why a push's plan is no longer building: cancelled by an operator (`conflict`: the
    client must not push again on its own), or failed by a new holder (`unavailable`: the
    client asks again, and the new holder builds it)."""
    p = await plans.head(conn, plan_id)
    if p is not None and p.cancel is not None:
        return wire.BadRequest(
            f"plan {plan_id} was {p.cancel} while its bundles built: nothing was registered",
            code="conflict",
        )
    return wire.BadRequest(
        f"plan {plan_id} was stopped while its bundles built (its controller stopped); push again",
        code="unavailable",
    )


def _plans(ids: list[int]) -> str:
    return f"plan {ids[0]}" if len(ids) == 1 else f"plans {', '.join(map(str, ids))}"


def _held(plan: int | None, changed: list[str]) -> str:
    return (f"plan {plan} is held: it would change {len(changed)} machine(s); nothing changes "
            f"until mesh plan approve {plan}")  # fmt: skip


@contextlib.asynccontextmanager
async def _tried(conn: asyncpg.Connection) -> AsyncIterator[None]:
    """A savepoint rolled back at the end: the change made inside is tried, never kept."""
    savepoint = conn.transaction()
    await savepoint.start()
    try:
        yield
    finally:
        await savepoint.rollback()
