"""What the holder answers from the store without changing it: modules, a machine's
declaration, plans, the dry run of a push (`diff`), a build's log, and a secret's value for a
host whose declaration names it."""

import base64
import binascii

import asyncpg
import msgspec
from nats.js.object_store import ObjectStore

from mesh import blobs, wire
from mesh.model import (
    BuildLogsReply,
    BuildLogsRequest,
    DeclarationReply,
    DiffReply,
    DiffRequest,
    MachineDiff,
    ModuleInfo,
    ModulesReply,
    PlanReply,
    PlansReply,
    PlanTier,
    SecretReply,
    ToolEntry,
    ToolsReply,
    ToolsRequest,
)
from mesh.modules.compose import Declaration, tools_of
from mesh.modules.diff import diff
from mesh.store import builds, declarations, modules, plans, secrets
from services.controller import changes
from services.controller.fleet import Fleet
from services.controller.publishing import Manifests, Publisher

PAGE_BYTES = 256 * 1024  # of one page of a list verb: well under a NATS message (1 MiB)


def _cursor(key: tuple[str, ...]) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(key)).decode()


def _after(cursor: str | None) -> tuple[str, ...]:
    if cursor is None:
        return ()
    try:
        key = msgspec.json.decode(base64.urlsafe_b64decode(cursor), type=tuple[str, ...])
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise wire.BadRequest("after: not a cursor this verb gave (its `next`)") from None
    return key


class Views:
    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        obs: ObjectStore,
        fleet: Fleet,
        manifests: Manifests,
        publisher: Publisher,
    ) -> None:
        self._pool = pool
        self._obs = obs
        self._fleet = fleet  # the dry run assigns a first push as its manifest says
        self._manifests = manifests
        self._publisher = publisher  # the dry run composes as a push would

    async def modules(self) -> ModulesReply:
        async with self._pool.acquire() as conn:
            current = await modules.current_modules(conn)
            assigned = await modules.assignments(conn)
        found = []
        for name, v in sorted(current.items()):
            m = self._manifests.of(v)
            found.append(
                ModuleInfo(
                    name=name,
                    version=v.version,
                    pushed_at=v.pushed_at,
                    pushed_by=v.pushed_by,
                    assigned=sorted(machine for machine, mods in assigned.items() if name in mods),
                    processes=sorted(m.process),
                    containers=sorted(m.container),
                    tools=sorted(m.tool),
                )
            )
        return ModulesReply(modules=found)

    async def declaration(self, machine: str) -> DeclarationReply:
        async with self._pool.acquire() as conn:
            stored = (await declarations.declarations(conn, [machine])).get(machine)
        if stored is None:
            raise wire.BadRequest(f"machine {machine} has no declaration yet", code="not_found")
        d, body, epoch = stored
        return DeclarationReply(
            machine=machine, digest=d, epoch=epoch, declaration=msgspec.Raw(body)
        )

    async def diff(self, req: DiffRequest) -> DiffReply:
        """The dry run of a push: the same transaction, rolled back; nothing stored or built."""
        manifest, data = await changes.read_source(
            obs=self._obs, manifest_text=req.manifest, source=req.source
        )
        name = manifest.module.name
        bundles, todo = await changes.pack_bundles(
            pool=self._pool, obs=self._obs, manifest=manifest, data=data, dry=True
        )
        async with self._pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                targets = await changes.register(
                    conn, fleet=self._fleet, manifest=manifest, text=req.manifest,
                    version=req.source, bundles=bundles, by="",
                )  # fmt: skip
                composed = await self._publisher.compose(conn, targets)
                stored = await declarations.declarations(conn, sorted(composed))
            finally:
                await tx.rollback()
        machines = []
        for machine, (after, body) in sorted(composed.items()):
            before = stored.get(machine)
            if before is not None and before[0] == after:
                continue
            old = msgspec.json.decode(before[1], type=Declaration) if before else None
            new = msgspec.json.decode(body, type=Declaration)
            found = [msgspec.to_builtins(ch) for ch in diff(old, new)]
            machines.append(
                MachineDiff(
                    machine=machine, before=before[0] if before else None, after=after,
                    changes=found,
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

    def tools(self, req: ToolsRequest) -> ToolsReply:
        """The fleet's tools, as each host last reported them, by machine, server and tool;
        a page at a time (at most `limit` tools and PAGE_BYTES), `next` the cursor of the next."""
        after = _after(req.after)
        fleet = self._fleet
        machines = [req.machine] if req.machine is not None else sorted(fleet.tools)
        page: list[ToolEntry] = []
        size = 0
        last: tuple[str, ...] = ()
        for machine in machines:
            up = fleet.up(machine)
            for server in sorted(fleet.tools.get(machine, []), key=lambda s: s.name):
                for t in sorted(server.tools, key=lambda t: t.name):
                    key = (machine, server.name, t.name)
                    if key <= after:
                        continue
                    entry = ToolEntry(
                        machine=machine, server=server.name, name=t.name,
                        description=t.description, input_schema=t.input_schema,
                        state=server.state, up=up, timeout=server.timeout,
                    )  # fmt: skip
                    size += len(msgspec.json.encode(entry))
                    if page and (len(page) >= req.limit or size > PAGE_BYTES):
                        return ToolsReply(tools=page, next=_cursor(last))
                    page.append(entry)
                    last = key
        return ToolsReply(tools=page, next=None)

    async def plans(self, limit: int) -> PlansReply:
        return PlansReply(plans=await plans.recent(self._pool, limit))

    async def secret_for(self, machine: str, name: str) -> SecretReply:
        """A secret's value, for a host whose declaration names it; nobody else gets it."""
        async with self._pool.acquire() as conn:
            stored = (await declarations.declarations(conn, [machine])).get(machine)
            value = await secrets.secret(conn, name)
        named = False
        if stored is not None:
            decl = msgspec.json.decode(stored[1], type=Declaration)
            runs = [*decl.processes.values(), *tools_of(decl).values()]
            named = any(f.secret == name for p in runs for f in p.files.values())
        if not named:
            raise wire.BadRequest(
                f"machine {machine}'s declaration names no secret {name}", code="forbidden"
            )
        if value is None:
            raise wire.BadRequest(f"secret {name} has not been set", code="not_found")
        version, data = value
        return SecretReply(name=name, version=version, value=base64.b64encode(data).decode())

    async def build_logs(self, req: BuildLogsRequest) -> BuildLogsReply:
        row = await builds.last_build(self._pool, module=req.module, bundle=req.bundle)
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
