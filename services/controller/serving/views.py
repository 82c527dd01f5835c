"""What the holder answers without changing anything: the fleet (`nodes`, from memory), modules,
a module's history, a machine's declaration, plans, the dry run of a push (`diff`), a build's
log, and a secret's value for a host whose declaration names it.

The lists answer a page at a time (mesh/paging.py): `nodes` by tier then name, a plan's steps
by tier then machine, `plans` newest first, `modules` by name (a module on many machines in
several entries), `diff` by machine, `history` newest version first. Each page is read in one
snapshot of the store.
"""

import base64
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from mesh import blobs, paging, wire
from mesh.auth.scopes import CONTROLLER_MODULE, CONTROLLER_SECRETS
from mesh.auth.secretkeys import SecretsKeyError
from mesh.model import (
    ASSIGNED_PER_ENTRY,
    BuildLogsReply,
    BuildLogsRequest,
    DeclarationReply,
    DeclarationRequest,
    DiffReply,
    DiffRequest,
    HistoryReply,
    HistoryRequest,
    MachineDiff,
    ModuleInfo,
    ModulesReply,
    ModulesRequest,
    NodesReply,
    NodesRequest,
    PlanApproval,
    PlanReply,
    PlanRequest,
    PlansReply,
    PlansRequest,
    PlanStep,
    PolicyReply,
    PolicyRequest,
    SecretInfo,
    SecretReply,
    SecretsReply,
    SecretsRequest,
    ToolEntry,
    ToolsReply,
    ToolsRequest,
    VersionDiffReply,
    VersionDiffRequest,
    VersionEntry,
)
from mesh.modules.compose import Declaration
from mesh.modules.diff import diff
from mesh.store import builds, declarations, modules, plans, policy, secrets
from mesh.store.modules import StoredVersion
from services.controller.catalog import pushing, scoping, versions
from services.controller.catalog.secretkeys import Keys
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import Manifests, Publisher
from services.controller.plans import rollout

# Every page's reads in one snapshot: a plan's tiers and its steps, modules and their machines.
_SNAPSHOT = {"isolation": "repeatable_read", "readonly": True}


@dataclass
class Views:
    pool: asyncpg.Pool
    nc: Client
    obs: ObjectStore
    fleet: Fleet  # `nodes`; the dry run assigns a first push as its manifest says
    manifests: Manifests
    publisher: Publisher  # the dry run composes as a push would
    keys: Keys  # opens the secrets hosts ask for (secretkeys.py)
    # bytes of a page, for the NATS server we answer on now
    budget: Callable[[], int] = lambda: paging.PAGE_BYTES

    async def nodes(self, req: NodesRequest) -> NodesReply:
        """From memory, in the fleet's own order: a page costs what it holds, not the fleet."""
        at = paging.after(req.after, verb="nodes", shape=(int, str))
        fleet, wanted = self.fleet, self.publisher.wanted
        if req.names:  # a few by name: those known, in the order asked
            known = [n for n in dict.fromkeys(req.names) if n in fleet.machines]
            return NodesReply(nodes=[fleet.node(n, wanted=wanted) for n in known],
                              total=len(fleet.order))  # fmt: skip
        order = fleet.order  # sorted (tier, name); nothing changes it before we return
        total = len(order)
        rows = ((order[i], fleet.node(order[i][1], wanted=wanted))
                for i in range(paging.start(order, at), total))  # fmt: skip
        page = paging.fill(
            rows, verb="nodes", limit=req.limit,
            room=paging.room(self.budget(), NodesReply(nodes=[], total=total)),
            what=lambda n: f"machine {n.name}",
        )  # fmt: skip
        return NodesReply(nodes=page.items, next=page.next, total=total)

    async def modules(self, req: ModulesRequest) -> ModulesReply:
        at = paging.after(req.after, verb="modules", shape=(str, str))
        room = paging.room(self.budget(), ModulesReply(modules=[], total=0))
        # More assignments than a page can hold (an entry holds ASSIGNED_PER_ENTRY, and each
        # machine takes 4 bytes at least: `"a",`): a page ends before the rows read do, and
        # what is past them is only looked at to know that there is more.
        most = min(req.limit * ASSIGNED_PER_ENTRY, room // 4) + 1
        async with self.pool.acquire() as conn, conn.transaction(**_SNAPSHOT):
            current = await modules.current_modules(conn)
            numbers = await modules.current_numbers(conn)
            rows = await modules.assigned_after(conn, after=at, most=most)
        machines: dict[str, list[str]] = {}
        for module, machine in rows:
            machines.setdefault(module, []).append(machine)
        page = paging.fill(
            self._module_entries(current, numbers, machines, at), verb="modules",
            limit=req.limit,
            room=room, what=lambda m: f"module {m.name}'s entry",
        )  # fmt: skip
        return ModulesReply(modules=page.items, next=page.next, total=len(current))

    def _module_entries(
        self,
        current: dict[str, StoredVersion],
        numbers: dict[str, int],
        machines: dict[str, list[str]],
        at: paging.Key | None,
    ) -> Iterator[tuple[paging.Key, ModuleInfo]]:
        """Every module by name from the cursor on, each in entries of ASSIGNED_PER_ENTRY of
        its machines (one entry with none for a module assigned nowhere), keyed by the module
        and the last machine in the entry."""
        for name in sorted(current):
            if at is not None and name < at[0]:
                continue
            mine = machines.get(name, [])
            if at is not None and name == at[0] and not mine:
                continue  # the cursor's module, with none of its machines left after it
            v = current[name]
            m = self.manifests.of(v)
            for i in range(0, max(len(mine), 1), ASSIGNED_PER_ENTRY):
                chunk = mine[i : i + ASSIGNED_PER_ENTRY]
                yield (name, chunk[-1] if chunk else ""), ModuleInfo(
                    name=name, version=v.version, pushed_at=v.pushed_at, pushed_by=v.pushed_by,
                    assigned=chunk, processes=sorted(m.process), containers=sorted(m.container),
                    tools=sorted(m.tool), number=numbers.get(name, 0),
                )  # fmt: skip

    async def declaration(self, req: DeclarationRequest) -> DeclarationReply:
        machine = req.machine
        async with self.pool.acquire() as conn:
            stored = (await declarations.declarations(conn, [machine])).get(machine)
        if stored is None:
            raise wire.BadRequest(f"machine {machine} has no declaration yet", code="not_found")
        d, body, epoch = stored
        return DeclarationReply(
            machine=machine, digest=d, epoch=epoch, declaration=msgspec.Raw(body)
        )

    async def diff(self, req: DiffRequest) -> DiffReply:
        """The dry run of a push: the same transaction, rolled back; nothing stored or built.
        Each page runs it again (a page is as the store is when it is asked) and spells out
        the changes of its own machines only."""
        at = paging.after(req.after, verb="diff", shape=(str,))
        manifest, data = await pushing.read_source(
            nc=self.nc, manifest_text=req.manifest, source=req.source, upload=req.upload
        )
        name = manifest.module.name
        bundles, todo = await pushing.pack_bundles(
            pool=self.pool, obs=self.obs, manifest=manifest, data=data, dry=True
        )
        async with self.pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                targets = await pushing.register(
                    conn, fleet=self.fleet, manifest=manifest, text=req.manifest,
                    version=req.source, bundles=bundles, by="",
                )  # fmt: skip
                composed = await self.publisher.compose(conn, targets)
                stored = await declarations.declarations(conn, sorted(composed))
            finally:
                await tx.rollback()
        changed = [(machine,) for machine, (after, _) in sorted(composed.items())
                   if machine not in stored or stored[machine][0] != after]  # fmt: skip

        def spelled(machine: str) -> MachineDiff:
            after, body = composed[machine]
            before = stored.get(machine)
            old = msgspec.json.decode(before[1], type=Declaration) if before else None
            new = msgspec.json.decode(body, type=Declaration)
            return MachineDiff(
                machine=machine, before=before[0] if before else None, after=after,
                changes=[msgspec.to_builtins(ch) for ch in diff(old, new)],
            )  # fmt: skip

        reply = DiffReply(module=name, version=req.source, machines=[],
                          builds=[b.name for b in todo], total=len(changed))  # fmt: skip
        rows = ((changed[i], spelled(changed[i][0]))
                for i in range(paging.start(changed, at), len(changed)))  # fmt: skip
        page = paging.fill(
            rows, verb="diff", limit=req.limit, room=paging.room(self.budget(), reply),
            what=lambda m: f"machine {m.machine}'s changes",
            instead="see its declaration with `mesh declaration` after the push",
        )  # fmt: skip
        return msgspec.structs.replace(reply, machines=page.items, next=page.next)

    async def plan(self, req: PlanRequest) -> PlanReply:
        """The plan, its tiers (of every step) and a page of its steps."""
        at = paging.after(req.after, verb="plan", shape=(int, str))
        async with self.pool.acquire() as conn, conn.transaction(**_SNAPSHOT):
            p = await plans.head(conn, req.id)
            if p is None:
                raise wire.BadRequest(f"plan {req.id} does not exist", code="not_found")
            counted = await plans.tiers(conn, req.id)
            steps = await plans.step_views(conn, req.id, after=at, most=req.limit + 1)
            if req.changes:
                steps = await _with_changes(conn, p, steps)
            # What an approval binds to (`plan approve --digest`): a held plan's alone
            digest = await plans.step_digest(conn, p.id) if p.state == "held" else ""
            needed = (await policy.policy(conn)).approvals if p.state == "held" else 0
        soaking = p.soak_tier if p.soak_until is not None else None
        tiers = [rollout.tier_shown(t, soaking=t.tier == soaking) for t in counted]
        reply = PlanReply(
            id=p.id, state=p.state, trigger=p.trigger, subject=p.subject, by=p.by,
            epoch=p.epoch, created=p.created, started=p.started, finished=p.finished,
            phase=p.phase, failure=p.error, settings=p.settings, builds=p.builds, tiers=tiers,
            steps=[], total=sum(t.total for t in counted),
            soak=plans.soak_shown(p.soak_tier, p.soak_until), cancelled=p.cancel, note=p.note,
            digest=digest, approvals=_approvals(p, digest), approvals_needed=needed,
        )  # fmt: skip
        page = paging.fill(
            (((s.tier, s.machine), s) for s in steps), verb="plan", limit=req.limit,
            room=paging.room(self.budget(), reply), what=lambda s: f"step {s.machine}",
        )  # fmt: skip
        return msgspec.structs.replace(reply, steps=page.items, next=page.next)

    async def policy(self, req: PolicyRequest) -> PolicyReply:
        """What a change needs before it runs (`mesh policy`)."""
        now = await policy.policy(self.pool)
        return PolicyReply(approvals=now.approvals, set_by=now.set_by, set_at=now.set_at)

    async def plans(self, req: PlansRequest) -> PlansReply:
        """Newest first: the cursor is the last plan given, the page the ones older."""
        at = paging.after(req.after, verb="plans", shape=(int,))
        async with self.pool.acquire() as conn, conn.transaction(**_SNAPSHOT):
            found = await plans.recent(conn, req.limit + 1, before=at[0] if at else None)
            total = await plans.count(conn)
        page = paging.fill(
            (((p.id,), p) for p in found), verb="plans", limit=req.limit,
            room=paging.room(self.budget(), PlansReply(plans=[], total=total)),
            what=lambda p: f"plan {p.id}",
        )  # fmt: skip
        return PlansReply(plans=page.items, next=page.next, total=total)

    async def history(self, req: HistoryRequest) -> HistoryReply:
        """A module's versions, newest first (the cursor is the last number given), each with
        the last plan that rolled it out and how that ended."""
        at = paging.after(req.after, verb="history", shape=(int,))
        async with self.pool.acquire() as conn, conn.transaction(**_SNAPSHOT):
            rows = await modules.history(
                conn, req.module, below=at[0] if at else None, most=req.limit + 1
            )
            total = await modules.version_count(conn, req.module)
        if not total:
            raise wire.BadRequest(f"module {req.module} has never been pushed", code="not_found")
        entries = (
            ((r.number,), VersionEntry(
                version=r.number, digest=r.digest, pushed=r.pushed_at, by=r.pushed_by,
                plan=r.plan, state=r.state, current=r.current,
                kept=not r.pruned, note=r.note,
            ))
            for r in rows
        )  # fmt: skip
        reply = HistoryReply(module=req.module, versions=[], total=total)
        page = paging.fill(
            entries, verb="history", limit=req.limit, room=paging.room(self.budget(), reply),
            what=lambda v: f"version {v.version}",
        )  # fmt: skip
        return msgspec.structs.replace(reply, versions=page.items, next=page.next)

    async def version_diff(self, req: VersionDiffRequest) -> VersionDiffReply:
        """What changed between two versions of a module, each named as `rollback --to` names
        one (its number, or its digest)."""
        async with self.pool.acquire() as conn, conn.transaction(**_SNAPSHOT):
            rows = await modules.history(conn, req.module)
            a, b = (versions.pick(rows, module=req.module, to=to) for to in (req.a, req.b))
            old, new = await modules.version_of(conn, a.id), await modules.version_of(conn, b.id)
        lines, bundles = versions.compared(old, new, numbers=(a.number, b.number))
        reply = VersionDiffReply(
            module=req.module, a=a.number, b=b.number, a_digest=a.digest, b_digest=b.digest,
            manifest=[], bundles=bundles,
        )  # fmt: skip
        room, kept = paging.room(self.budget(), reply) - 64, []  # 64: the line saying a cut
        for line in lines:  # two manifests of 256 KiB each may not fit
            room -= paging.encoded_size(line) + 1
            if room < 0:
                kept.append(f"[… {len(lines) - len(kept)} more line(s) cut to fit a reply …]")
                break
            kept.append(line)
        return msgspec.structs.replace(reply, manifest=kept)

    async def tools(self, req: ToolsRequest) -> ToolsReply:
        """The fleet's tools, as each host last reported them, by machine, server and tool,
        from memory (as `nodes`)."""
        at = paging.after(req.after, verb="tools", shape=(str, str, str))
        fleet = self.fleet
        machines = [req.machine] if req.machine is not None else sorted(fleet.tools)

        def entries() -> Iterator[tuple[paging.Key, ToolEntry]]:
            for machine in machines:
                if at is not None and machine < at[0]:
                    continue
                up = fleet.up(machine)
                for server in sorted(fleet.tools.get(machine, []), key=lambda s: s.name):
                    for t in sorted(server.tools, key=lambda t: t.name):
                        key = (machine, server.name, t.name)
                        if at is not None and key <= at:
                            continue
                        yield key, ToolEntry(
                            machine=machine, server=server.name, name=t.name,
                            description=t.description, input_schema=t.input_schema,
                            state=server.state, up=up, timeout=server.timeout,
                        )  # fmt: skip

        page = paging.fill(
            entries(), verb="tools", limit=req.limit,
            room=paging.room(self.budget(), ToolsReply(tools=[])),
            what=lambda t: f"tool {t.machine}.{t.server}.{t.name}",
        )  # fmt: skip
        return ToolsReply(tools=page.items, next=page.next)

    async def secrets(self, req: SecretsRequest) -> SecretsReply:
        """The secrets that are set, by name, each with the modules that name it: never a
        value."""
        at = paging.after(req.after, verb="secrets", shape=(str,))
        async with self.pool.acquire() as conn, conn.transaction(**_SNAPSHOT):
            found = await secrets.listed(conn)
            using = await scoping.in_use(conn, self.manifests)
        entries = (
            ((r.name,), SecretInfo(name=r.name, version=r.version, by=r.set_by,
                                   at=r.updated_at, modules=using.get(r.name, []),
                                   allowed=_allowed(r)))
            for r in found
            if at is None or r.name > at[0]
        )  # fmt: skip
        page = paging.fill(
            entries, verb="secrets", limit=req.limit,
            room=paging.room(self.budget(), SecretsReply(secrets=[], total=len(found))),
            what=lambda e: f"secret {e.name}",
        )  # fmt: skip
        return SecretsReply(secrets=page.items, next=page.next, total=len(found))

    async def secret_for(self, machine: str, name: str) -> SecretReply:
        """A secret's value, for a host whose declaration names it in a module that may have
        it (scoping.py); nobody else gets it."""
        async with self.pool.acquire() as conn:
            stored = (await declarations.declarations(conn, [machine])).get(machine)
            if stored is None:
                raise wire.BadRequest(
                    f"machine {machine} has no declaration: it names no secret", code="forbidden"
                )
            known = self.fleet.machines.get(machine)
            decl = msgspec.json.decode(stored[1], type=Declaration)
            await scoping.check_serve(
                conn, machine=machine, labels=known.labels if known else {}, secret=name,
                decl=decl,
            )  # fmt: skip
            # The version its declaration names: a machine a plan of the secret's change has
            # not reached yet (or has reverted) keeps the version before.
            value = await self._secret(conn, name, version=_named_version(decl, name))
        if value is None:
            raise wire.BadRequest(f"secret {name} has not been set", code="not_found")
        version, data = value
        return SecretReply(name=name, version=version, value=base64.b64encode(data).decode())

    async def _secret(
        self, conn: asyncpg.Connection, name: str, *, version: int | None
    ) -> tuple[int, bytes] | None:
        """A secret opened; the key of the secrets is the controllers' key file itself."""
        ring = self.keys.usable()
        if name == secrets.KEY_SECRET:
            return await secrets.key_version(conn), ring.text().encode()
        try:
            return await secrets.secret(conn, name, ring=ring, version=version)
        except SecretsKeyError as e:
            raise wire.BadRequest(
                f"this controller cannot read it: {e}", code="unavailable"
            ) from None

    async def build_logs(self, req: BuildLogsRequest) -> BuildLogsReply:
        row = await builds.last_build(self.pool, module=req.module, bundle=req.bundle)
        if row is None:
            raise wire.BadRequest(f"no build of module {req.module} yet", code="not_found")
        text = row.log_tail
        if row.log_object:
            try:
                text = (await blobs.get_named(self.nc, row.log_object)).decode(errors="replace")
            except blobs.BlobMissing:
                pass
        reply = BuildLogsReply(key=row.key, module=row.module, bundle=row.bundle,
                               state=row.state, builder=row.builder, log="")  # fmt: skip
        # The builder keeps the log's last 256 KiB (LOG_KEEP), which as JSON may still not fit.
        log = paging.fitting_tail(text, paging.room(self.budget(), reply))
        return msgspec.structs.replace(reply, log=log)


def _named_version(decl: Declaration, name: str) -> int | None:
    """The version of secret `name` a declaration's files name (None: none of them does)."""
    runs = [*decl.processes.values(), *(decl.tools or {}).values()]
    return next(
        (f.secret_version for r in runs for f in r.files.values() if f.secret == name), None
    )


def _allowed(r: secrets.SetSecret) -> str | None:
    """The modules that may name a secret, as a glob: the controller's secrets are its alone."""
    return CONTROLLER_MODULE if r.name in CONTROLLER_SECRETS else r.modules


async def _with_changes(
    conn: asyncpg.Connection, p: plans.Plan, steps: list[PlanStep]
) -> list[PlanStep]:
    """Each step with what it changes in its machine's declaration: from what the machine had
    when the plan started (before then: what it has now) to the step's own."""
    machines = [s.machine for s in steps]
    bodies = await plans.step_bodies(conn, p.id, machines)
    now = {} if p.started else await declarations.declarations(conn, machines)

    def spelled(s: PlanStep) -> list[Any]:
        before, after = bodies[s.machine]
        if p.started is None:
            before = now[s.machine][1] if s.machine in now else None
        old = msgspec.json.decode(before, type=Declaration) if before else None
        new = msgspec.json.decode(after, type=Declaration)
        return [msgspec.to_builtins(ch) for ch in diff(old, new)]

    def before(s: PlanStep) -> str | None:  # not started: what the machine has now
        return s.before if p.started else (now[s.machine][0] if s.machine in now else None)

    return [msgspec.structs.replace(s, changes=spelled(s), before=before(s)) for s in steps]


def _approvals(p: plans.Plan, digest: str) -> list[PlanApproval]:
    """A plan's approvals; while it is held, one given for what it no longer does is void."""
    given = p.hold.approvals if p.hold is not None else []
    held = p.state == "held"
    return [PlanApproval(by=a.by, at=a.at, digest=a.digest, void=held and a.digest != digest)
            for a in given]  # fmt: skip
