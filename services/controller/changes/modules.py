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

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
import asyncpg
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from mesh import blobs, wire
from mesh.auth.signing import Signing
from mesh.model import (
    AssignRequest,
    ChangeReply,
    PlanBuild,
    PushRequest,
    RollbackRequest,
)
from mesh.modules.manifest import Manifest
from mesh.store import events, modules, plans, seats
from services.controller.catalog import builds as build_requests
from services.controller.catalog import scoping, versions
from services.controller.catalog.pushing import (
    ToBuild,
    pack_bundles,
    read_source,
    register,
    settings_of,
)
from services.controller.changes import selecting
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import Manifests
from services.controller.plans.approvals import HeldChanges, held_said
from services.controller.plans.recording import Recorder, named, replied, stopped_building
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


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


@dataclass
class Changes:
    """The catalog's changes: a push (built, restored), an assign or unassign, a rollback (held
    ones are approvals.py's); each records its plan through the recorder, one at a time with a
    secret's and a drain's (recording.py)."""

    pool: asyncpg.Pool
    nc: Client
    obs: ObjectStore
    fleet: Fleet
    epoch: int
    manifests: Manifests
    signing: Signing  # builds are requested signed (mesh.auth.signing)
    recorder: Recorder  # records each change's plan, one change at a time
    held: HeldChanges  # a held push or assign (approvals.py)
    pushes_of: _PushesOf = field(default_factory=_PushesOf)

    # --- a push ----------------------------------------------------------------------------

    async def _build(self, module: str, todo: list[ToBuild]) -> dict[str, str]:
        """Run the builds on a builder host: bundle name -> the built bundle's digest."""
        digests: dict[str, str] = {}
        for b in todo:
            digests[b.name] = await build_requests.build(
                nc=self.nc, signing=self.signing, pool=self.pool, obs=self.obs,
                fleet=self.fleet, key=b.key,
                module=module, name=b.name, bundle=b.bundle, source=b.source,
            )  # fmt: skip
        return digests

    async def _building(
        self, manifest: Manifest, req: PushRequest, bundles: dict[str, str], todo: list[ToBuild]
    ) -> int:
        """Record the push's plan as `building` (no steps yet: they are composed once the
        builds are done), so `mesh plan` shows what the push is doing."""
        building = {b.name for b in todo}
        async with self.pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=self.epoch)
            plan_id = await plans.create(
                conn, trigger="push", subject=manifest.module.name, by=req.by,
                epoch=self.epoch, settings=settings_of(manifest),
                builds=[PlanBuild(bundle=b, digest=d, built=b in building)
                        for b, d in sorted(bundles.items())],
                undo={"module": manifest.module.name}, steps=[], state="building",
            )  # fmt: skip
            if req.note:
                await plans.noted(conn, plan_id, req.note)
            return plan_id

    async def _not_built(self, plan_id: int, e: BaseException) -> None:
        """A building plan whose builds failed (or whose push was cut off) ends `failed`."""
        why = str(e).splitlines()[0] if isinstance(e, wire.BadRequest) else (
            f"the push stopped while building ({type(e).__name__})"
        )  # fmt: skip
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self.epoch)
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
        audit: Audit,
    ) -> tuple[int | None, list[str]] | None:
        """Register the version with its bundles' digests and record its plan, under the
        one-change lock; None if the version is already the current one."""
        name = manifest.module.name
        async with self.recorder.one_change:
            async with self.pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self.epoch)
                if building is not None and not await _still_building(conn, building):
                    raise await stopped_building(conn, building)  # cancelled, or failed
                # Read again: a revert may have moved the module while it built. The machines
                # are composed now, from the catalog as it is, with what was built.
                current = (await modules.current_modules(conn)).get(name)
                if current is not None and current.version == req.source:
                    if building is not None:
                        await plans.drop_building(conn, building)
                    return None
                old = await self.recorder.supersede(conn, name, by=req.by)
                current = (await modules.current_modules(conn)).get(name)  # a paused one undone
                builds = [PlanBuild(bundle=b, digest=d, built=b in built)
                          for b, d in sorted(bundles.items())]  # fmt: skip
                if req.hold:
                    recorded = await self.held.hold_push(
                        conn,
                        manifest,
                        req,
                        bundles,
                        builds=builds,
                        building=building,
                        audit=audit,
                    )
                else:
                    targets = await register(
                        conn, fleet=self.fleet, manifest=manifest, text=req.manifest,
                        version=req.source, bundles=bundles, by=req.by, note=req.note,
                    )  # fmt: skip
                    now = (await modules.current_modules(conn))[name]
                    recorded = await self.recorder.plan(
                        conn, targets, trigger="push", subject=name, by=req.by,
                        settings=settings_of(manifest),
                        undo={"module": name, "from": current.id if current else None,
                              "to": now.id},
                        builds=builds, building=building, audit=audit,
                    )  # fmt: skip
                await self.recorder.superseded(
                    conn, old, plan=recorded[0], what=f"a push of {name}"
                )
                if recorded[0] is not None and req.note:
                    await plans.noted(conn, recorded[0], req.note)
                return recorded

    async def _restore(
        self, manifest: Manifest, req: PushRequest, data: bytes, current: modules.StoredVersion,
        audit: Audit,
    ) -> ChangeReply | None:  # fmt: skip
        """The current version pushed again, with bundles of it missing from the bundle store
        (lost with JetStream's data, or purged): stored again from the source, built again
        where they were built. A build that gives other bytes than before changes the
        version's bundles, and its machines get them in a plan. None: nothing was missing."""
        name = manifest.module.name
        missing = [
            b for b, d in sorted(current.bundles.items())
            if d.startswith("sha256:") and not await blobs.has(self.obs, d)
        ]  # fmt: skip
        if not missing:
            return None
        bundles, todo = await pack_bundles(
            pool=self.pool, obs=self.obs, manifest=manifest, data=data, dry=False
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
        async with self.recorder.one_change:
            async with self.pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self.epoch)
                await modules.rebundle(conn, version_id=current.id, bundles=bundles)
                targets = sorted(m for m, mods in (await modules.assignments(conn)).items()
                                 if name in mods)  # fmt: skip
                plan, machines = await self.recorder.plan(
                    conn, targets, trigger="push", subject=name, by=req.by,
                    settings=settings_of(manifest),
                    undo={"module": name, "from": current.id, "to": current.id},
                    builds=[PlanBuild(bundle=b, digest=d, built=b in changed)
                            for b, d in sorted(bundles.items())],
                    audit=audit,
                )  # fmt: skip
        self.recorder.wake()
        return replied(plan=plan, changed=machines, version=req.source,
                       message=f"{what}, built again as other bytes; plan {plan} changes "
                       f"{len(machines)} machine(s)")  # fmt: skip

    # --- verbs -----------------------------------------------------------------------------

    async def push(self, req: PushRequest, audit: Audit) -> ChangeReply:
        manifest, data = await read_source(
            nc=self.nc, manifest_text=req.manifest, source=req.source, upload=req.upload
        )
        name = manifest.module.name
        async with self.pool.acquire() as conn:
            await scoping.check_push(conn, manifests=self.manifests, manifest=manifest,
                                     by=req.by)  # fmt: skip
        if req.upload is not None:  # the archive kept with its bundles, as a client once put it
            await blobs.put(self.obs, data)
            await blobs.unstage(self.nc, req.upload, bucket=blobs.UPLOADS)
        unchanged = replied(plan=None, changed=[], message="no change", version=req.source)
        # Pushes of this module in the order they came (a later one never registers before an
        # earlier one that is still building); other changes do not wait for the builds.
        async with self.pushes_of(name):
            async with self.pool.acquire() as conn:
                current = (await modules.current_modules(conn)).get(name)
            if current is not None and current.version == req.source:
                return await self._restore(manifest, req, data, current, audit) or unchanged
            bundles, todo = await pack_bundles(
                pool=self.pool, obs=self.obs, manifest=manifest, data=data, dry=False
            )
            if todo:
                build_requests.builder(self.fleet)  # none up: refused before any plan is recorded
            building = await self._building(manifest, req, bundles, todo) if todo else None
            try:
                bundles |= await self._build(name, todo)
                recorded = await self._record_push(
                    manifest,
                    req,
                    bundles,
                    built={b.name for b in todo},
                    building=building,
                    audit=audit,
                )
            except BaseException as e:  # a failed build, a conflict, the push cut off
                if building is not None:
                    with anyio.CancelScope(shield=True):
                        await self._not_built(building, e)
                raise
        if recorded is None:
            return unchanged
        plan, changed = recorded
        self.recorder.wake()
        log.info("pushed %s %s: plan %s for %d machine(s)%s", name, req.source[:19], plan,
                 len(changed), " (held)" if req.hold else "")  # fmt: skip
        if req.hold:
            said = f"{name} {req.source[:19]}: {held_said(plan, changed)}"
            return replied(plan=plan, changed=changed, version=req.source, state="held",
                           message=said)  # fmt: skip
        message = (
            f"{name} {req.source[:19]}: plan {plan} changes {len(changed)} machine(s)"
            if changed
            else f"{name} {req.source[:19]} registered; no machine's declaration changes"
        )
        return replied(plan=plan, changed=changed, message=message, version=req.source)

    async def assign(
        self, req: AssignRequest, audit: Audit, *, standing: bool = True
    ) -> ChangeReply:
        return await self._assign(req, audit, undo=False, standing=standing)

    async def unassign(
        self, req: AssignRequest, audit: Audit, *, standing: bool = True
    ) -> ChangeReply:
        return await self._assign(req, audit, undo=True, standing=standing)

    async def _assign(
        self, req: AssignRequest, audit: Audit, *, undo: bool, standing: bool
    ) -> ChangeReply:
        """An assign or unassign. By labels alone (`standing`, not held), it is a standing
        selector too: kept or dropped, and followed as machines come and are labelled
        (following.py); then matching no machine now is no refusal."""
        trigger = "unassign" if undo else "assign"
        selector = standing and bool(req.labels) and not req.machines and req.tier is None
        selector = selector and not req.hold
        async with self.recorder.one_change:
            machines = self.recorder.select(machines=req.machines, tier=req.tier, labels=req.labels)
            if not machines and selector:
                return await selecting.alone(self.pool, self.epoch, req, audit, undo=undo)
            if not machines:
                raise wire.BadRequest("no machine matches", code="not_found")
            async with self.pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self.epoch)
                if selector:
                    await selecting.keep(conn, req, undo=undo)
                old = await self.recorder.supersede(conn, req.module, by=req.by)
                current = (await modules.current_modules(conn)).get(req.module)
                if current is None:
                    raise wire.BadRequest(
                        f"module {req.module} has not been pushed", code="not_found"
                    )
                settings = settings_of(self.manifests.of(current))
                if req.hold:
                    plan, changed = await self.held.hold_assign(
                        conn, req, machines, trigger=trigger, settings=settings, audit=audit
                    )
                else:
                    moved = await modules.reassign(conn, req.module, machines, undo=undo)
                    plan, changed = await self.recorder.plan(
                        conn, machines, trigger=trigger, subject=req.module, by=req.by,
                        settings=settings, audit=audit,
                        # `version`: what it rolls out, as `mesh history` shows (an assign's)
                        undo={"module": req.module, "machines": moved, "version": current.id},
                    )  # fmt: skip
                what = f"an {trigger} of {req.module}"
                await self.recorder.superseded(conn, old, plan=plan, what=what)
        self.recorder.wake()
        verb = "unassigned from" if undo else "assigned to"
        log.info("%s %s %s: plan %s%s", req.module, verb, named(machines), plan,
                 " (held)" if req.hold else "")  # fmt: skip
        if req.hold:
            return replied(plan=plan, changed=changed, state="held",
                           message=f"{req.module} to be {verb} {named(machines)}: "
                           + held_said(plan, changed))  # fmt: skip
        follows = ""
        if selector:
            follows = "; it no longer follows those labels" if undo else (
                "; machines labelled so later get it too")  # fmt: skip
        return replied(
            plan=plan,
            changed=changed,
            message=f"{req.module} {verb} {named(machines)}; "
            + (f"plan {plan} changes {len(changed)} machine(s)" if changed else "no change")
            + follows,
        )

    # --- going back to a version; machines out of the plans and back ---------------------------

    async def rollback(self, req: RollbackRequest, audit: Audit) -> ChangeReply:
        """The module back at an earlier version (catalog/versions.py) through an ordinary plan of
        its machines: the catalog names that version again, each machine is composed with it,
        and the plan rolls tier by tier (and reverts) as a push's does. Nothing is built: the
        version's bundles must still be stored (bundles.py keeps the newest versions'). A
        rollback is a newer change of the module: it supersedes the module's held and paused
        plans (a paused push taken back may already bring the machines to that version)."""
        name = req.module
        async with self.pushes_of(name):  # after a push of the module still building
            async with self.pool.acquire() as conn:
                rows = await modules.history(conn, name)
            target = versions.pick(rows, module=name, to=req.to)
            current = versions.current(rows, module=name)
            what = f"{name} version {target.number} ({target.digest[:19]})"
            async with self.recorder.one_change:
                if target.id != current.id:
                    await self._still_stored(name, target)
                async with self.pool.acquire() as conn, conn.transaction():
                    await seats.fence(conn, epoch=self.epoch)
                    now = (await modules.current_modules(conn)).get(name)
                    if now is None or now.id != current.id:  # a revert moved it meanwhile
                        raise wire.BadRequest(
                            f"module {name} changed version meanwhile: ask again", code="conflict"
                        )
                    old = await self.recorder.supersede(conn, name, by=req.by)
                    plan, changed = await self._roll_back(conn, req, target, current, audit)
                    await self.recorder.superseded(
                        conn, old, plan=plan, what=f"a rollback of {name}"
                    )
        if plan is None and not old:
            return replied(plan=None, changed=[], version=target.digest,
                           message=f"{what} is the current version: no change")  # fmt: skip
        self.recorder.wake()
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
        audit: Audit,
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
        plan, changed = await self.recorder.plan(
            conn, targets, trigger="rollback", subject=name, by=req.by,
            settings=settings_of(self.manifests.of(stored)),
            undo={"module": name, "from": now.id, "to": target.id}, audit=audit,
        )  # fmt: skip
        await events.record(
            conn, "module.rollback", epoch=self.epoch, module=name, by=req.by,
            to=target.number, digest=target.digest, was=was.number, plan=plan,
        )  # fmt: skip
        return plan, changed

    async def _still_stored(self, module: str, v: modules.HistoryRow) -> None:
        """Refuse a rollback to a version whose bundles are gone from the bundle store (pruned,
        or lost with JetStream's data): its machines could not fetch them."""
        async with self.pool.acquire() as conn:
            stored = await modules.stored_version(conn, v.id)
        assert stored is not None
        for bundle, digest in sorted(stored.bundles.items()):
            if digest.startswith("sha256:") and not await blobs.has(self.obs, digest):
                why = "pruned: only the newest versions' are kept" if v.pruned else "gone"
                raise wire.BadRequest(
                    f"module {module} version {v.number}: bundle {bundle} ({digest[:19]}) is no "
                    f"longer in the bundle store ({why}); push that version's folder again",
                    code="not_found",
                )


async def _still_building(conn: asyncpg.Connection, plan_id: int) -> bool:
    """The push's plan is still `building` (its row locked until the change is recorded)."""
    p = await plans.locked(conn, plan_id)
    return p is not None and p.state == "building"


def _plans(ids: list[int]) -> str:
    return f"plan {ids[0]}" if len(ids) == 1 else f"plans {', '.join(map(str, ids))}"
