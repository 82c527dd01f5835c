"""The holder's module work: push, assign, unassign, secrets, declarations and the dry run.

Each change runs in one transaction that checks the seat's epoch, records the change,
recomposes the affected machines' declarations (a conflict rolls everything back and names both
modules) and records a plan with one step per machine whose declaration changes. The planner
(`planner.py`) rolls the plan out tier by tier; it stores and publishes each declaration (KV
bucket `mesh-declarations`, key = the machine, with the epoch) when the machine's turn comes.
One change at a time.

A push whose bundles must be built records its plan as `building` first and builds outside the
one-change lock (a build may take minutes; assign, unassign and secrets do not wait for it);
then, under the lock, it registers the version with the built digests and composes as the
catalog is then, and the plan gets its steps and waits its turn (`pending`). Pushes of one
module wait for each other, so they register in the order they came.
"""

import base64
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
import msgspec
from nats.aio.client import Client
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from mesh import blobs, wire
from mesh.model import (
    AssignRequest,
    BuildLogsReply,
    BuildLogsRequest,
    ChangeReply,
    DeclarationReply,
    DiffReply,
    DiffRequest,
    MachineDiff,
    ModuleInfo,
    ModulesReply,
    PlanBuild,
    PlanReply,
    PlanSettings,
    PlansReply,
    PlanTier,
    PushRequest,
    SecretReply,
    SecretSetRequest,
)
from mesh.modules import archive, gate, load
from mesh.modules.compose import (
    Conflict,
    Declaration,
    ModuleVersion,
    Prepared,
    encode,
    merge,
    prepare,
)
from mesh.modules.diff import diff
from mesh.modules.manifest import ON_THE_MACHINE, Assign, Bundle, Manifest
from mesh.store import catalog, plans
from services.controller import builds
from services.controller.fleet import Fleet

log = logging.getLogger(__name__)

MAX_DECLARATION = 768 * 1024  # bytes of one declaration: with its envelope, under 1 MiB
PUT_IN_FLIGHT = 64  # KV puts at once: one at a time, a tier of 900 took most of a second
UNBUILT = "unbuilt:"  # the stand-in for a bundle not built yet (a dry run, a building plan)
PARSED_KEPT = 256  # manifests kept parsed (by version id): enough for every module's current one


class _Build(msgspec.Struct, frozen=True):
    """A bundle a push has to build: its name, build key, table and source folder's digest."""

    name: str
    key: str
    bundle: Bundle
    source: str


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


class Catalog:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        nc: Client,
        kv: KeyValue,
        obs: ObjectStore,
        fleet: Fleet,
        epoch: int,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._wake = wake  # tells the planner a plan was recorded
        self._pool = pool
        self._nc = nc
        self._kv = kv
        self._obs = obs
        self._fleet = fleet
        self._epoch = epoch
        self._one_change = anyio.Lock()
        self._pushes_of = _PushesOf()
        # module_versions.id -> its manifest, the least recently used dropped past PARSED_KEPT
        self._parsed: OrderedDict[int, Manifest] = OrderedDict()
        self.wanted: dict[str, str] = {}  # machine -> digest of its published declaration

    # --- reading ---------------------------------------------------------------------------

    def _manifest(self, v: catalog.StoredVersion) -> Manifest:
        manifest = self._parsed.get(v.id)
        if manifest is not None:
            self._parsed.move_to_end(v.id)
            return manifest
        manifest = self._parsed[v.id] = gate.parse(v.manifest)
        if len(self._parsed) > PARSED_KEPT:
            self._parsed.popitem(last=False)
        return manifest

    async def compose(
        self, conn: asyncpg.Connection, machines: Iterable[str]
    ) -> dict[str, tuple[str, bytes]]:
        """machine -> (digest, canonical declaration), composed from the store as this
        transaction sees it. A conflict names both modules and rolls the transaction back."""
        current = await catalog.current_modules(conn)
        assigned = await catalog.assignments(conn)
        secrets = await catalog.secret_versions(conn)
        prepared: dict[str, Prepared] = {}  # each module version once, for all machines
        composed: dict[str, tuple[str, bytes]] = {}
        for machine in sorted(set(machines)):
            mine = []
            for name in sorted(assigned.get(machine, ())):
                if name not in prepared:
                    v = current[name]
                    mv = ModuleVersion(
                        name=name, version=v.version, manifest=self._manifest(v), bundles=v.bundles
                    )
                    prepared[name] = prepare(mv, secrets)
                mine.append(prepared[name])
            try:
                body, digest = encode(merge(machine, mine))
            except Conflict as e:
                raise wire.BadRequest(str(e), code="conflict") from None
            if len(body) > MAX_DECLARATION:  # the KV (and the bus) could not carry it
                raise wire.BadRequest(
                    f"machine {machine}'s declaration would be {len(body)} bytes, more than "
                    f"{MAX_DECLARATION}: assign fewer or smaller modules to it",
                    code="too_large",
                )
            composed[machine] = (digest, body)
        return composed

    async def _plan(
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
    ) -> tuple[int | None, list[str]]:
        """Record a plan for the machines whose composition differs from what they will have
        once the plans before it finish; (None, []) when there are none. `building`: the
        push's plan recorded while it built, which gets these steps (or goes, if none)."""
        composed = await self.compose(conn, machines)
        expected = await plans.expected(conn, sorted(composed))
        steps = [
            plans.Step(
                machine=m, tier=self._fleet.machines[m].tier, state="pending", after=d, after_body=b
            )
            for m, (d, b) in composed.items()
            if expected.get(m) != d
        ]
        if building is not None:
            if not steps:
                await plans.drop_building(conn, building)
                return None, []
            if not await plans.built(
                conn, building, settings=settings, builds=builds or [], undo=undo, steps=steps
            ):
                raise wire.BadRequest(
                    f"plan {building} was stopped while its bundles built; push again",
                    code="unavailable",
                )
            return building, [s.machine for s in steps]
        if not steps:
            return None, []
        plan_id = await plans.create(
            conn, trigger=trigger, subject=subject, by=by, epoch=self._epoch, settings=settings,
            builds=builds or [], undo=undo, steps=steps,
        )  # fmt: skip
        return plan_id, [s.machine for s in steps]

    def _settings(self, manifest: Manifest | None) -> PlanSettings:
        if manifest is None:
            return PlanSettings()
        r = manifest.rollout
        return PlanSettings(
            deadline=gate.duration(r.deadline), max_parallel=r.max_parallel,
            auto_revert=r.auto_revert, skip_down=r.skip_down,
        )  # fmt: skip

    async def publish(self, bodies: dict[str, tuple[str, bytes]]) -> None:
        """After the commit. A put that fails is logged, not raised: the change is stored, and
        `keep_published` puts it again (the store is the truth, the KV its copy). Puts run
        PUT_IN_FLIGHT at a time: each waits for the server's fsync (bench/rollout.py)."""
        limiter = anyio.CapacityLimiter(PUT_IN_FLIGHT)

        async def put(machine: str, d: str, body: bytes) -> None:
            envelope = DeclarationReply(
                machine=machine, digest=d, epoch=self._epoch, declaration=msgspec.Raw(body)
            )
            async with limiter:
                try:
                    await self._kv.put(machine, wire.encode(envelope))
                except Exception as e:
                    log.warning("could not publish the declaration of %s (will retry): %s",
                                machine, e)  # fmt: skip
                    return
            self.wanted[machine] = d

        async with anyio.create_task_group() as tg:
            for machine, (d, body) in sorted(bodies.items()):
                tg.start_soon(put, machine, d, body)

    async def keep_published(self, every: float = 5.0) -> None:
        """Put again every stored declaration whose digest the KV does not have yet."""
        while True:
            await anyio.sleep(every)
            async with self._pool.acquire() as conn:
                stored = await catalog.digests(conn)
                behind = [m for m, d in stored.items() if self.wanted.get(m) != d]
                bodies = await catalog.declarations(conn, behind) if behind else {}
            if bodies:
                await self.publish({m: (d, body) for m, (d, body, _) in bodies.items()})

    async def republish(self) -> int:
        """At takeover: every stored declaration, under this holder's epoch. Plans an earlier
        holder left `building` are failed: that holder's push can no longer register them."""
        async with self._pool.acquire() as conn:
            async with conn.transaction():
                await catalog.fence(conn, epoch=self._epoch)
                stale = await plans.fail_building(
                    conn,
                    "the controller building it stopped before its builds finished; push again",
                    before_epoch=self._epoch,
                )
            if stale:
                log.info("plan(s) %s left building by an earlier holder: failed",
                         ", ".join(map(str, stale)))  # fmt: skip
            stored = await catalog.declarations(conn)
        await self.publish({m: (d, body) for m, (d, body, _) in stored.items()})
        return len(stored)

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

    async def _register(
        self,
        conn: asyncpg.Connection,
        *,
        manifest: Manifest,
        text: str,
        version: str,
        bundles: dict[str, str],
        by: str,
    ) -> list[str]:
        """Record the version (and, at the first push, the default assignment); return the
        machines the module is assigned to."""
        name = manifest.module.name
        first = name not in await catalog.current_modules(conn)
        await catalog.record_version(
            conn, module=name, version=version, manifest=text, bundles=bundles, by=by
        )
        if first and manifest.assign:
            await catalog.assign(conn, module=name, machines=self._default(manifest.assign))
        return sorted(m for m, mods in (await catalog.assignments(conn)).items() if name in mods)

    def _default(self, a: Assign) -> list[str]:
        """Registered machines named, in one of the tiers, or carrying all the labels."""
        chosen = {m for m in a.machines if m in self._fleet.machines}
        for m in self._fleet.machines.values():
            in_tier = bool(a.tiers) and m.tier in a.tiers
            labelled = bool(a.labels) and all(m.labels.get(k) == v for k, v in a.labels.items())
            if in_tier or labelled:
                chosen.add(m.name)
        return sorted(chosen)

    # --- verbs -----------------------------------------------------------------------------

    async def _source(self, manifest_text: str, source: str) -> tuple[Manifest, bytes]:
        try:
            manifest = gate.parse(manifest_text)
        except gate.Refused as e:
            raise wire.BadRequest(str(e), code="refused") from None
        try:
            data = await blobs.get(self._obs, source)
        except (blobs.BlobMissing, blobs.BlobCorrupt) as e:
            raise wire.BadRequest(f"source: {e}", code="not_found") from None
        try:
            # Archive work is CPU on up to 64 MiB: off the event loop that answers verbs.
            await anyio.to_thread.run_sync(load.check_sources, manifest, data)
            inside = await anyio.to_thread.run_sync(archive.read, data, "module.toml")
        except (gate.Refused, archive.ArchiveRefused) as e:
            raise wire.BadRequest(str(e), code="refused") from None
        if inside is None or inside.decode(errors="replace") != manifest_text:
            # The version is the archive's digest: what is registered must be what it holds.
            raise wire.BadRequest(
                "manifest: differs from the module.toml in the source archive", code="refused"
            )
        return manifest, data

    async def _bundles(
        self, manifest: Manifest, data: bytes, *, dry: bool
    ) -> tuple[dict[str, str], list[_Build]]:
        """Bundle name -> digest, packing what is not stored yet (unless dry) and taking cached
        builds; the builds still to run, whose digests here are stand-ins (UNBUILT + key)."""
        digests: dict[str, str] = {}
        todo: list[_Build] = []
        for name, b in sorted(manifest.bundle.items()):
            if b.kind in ON_THE_MACHINE:
                continue
            assert b.source is not None  # the gate made sure
            try:
                # A build sees only its source folder, so its key covers exactly that.
                tree = await anyio.to_thread.run_sync(load.source_tree, data, b.source)
            except archive.ArchiveRefused as e:
                raise wire.BadRequest(
                    f"module {manifest.module.name}: bundle.{name}.source: {e}", code="refused"
                ) from None
            tree_digest = archive.digest(tree) if dry else await blobs.put(self._obs, tree)
            if b.build is None:
                digests[name] = tree_digest
                continue
            key = builds.build_key(tree=tree_digest, bundle=b)
            hit = await builds.cached(self._pool, self._obs, key)
            if hit is not None:
                digests[name] = hit
                continue
            todo.append(_Build(name=name, key=key, bundle=b, source=tree_digest))
            digests[name] = UNBUILT + key
        return digests, todo

    async def _build(self, module: str, todo: list[_Build]) -> dict[str, str]:
        """Run the builds on a builder host: bundle name -> the built bundle's digest."""
        digests: dict[str, str] = {}
        for b in todo:
            digests[b.name] = await builds.build(
                nc=self._nc, pool=self._pool, obs=self._obs, fleet=self._fleet, key=b.key,
                module=module, name=b.name, bundle=b.bundle, source=b.source,
            )  # fmt: skip
        return digests

    async def _building(
        self, manifest: Manifest, req: PushRequest, bundles: dict[str, str], todo: list[_Build]
    ) -> int:
        """Record the push's plan as `building` (no steps yet: they are composed once the
        builds are done), so `mesh plan` shows what the push is doing."""
        building = {b.name for b in todo}
        async with self._pool.acquire() as conn, conn.transaction():
            await catalog.fence(conn, epoch=self._epoch)
            return await plans.create(
                conn, trigger="push", subject=manifest.module.name, by=req.by,
                epoch=self._epoch, settings=self._settings(manifest),
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
                await catalog.fence(conn, epoch=self._epoch)
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
                await catalog.fence(conn, epoch=self._epoch)
                # Read again: a revert may have moved the module while it built. The machines
                # are composed now, from the catalog as it is, with what was built.
                current = (await catalog.current_modules(conn)).get(name)
                if current is not None and current.version == req.source:
                    if building is not None:
                        await plans.drop_building(conn, building)
                    return None
                targets = await self._register(
                    conn, manifest=manifest, text=req.manifest, version=req.source,
                    bundles=bundles, by=req.by,
                )  # fmt: skip
                now = (await catalog.current_modules(conn))[name]
                return await self._plan(
                    conn, targets, trigger="push", subject=name, by=req.by,
                    settings=self._settings(manifest),
                    undo={"module": name, "from": current.id if current else None, "to": now.id},
                    builds=[PlanBuild(bundle=b, digest=d, built=b in built)
                            for b, d in sorted(bundles.items())],
                    building=building,
                )  # fmt: skip

    async def push(self, req: PushRequest) -> ChangeReply:
        manifest, data = await self._source(req.manifest, req.source)
        name = manifest.module.name
        unchanged = ChangeReply(plan=None, machines=[], message="no change", version=req.source)
        # Pushes of this module in the order they came (a later one never registers before an
        # earlier one that is still building); other changes do not wait for the builds.
        async with self._pushes_of(name):
            async with self._pool.acquire() as conn:
                current = (await catalog.current_modules(conn)).get(name)
            if current is not None and current.version == req.source:
                return unchanged
            bundles, todo = await self._bundles(manifest, data, dry=False)
            if todo:
                builds.builder(self._fleet)  # none up: refused before any plan is recorded
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
        log.info("pushed %s %s: plan %s for %d machine(s)", name, req.source[:19], plan,
                 len(changed))  # fmt: skip
        message = (
            f"{name} {req.source[:19]}: plan {plan} changes {len(changed)} machine(s)"
            if changed
            else f"{name} {req.source[:19]} registered; no machine's declaration changes"
        )
        return ChangeReply(plan=plan, machines=changed, message=message, version=req.source)

    async def assign(self, req: AssignRequest, *, undo: bool = False) -> ChangeReply:
        async with self._one_change:
            machines = self._select(machines=req.machines, tier=req.tier, labels=req.labels)
            if not machines:
                raise wire.BadRequest("no machine matches", code="not_found")
            async with self._pool.acquire() as conn, conn.transaction():
                await catalog.fence(conn, epoch=self._epoch)
                current = (await catalog.current_modules(conn)).get(req.module)
                if current is None:
                    raise wire.BadRequest(
                        f"module {req.module} has not been pushed", code="not_found"
                    )
                had = {m for m, mods in (await catalog.assignments(conn)).items()
                       if req.module in mods}  # fmt: skip
                moved = sorted(set(machines) & had) if undo else sorted(set(machines) - had)
                change = catalog.unassign if undo else catalog.assign
                await change(conn, module=req.module, machines=machines)
                trigger = "unassign" if undo else "assign"
                plan, changed = await self._plan(
                    conn, machines, trigger=trigger, subject=req.module, by=req.by,
                    settings=self._settings(self._manifest(current)),
                    undo={"module": req.module, "machines": moved},
                )  # fmt: skip
        self._wake()
        verb = "unassigned from" if undo else "assigned to"
        log.info("%s %s %s: plan %s", req.module, verb, ", ".join(machines), plan)
        return ChangeReply(
            plan=plan,
            machines=changed,
            message=f"{req.module} {verb} {', '.join(machines)}; "
            + (f"plan {plan} changes {len(changed)} machine(s)" if changed else "no change"),
        )

    async def secret_set(self, req: SecretSetRequest) -> ChangeReply:
        try:
            value = base64.b64decode(req.value, validate=True)
        except ValueError:  # binascii.Error, or text that is not ASCII
            raise wire.BadRequest("value: not base64") from None
        async with self._one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await catalog.fence(conn, epoch=self._epoch)
                version = await catalog.set_secret(conn, name=req.name, value=value)
                # A secret's old value is not kept, so there is nothing to revert to.
                plan, changed = await self._plan(
                    conn, await catalog.assignments(conn), trigger="secret", subject=req.name,
                    by=req.by, settings=PlanSettings(auto_revert=False), undo={},
                )  # fmt: skip
        self._wake()
        log.info("secret %s set (version %d): plan %s", req.name, version, plan)
        return ChangeReply(
            plan=plan,
            machines=changed,
            message=f"secret {req.name} is at version {version}; "
            + (f"plan {plan} changes {len(changed)} machine(s)" if changed else "no change"),
        )

    async def modules(self) -> ModulesReply:
        async with self._pool.acquire() as conn:
            current = await catalog.current_modules(conn)
            assigned = await catalog.assignments(conn)
        found = []
        for name, v in sorted(current.items()):
            m = self._manifest(v)
            found.append(
                ModuleInfo(
                    name=name,
                    version=v.version,
                    pushed_at=v.pushed_at,
                    pushed_by=v.pushed_by,
                    assigned=sorted(machine for machine, mods in assigned.items() if name in mods),
                    processes=sorted(m.process),
                    containers=sorted(m.container),
                )
            )
        return ModulesReply(modules=found)

    async def declaration(self, machine: str) -> DeclarationReply:
        async with self._pool.acquire() as conn:
            stored = (await catalog.declarations(conn, [machine])).get(machine)
        if stored is None:
            raise wire.BadRequest(f"machine {machine} has no declaration yet", code="not_found")
        d, body, epoch = stored
        return DeclarationReply(
            machine=machine, digest=d, epoch=epoch, declaration=msgspec.Raw(body)
        )

    async def diff(self, req: DiffRequest) -> DiffReply:
        """The dry run of a push: the same transaction, rolled back; nothing stored or built."""
        manifest, data = await self._source(req.manifest, req.source)
        name = manifest.module.name
        bundles, todo = await self._bundles(manifest, data, dry=True)
        async with self._pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                targets = await self._register(
                    conn, manifest=manifest, text=req.manifest, version=req.source,
                    bundles=bundles, by="",
                )  # fmt: skip
                composed = await self.compose(conn, targets)
                stored = await catalog.declarations(conn, sorted(composed))
            finally:
                await tx.rollback()
        machines = []
        for machine, (after, body) in sorted(composed.items()):
            before = stored.get(machine)
            if before is not None and before[0] == after:
                continue
            old = msgspec.json.decode(before[1], type=Declaration) if before else None
            new = msgspec.json.decode(body, type=Declaration)
            changes = [msgspec.to_builtins(ch) for ch in diff(old, new)]
            machines.append(
                MachineDiff(
                    machine=machine, before=before[0] if before else None, after=after,
                    changes=changes,
                )
            )  # fmt: skip
        return DiffReply(
            module=name, version=req.source, machines=machines, builds=[b.name for b in todo]
        )

    async def plan(self, plan_id: int) -> PlanReply:
        p = await plans.load(self._pool, plan_id)
        if p is None:
            raise wire.BadRequest(f"plan {plan_id} does not exist", code="not_found")
        tiers: list[PlanTier] = []
        for t in sorted({s.tier for s in p.steps}):
            mine = [s for s in p.steps if s.tier == t]
            states = {s.state for s in mine}
            done = sum(s.state in ("done", "skipped") for s in mine)
            if "failed" in states:
                state = "failed"
            elif any(s.reverted for s in mine):
                state = "reverted"
            elif done == len(mine):
                state = "done"
            elif states & {"applying", "done"}:
                state = "rolling"
            else:
                state = "pending"
            tiers.append(PlanTier(tier=t, state=state, total=len(mine), done=done))
        return PlanReply(
            id=p.id, state=p.state, trigger=p.trigger, subject=p.subject, by=p.by,
            epoch=p.epoch, created=p.created, started=p.started, finished=p.finished,
            phase=p.phase, failure=p.error, settings=p.settings, builds=p.builds, tiers=tiers,
            steps=[s.view() for s in p.steps],
        )  # fmt: skip

    async def plans(self, limit: int) -> PlansReply:
        return PlansReply(plans=await plans.recent(self._pool, limit))

    async def secret_for(self, machine: str, name: str) -> SecretReply:
        """A secret's value, for a host whose declaration names it; nobody else gets it."""
        async with self._pool.acquire() as conn:
            stored = (await catalog.declarations(conn, [machine])).get(machine)
            value = await catalog.secret(conn, name)
        named = False
        if stored is not None:
            decl = msgspec.json.decode(stored[1], type=Declaration)
            named = any(f.secret == name for p in decl.processes.values() for f in p.files.values())
        if not named:
            raise wire.BadRequest(
                f"machine {machine}'s declaration names no secret {name}", code="forbidden"
            )
        if value is None:
            raise wire.BadRequest(f"secret {name} has not been set", code="not_found")
        version, data = value
        return SecretReply(name=name, version=version, value=base64.b64encode(data).decode())

    async def build_logs(self, req: BuildLogsRequest) -> BuildLogsReply:
        row = await catalog.last_build(self._pool, module=req.module, bundle=req.bundle)
        if row is None:
            raise wire.BadRequest(f"no build of module {req.module} yet", code="not_found")
        text = row.log_tail
        if row.log_object:
            try:
                text = (await blobs.get_named(self._obs, row.log_object)).decode(errors="replace")
            except blobs.BlobMissing:
                pass
        return BuildLogsReply(
            key=row.key,
            module=row.module,
            bundle=row.bundle,
            state=row.state,
            builder=row.builder,
            log=text,
        )
