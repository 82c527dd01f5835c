"""Who asked for a change, as the mesh verified it, and whether that operator may (issue 28).

An operator asks its changes on its own subjects, `mesh.op.<name>.<verb>`: nats-server lets
only that operator's credentials publish there (mesh/auth/policy.py), so the name in the
subject is the identity the server authenticated. A name in the body (`by`) is never believed:
it is replaced with the verified one before the change sees it. Reads are asked on
`mesh.ctl.<verb>` by anyone the server lets; a change asked there is refused on a mesh with
credentials, and recorded as `anonymous` on a bus without authentication (tests, a bare
`mesh controller run`), where nobody can be verified.

What an operator may change is the controller's to decide, from the `operators` table
(migration 010): an admin anything, a deployer the modules its glob matches (push, diff,
assign, unassign, rollback, steering their plans), a viewer or tools operator nothing; a
removed or unknown operator nothing, even if a message of its reaches us.

The audit log: every change is written with its operator, verb, subject and outcome in the
change's own transaction (`audited`, called where the change commits), so no change exists
without its entry; a refusal is written on its own; a change that wrote nothing in a
transaction of its own (`no change`, a handover) is written once it is answered.
"""

import fnmatch
import logging
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import asyncpg
import msgspec

from mesh import paging, subjects, wire
from mesh.auth.policy import DEPLOYER_VERBS, READ_VERBS
from mesh.model import (
    AuditReply,
    AuditRequest,
    Brought,
    FolderChangeReply,
    FolderChangeRequest,
    OperatorAddRequest,
    OperatorInfo,
    OperatorRemoveRequest,
    OperatorReply,
    OperatorsReply,
    OperatorsRequest,
)
from mesh.modules import gate
from mesh.serving import Verb
from mesh.store import audit, modules, secrets

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # who asked, on a bus where nobody is authenticated
# Verbs that change nothing besides the reads (the dry run of a push; listing join tokens, a
# read kept from viewers): not audited.
UNAUDITED = frozenset({"diff", "token-list"})


@dataclass
class Trust:
    """What the holder knows to verify and record: its store, its epoch, and whether the bus
    authenticates (the controller has credentials: then every change must come as an
    operator)."""

    pool: asyncpg.Pool
    epoch: int
    secured: bool
    budget: Callable[[], int]  # bytes of a page (mesh/paging.py)


@dataclass
class Asked:
    """The change being served: who, which verb, about what; `written` once its entry is."""

    who: str
    verb: str
    subject: str
    epoch: int
    written: bool = False


ASKED: ContextVar[Asked | None] = ContextVar("mesh_asked", default=None)


async def audited(
    conn: asyncpg.Connection, *, detail: str = "", subject: str | None = None
) -> None:
    """The audit entry of the change being served, in `conn`'s transaction (that of the change
    itself). Outside a verb (the planner's own work) there is none to write."""
    asked = ASKED.get()
    if asked is None or asked.written:
        return
    await audit.record(conn, who=asked.who, verb=asked.verb, subject=subject or asked.subject,
                       outcome="ok", detail=detail, epoch=asked.epoch)  # fmt: skip
    asked.written = True


@dataclass(frozen=True)
class Operating:
    """What an operator's verb is given: the holder, and who asked (None: not verified)."""

    holder: Any  # services.controller.serving.verbs.Holder (which imports this module)
    who: str | None


def operating(h: Any, subject: str) -> Operating:
    """The caller of `mesh.op.<name>.<verb>`: the name is checked, then believed (the server
    let only that operator publish there)."""
    name = wire.subject_name(subjects.op_operator(subject), field="operator")
    return Operating(holder=h, who=name)


def unverified(h: Any, subject: str) -> Operating:
    """The caller of `mesh.ctl.<verb>`: nobody verified."""
    return Operating(holder=h, who=None)


def _module_of_manifest(text: str) -> str | None:
    try:
        name = tomllib.loads(text).get("module", {}).get("name")
    except (tomllib.TOMLDecodeError, AttributeError, RecursionError):  # the gate says why
        return None
    return name if isinstance(name, str) else None


def subject_of(verb: str, req: Any) -> str:
    """What the change is about, from its request (the audit's `subject`)."""
    if verb in ("push", "diff"):
        return _module_of_manifest(req.manifest) or "(a manifest without a module name)"
    if verb.startswith("plan-"):
        return f"plan {req.id}"
    for field in ("module", "machine", "name", "id"):  # `id`: a join token's
        value = getattr(req, field, None)
        if isinstance(value, str):
            return value
    return ""


async def _module_for_deployer(t: Trust, verb: str, req: Any) -> str:
    """The module a deployer's change touches (refused `forbidden` if it touches none)."""
    if verb in ("push", "diff"):
        module = _module_of_manifest(req.manifest)
        if module is None:
            raise wire.BadRequest("manifest: no [module] name in it", code="bad_request")
        return module
    if verb.startswith("plan-"):
        found = await audit.plan_trigger(t.pool, req.id)
        if found is None:
            raise wire.BadRequest(f"plan {req.id}: no such plan", code="not_found")
        trigger, subject = found
        if trigger not in ("push", "assign", "unassign", "rollback"):
            raise wire.BadRequest(
                f"forbidden: plan {req.id} is a {trigger} of {subject}, not a module's: only "
                "an admin may steer it",
                code="forbidden",
            )
        return subject
    return req.module


async def _allowed(t: Trust, who: str | None, verb: str, req: Any) -> None:
    """Refuse (`forbidden`) a change this operator may not ask for."""
    if who is None:
        if t.secured:
            raise wire.BadRequest(
                f"forbidden: a change is asked on the operator's own subject "
                f"({subjects.op('<operator>', verb)}), with an operator's credentials",
                code="forbidden",
            )
        return
    row = await audit.operator(t.pool, who)
    if row is None or row.removed:
        raise wire.BadRequest(
            f"forbidden: operator {who} is {'removed' if row else 'not known to the mesh'}",
            code="forbidden",
        )
    if row.role == "admin":
        return
    if row.role != "deployer" or verb not in DEPLOYER_VERBS:
        raise wire.BadRequest(
            f"forbidden: operator {who} ({row.role}) may not {verb}", code="forbidden"
        )
    module = await _module_for_deployer(t, verb, req)
    glob = row.modules or "*"
    if not fnmatch.fnmatchcase(module, glob):
        raise wire.BadRequest(
            f"forbidden: operator {who} may {verb} only modules matching {glob!r}, "
            f"not module {module}",
            code="forbidden",
        )


def _detail(reply: Any) -> str:
    plan = getattr(reply, "plan", None)
    if isinstance(plan, int):
        return f"plan {plan}"
    message = getattr(reply, "message", None)
    return message[:200] if isinstance(message, str) else ""


def _guarded(
    verb: str, handler: Callable[[Any, Any], Awaitable[Any]], trust: Callable[[Any], Trust]
) -> Callable[[Operating, Any], Awaitable[Any]]:
    """`handler` as an operator's verb: reads as they were; a change checked, its `by` the
    verified operator, audited (in its transaction, or once answered; a refusal on its own)."""
    if verb in READ_VERBS:

        async def read(o: Operating, req: Any) -> Any:
            return await handler(o.holder, req)

        return read

    async def change(o: Operating, req: Any) -> Any:
        t = trust(o.holder)
        who = o.who or ANONYMOUS
        asked = Asked(who=who, verb=verb, subject=subject_of(verb, req), epoch=t.epoch)
        try:
            await _allowed(t, o.who, verb, req)
            if hasattr(req, "by"):  # never the client's word
                req = msgspec.structs.replace(req, by=who)
            token = ASKED.set(asked) if verb not in UNAUDITED else None
            try:
                reply = await handler(o.holder, req)
            finally:
                if token is not None:
                    ASKED.reset(token)
        except wire.BadRequest as e:
            if verb not in UNAUDITED:
                await _refused(t, asked, e.code, str(e))
            raise
        except Exception as e:  # answered `internal` (mesh.bus.answer): recorded as such
            if verb not in UNAUDITED:
                await _refused(t, asked, "internal", type(e).__name__)
            raise
        if verb not in UNAUDITED and not asked.written:
            await audit.record(t.pool, who=who, verb=verb, subject=asked.subject, outcome="ok",
                               detail=_detail(reply), epoch=t.epoch)  # fmt: skip
        return reply

    return change


async def _refused(t: Trust, asked: Asked, code: str, message: str) -> None:
    """A refusal's entry, on its own (the change's transaction, if any, was rolled back)."""
    try:
        await audit.record(t.pool, who=asked.who, verb=asked.verb, subject=asked.subject,
                           outcome=code, detail=message[:500], epoch=t.epoch)  # fmt: skip
    except (OSError, asyncpg.PostgresError) as e:
        log.warning("could not record the refusal of %s by %s: %s", asked.verb, asked.who, e)


def as_operators(
    verbs: Mapping[str, Verb[Any, Any, Any]], *, trust: Callable[[Any], Trust]
) -> dict[str, Verb[Any, Any, Any]]:
    """The verb table as operators ask it: each handler given an `Operating` (`operating` or
    `unverified` as the endpoint's caller), changes checked and audited."""
    return {name: replace(v, handler=_guarded(name, v.handler, trust)) for name, v in verbs.items()}


# --- the verbs of this module: the audit log, recording operators and folder changes -----------


async def audit_log(t: Trust, req: AuditRequest) -> AuditReply:
    """The newest entries first; the cursor is the last entry's id."""
    at = paging.after(req.after, verb="audit", shape=(int,))
    rows = await audit.page(t.pool, before=at[0] if at else None, limit=req.limit + 1, who=req.who)
    page = paging.fill(
        (((i,), msgspec.structs.replace(e, id=i)) for i, e in rows),
        verb="audit", limit=req.limit,
        room=paging.room(t.budget(), AuditReply(entries=[])),
        what=lambda e: f"entry {e.id}",
    )  # fmt: skip
    return AuditReply(entries=page.items, next=page.next)


async def operator_add(t: Trust, req: OperatorAddRequest) -> OperatorReply:
    for field, given in (("modules", req.modules), ("allow", " ".join(req.allow))):
        if given and req.role != "deployer":
            raise wire.BadRequest(
                f"{field}: {given!r} is for a deployer, not a {req.role}", code="bad_request"
            )
    asked = ASKED.get()
    async with t.pool.acquire() as conn, conn.transaction():
        if not await audit.add_operator(conn, name=req.name, role=req.role, modules=req.modules,
                                        by=asked.who if asked else ANONYMOUS,
                                        allow=req.allow):  # fmt: skip
            raise wire.BadRequest(f"operator {req.name} exists already", code="conflict")
        scope = f", modules {req.modules}" if req.modules else ""
        scope += f", allowed {' '.join(req.allow)}" if req.allow else ""
        await audited(conn, subject=req.name, detail=f"{req.role}{scope}")
    return OperatorReply(name=req.name, role=req.role, modules=req.modules, allow=req.allow,
                         message=f"operator {req.name} ({req.role}{scope}) recorded")  # fmt: skip


async def operator_remove(t: Trust, req: OperatorRemoveRequest) -> OperatorReply:
    """Removed at once; the reply says what it brought in, which stays until someone takes it
    back (`--revert`: verbs.py unassigns its modules, each through a plan)."""
    asked = ASKED.get()
    async with t.pool.acquire() as conn, conn.transaction():
        row = await audit.operator(conn, req.name)
        if row is None or row.removed:
            raise wire.BadRequest(f"no operator {req.name}", code="not_found")
        await audit.remove_operator(conn, name=req.name, by=asked.who if asked else ANONYMOUS)
        what = await brought(conn, req.name)
        modules = f"; its modules {', '.join(what.modules)}" if what.modules else ""
        await audited(conn, subject=req.name, detail=row.role + modules)
    return OperatorReply(name=req.name, role=row.role, modules=row.modules, brought=what,
                         message=f"operator {req.name} removed")  # fmt: skip


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
        plans=await audit.open_plans_of(conn, name),
        modules=sorted(ours),
        processes=processes,
        machines=sorted(machine for machine, mods in assigned.items() if mods & ours),
        secrets=await secrets.set_by(conn, name),
    )


@contextmanager
def asked_as(verb: str, subject: str) -> Iterator[None]:
    """A change made on behalf of the one being served (`operator remove --revert`'s
    unassigns): audited as its own entry, by the same operator."""
    outer = ASKED.get()
    token = ASKED.set(Asked(who=outer.who if outer else ANONYMOUS, verb=verb, subject=subject,
                            epoch=outer.epoch if outer else 0))  # fmt: skip
    try:
        yield
    finally:
        ASKED.reset(token)


async def folder_change(t: Trust, req: FolderChangeRequest) -> FolderChangeReply:
    """A change made on the mesh's folder (`mesh machine add/remove`, `mesh cert rotate`),
    recorded under its own verb with the operator that asked on its own subject: the command
    line asks this once the change is done (the folder is the truth of credentials and
    certificates; the controller never sees them). Admins only, like the changes themselves."""
    asked = ASKED.get()
    who = asked.who if asked else ANONYMOUS
    await audit.record(t.pool, who=who, verb=req.change, subject=req.subject, outcome="ok",
                       detail=req.detail, epoch=t.epoch)  # fmt: skip
    if asked is not None:
        asked.written = True
    return FolderChangeReply(message=f"{req.change} {req.subject} recorded as {who}'s")


async def operator_list(t: Trust, _: OperatorsRequest) -> OperatorsReply:
    rows = await audit.operators(t.pool)
    return OperatorsReply(
        operators=[
            OperatorInfo(name=r.name, role=r.role, modules=r.modules, allow=r.allow) for r in rows
        ]
    )
