"""An admin's changes of the operators (`mesh operator add`, `mesh operator remove [--revert]`)
and the audit entries of changes made on the mesh's folder (`mesh machine add/remove`, `mesh cert
rotate`: the verb `folder-change`). Who may ask what is trust/operators.py's to decide.
"""

from dataclasses import dataclass

import asyncpg
import msgspec

from mesh import wire
from mesh.model import (
    AssignRequest,
    Brought,
    FolderChangeReply,
    FolderChangeRequest,
    OperatorAddRequest,
    OperatorRemoveRequest,
    OperatorReply,
)
from mesh.modules import gate
from mesh.store import audit as stored
from mesh.store import modules, secrets
from services.controller.changes.modules import Changes
from services.controller.trust.audit import Audit


@dataclass
class Operators:
    pool: asyncpg.Pool
    changes: Changes  # `--revert` unassigns the removed operator's modules through plans

    async def add(self, req: OperatorAddRequest, audit: Audit) -> OperatorReply:
        for field, given, roles in (("modules", req.modules, ("deployer", "agent")),
                                    ("allow", " ".join(req.allow), ("deployer",))):  # fmt: skip
            if given and req.role not in roles:
                raise wire.BadRequest(
                    f"{field}: {given!r} is for a {' or '.join(roles)}, not a {req.role}",
                    code="bad_request",
                )
        async with self.pool.acquire() as conn, conn.transaction():
            if not await stored.add_operator(conn, name=req.name, role=req.role,
                                             modules=req.modules, by=audit.who,
                                             allow=req.allow):  # fmt: skip
                raise wire.BadRequest(f"operator {req.name} exists already", code="conflict")
            scope = f", modules {req.modules}" if req.modules else ""
            scope += f", allowed {' '.join(req.allow)}" if req.allow else ""
            await audit.write(conn, subject=req.name, detail=f"{req.role}{scope}")
        return OperatorReply(
            name=req.name, role=req.role, modules=req.modules, allow=req.allow,
            message=f"operator {req.name} ({req.role}{scope}) recorded",
        )  # fmt: skip

    async def remove(self, req: OperatorRemoveRequest, audit: Audit) -> OperatorReply:
        """Removed at once; the reply says what it brought in, which stays until someone takes
        it back (`--revert`: its modules unassigned, each through a plan of its own, audited as
        an unassign by the same admin)."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await stored.operator(conn, req.name)
            if row is None or row.removed:
                raise wire.BadRequest(f"no operator {req.name}", code="not_found")
            await stored.remove_operator(conn, name=req.name, by=audit.who)
            what = await brought(conn, req.name)
            mods = f"; its modules {', '.join(what.modules)}" if what.modules else ""
            await audit.write(conn, subject=req.name, detail=row.role + mods)
        reply = OperatorReply(name=req.name, role=row.role, modules=row.modules, brought=what,
                              message=f"operator {req.name} removed")  # fmt: skip
        if not req.revert:
            return reply
        reverted = []
        for module in what.modules:
            async with self.pool.acquire() as conn:
                assigned = await modules.assignments(conn)
            on = sorted(m for m, mods in assigned.items() if module in mods)
            if not on:
                continue
            done = await self.changes.unassign(
                AssignRequest(module=module, machines=on, by=audit.who),
                audit.on_behalf("unassign", module),
            )
            reverted += [done.plan] if done.plan is not None else []
        return msgspec.structs.replace(reply, reverted=reverted)

    async def folder_change(self, req: FolderChangeRequest, audit: Audit) -> FolderChangeReply:
        """A change made on the mesh's folder, recorded under its own verb with the operator
        that asked on its own subject: the command line asks this once the change is done (the
        folder is the truth of credentials and certificates; the controller never sees them).
        Admins only, like the changes themselves."""
        async with self.pool.acquire() as conn:
            await audit.on_behalf(req.change, req.subject).write(conn, detail=req.detail)
        audit.written = True  # the change's own entry is its audit: no `folder-change` besides
        return FolderChangeReply(message=f"{req.change} {req.subject} recorded as {audit.who}'s")


async def brought(conn: asyncpg.Connection, name: str) -> Brought:
    """What `name` brought into the mesh that is still there: its plans not over, the modules
    whose current version it pushed (their processes and machines), the secrets it set last."""
    current = [v for v in (await modules.current_modules(conn)).values() if v.pushed_by == name]
    assigned = await modules.assignments(conn)
    ours = {v.module for v in current}
    processes = []
    for v in sorted(current, key=lambda v: v.module):
        try:
            m = gate.parse(v.manifest)
        except gate.Refused:  # registered by an older gate: named by module alone
            continue
        processes += [f"{v.module}.{p}" for p in sorted({*m.process, *m.tool})]
    return Brought(
        plans=await stored.open_plans_of(conn, name),
        modules=sorted(ours),
        processes=processes,
        machines=sorted(machine for machine, mods in assigned.items() if mods & ours),
        secrets=await secrets.set_by(conn, name),
    )
