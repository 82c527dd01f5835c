"""Who asked for a change, as the mesh verified it, and whether that operator may (issue 28).

An operator asks its changes on its own subjects, `mesh.op.<name>.<verb>`: nats-server lets
only that operator's credentials publish there (mesh/auth/policy.py), so the name in the
subject is the identity the server authenticated. A name in the body (`by`) is never believed:
it is replaced with the verified one before the change sees it. Reads are asked on
`mesh.ctl.<verb>` by anyone the server lets; a change asked there is refused on a mesh with
credentials, and recorded as `anonymous` on a bus without authentication (tests, a bare
`mesh controller run`), where nobody can be verified.

What an operator may change is the controller's to decide, from the `operators` table
(migration 010) and the role the verb table gives each verb (serving/verbs.py): an admin
anything, a deployer the verbs of role `deployer` on the modules its glob matches (push, diff,
assign, unassign, rollback, steering their plans), a viewer or tools operator nothing; a
removed or unknown operator nothing, even if a message of its reaches us.

The guard (`as_operators`) gives the method that serves a change an `Audit` (audit.py): who
asked and about what, written in the change's own transaction. A refusal is written on its
own; a change that wrote nothing in a transaction of its own (`no change`, a handover) is
written once it is answered.
"""

import fnmatch
import inspect
import logging
import sys
import tomllib
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import asyncpg
import msgspec

from mesh import paging, subjects, wire
from mesh.auth.policy import AGENT_VERBS
from mesh.auth.scopes import CONTROLLER_SECRETS
from mesh.model import AuditReply, AuditRequest, OperatorInfo, OperatorsReply, OperatorsRequest
from mesh.serving import Bound, Parts, Verb
from mesh.store import audit, secrets
from services.controller.trust.audit import ANONYMOUS, Audit

log = logging.getLogger(__name__)

# Who may ask a verb: anyone the server lets ask it (`reader`), a deployer for the modules its
# glob matches, or an admin alone. mesh/auth/policy.py gives the NATS permissions in the same
# terms (READ_VERBS, DEPLOYER_VERBS; tests/test_trust.py checks that they agree).
Role = Literal["reader", "deployer", "admin"]


@dataclass(frozen=True)
class Served:
    """One verb as the table names it: the method that serves it (a part's, found by its
    class: `Changes.push`), who may ask it, and its bounds. Its request and reply are the
    method's own annotations: a change's method takes `(request, audit)` when it writes its
    audit entry itself, in its own transaction; a read's takes `(request)`."""

    method: Callable[..., Awaitable[Any]]
    role: Role
    bound: Bound | None = None
    limit: int = wire.MAX_BODY
    too_large: str = "ask for less"
    audited: bool = True  # False: a verb whose answer changes nothing the audit keeps (`diff`)

    @property
    def owner(self) -> type:
        """The class whose method serves the verb, from the method's own name."""
        module = sys.modules[self.method.__module__]
        owner = getattr(module, self.method.__qualname__.split(".")[0], None)
        if not isinstance(owner, type):
            raise TypeError(f"{self.method.__qualname__} is no method of a class")
        return owner

    @property
    def request(self) -> type:
        """The type of the method's request (its parameter after `self`)."""
        after_self = list(inspect.signature(self.method).parameters)[1]
        return typing.get_type_hints(self.method)[after_self]

    @property
    def reply(self) -> type:
        return typing.get_type_hints(self.method)["return"]

    @property
    def takes_audit(self) -> bool:
        """Whether the method writes its own audit entry where its change commits (it takes
        an `Audit`); one that does not (`handover`, which has no transaction) is written once
        answered."""
        positional = [
            p for p in inspect.signature(self.method).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD
        ]  # fmt: skip
        return len(positional) == 3  # self, the request, the Audit (keywords of its own aside)


@dataclass
class Trust:
    """What the holder knows to verify and record: its store, its epoch, and whether the bus
    authenticates (the controller has credentials: then every change must come as an
    operator). It answers the reads of the audit log and of the operators."""

    pool: asyncpg.Pool
    epoch: int
    secured: bool
    budget: Callable[[], int]  # bytes of a page (mesh/paging.py)

    async def audit_log(self, req: AuditRequest) -> AuditReply:
        """The newest entries first; the cursor is the last entry's id."""
        at = paging.after(req.after, verb="audit", shape=(int,))
        rows = await audit.page(self.pool, before=at[0] if at else None, limit=req.limit + 1,
                                who=req.who)  # fmt: skip
        page = paging.fill(
            (((i,), msgspec.structs.replace(e, id=i)) for i, e in rows),
            verb="audit", limit=req.limit,
            room=paging.room(self.budget(), AuditReply(entries=[])),
            what=lambda e: f"entry {e.id}",
        )  # fmt: skip
        return AuditReply(entries=page.items, next=page.next)

    async def operator_list(self, _: OperatorsRequest) -> OperatorsReply:
        rows = await audit.operators(self.pool)
        return OperatorsReply(
            operators=[
                OperatorInfo(name=r.name, role=r.role, modules=r.modules, allow=r.allow)
                for r in rows
            ]
        )


@dataclass(frozen=True)
class Operating:
    """What an operator's verb is given: the parts served, and who asked (None: not
    verified)."""

    parts: Parts
    who: str | None


def operating(parts: Parts, subject: str) -> Operating:
    """The caller of `mesh.op.<name>.<verb>`: the name is checked, then believed (the server
    let only that operator publish there)."""
    name = wire.subject_name(subjects.op_operator(subject), field="operator")
    return Operating(parts=parts, who=name)


def unverified(parts: Parts, subject: str) -> Operating:
    """The caller of `mesh.ctl.<verb>`: nobody verified."""
    return Operating(parts=parts, who=None)


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


async def _allowed(t: Trust, who: str | None, verb: str, role: Role, req: Any) -> Any:
    """Refuse (`forbidden`) a change this operator may not ask for; the request as it is
    served (a deployer's new secret is for its own modules)."""
    if who is None:
        if t.secured:
            raise wire.BadRequest(
                f"forbidden: a change is asked on the operator's own subject "
                f"({subjects.op('<operator>', verb)}), with an operator's credentials",
                code="forbidden",
            )
        return req
    row = await audit.operator(t.pool, who)
    if row is None or row.removed:
        raise wire.BadRequest(
            f"forbidden: operator {who} is {'removed' if row else 'not known to the mesh'}",
            code="forbidden",
        )
    if row.role == "admin":
        return req
    agent = row.role == "agent" and verb in AGENT_VERBS
    if (row.role != "deployer" and not agent) or role != "deployer":
        raise wire.BadRequest(
            f"forbidden: operator {who} ({row.role}) may not {verb}"
            + (": an agent proposes changes, a person steers them" if row.role == "agent" else ""),
            code="forbidden",
        )  # fmt: skip
    if agent and getattr(req, "hold", True) is False:  # every change it asks is held
        req = msgspec.structs.replace(req, hold=True)
    glob = row.modules or "*"
    if verb in SECRET_VERBS:
        return await _deployer_secret(t, who, glob, req)
    module = await _module_for_deployer(t, verb, req)
    if not fnmatch.fnmatchcase(module, glob):
        raise wire.BadRequest(
            f"forbidden: operator {who} may {verb} only modules matching {glob!r}, "
            f"not module {module}",
            code="forbidden",
        )
    return req


SECRET_VERBS = ("secret-set", "secret-delete")  # a deployer's for its own modules' secrets


def _within(modules: str | None, glob: str) -> bool:
    """`modules` (a secret's scope) names only modules `glob` matches: the glob itself, or
    one module's name it matches."""
    if modules is None:
        return False
    literal = not any(c in modules for c in "*?[")
    return modules == glob or (literal and fnmatch.fnmatchcase(modules, glob))


async def _deployer_secret(t: Trust, who: str, glob: str, req: Any) -> Any:
    """A deployer sets or deletes only its own modules' secrets: one not set yet, one it set
    last, or one for modules its glob matches; and gives one to no module beyond its glob. A
    new one, without --modules, is for its glob's modules."""
    name = req.name
    if name in CONTROLLER_SECRETS:
        raise wire.BadRequest(
            f"forbidden: secret {name} is the controller's: an admin's to set", code="forbidden"
        )
    scope = (await secrets.scopes(t.pool, [name])).get(name)
    if scope is not None and scope.set_by != who and not _within(scope.modules, glob):
        whose = (
            f"for modules {scope.modules!r}" if scope.modules else f"{scope.set_by or 'an admin'}'s"
        )
        raise wire.BadRequest(
            f"forbidden: secret {name} is {whose}: operator {who} may change only secrets of "
            f"modules matching {glob!r}", code="forbidden",
        )  # fmt: skip
    given = getattr(req, "modules", None)
    if given is not None and not _within(given, glob):
        raise wire.BadRequest(
            f"forbidden: modules: {given!r} reaches beyond operator {who}'s modules ({glob!r}): "
            f"give {glob!r} or one module's name", code="forbidden",
        )  # fmt: skip
    if hasattr(req, "modules") and given is None and (scope is None or scope.modules is None):
        return msgspec.structs.replace(req, modules=glob)
    return req


def _detail(reply: Any) -> str:
    plan = getattr(reply, "plan", None)
    if isinstance(plan, int):
        return f"plan {plan}"
    message = getattr(reply, "message", None)
    return message[:200] if isinstance(message, str) else ""


def _guarded(name: str, served: Served) -> Callable[[Operating, Any], Awaitable[Any]]:
    """The verb's method as operators ask it: a read as it is; a change checked, its `by`
    the verified operator, given its `Audit` (written in its transaction, or once answered;
    a refusal on its own)."""
    owner, method, takes_audit = served.owner, served.method, served.takes_audit
    if served.role == "reader":

        async def read(o: Operating, req: Any) -> Any:
            return await method(o.parts.of(owner), req)

        return read

    async def change(o: Operating, req: Any) -> Any:
        t = o.parts.of(Trust)
        who = o.who or ANONYMOUS
        asked = Audit(who=who, verb=name, subject=subject_of(name, req), epoch=t.epoch)
        try:
            req = await _allowed(t, o.who, name, served.role, req)
            if hasattr(req, "by"):  # never the client's word
                req = msgspec.structs.replace(req, by=who)
            part = o.parts.of(owner)
            reply = await (method(part, req, asked) if takes_audit else method(part, req))
        except wire.BadRequest as e:
            if served.audited:
                await _refused(t, asked, e.code, str(e))
            raise
        except Exception as e:  # answered `internal` (mesh.bus.answer): recorded as such
            if served.audited:
                await _refused(t, asked, "internal", type(e).__name__)
            raise
        if served.audited and not asked.written:
            await audit.record(t.pool, who=who, verb=name, subject=asked.subject, outcome="ok",
                               detail=_detail(reply), epoch=t.epoch)  # fmt: skip
        return reply

    return change


async def _refused(t: Trust, asked: Audit, code: str, message: str) -> None:
    """A refusal's entry, on its own (the change's transaction, if any, was rolled back)."""
    try:
        await audit.record(t.pool, who=asked.who, verb=asked.verb, subject=asked.subject,
                           outcome=code, detail=message[:500], epoch=t.epoch)  # fmt: skip
    except (OSError, asyncpg.PostgresError) as e:
        log.warning("could not record the refusal of %s by %s: %s", asked.verb, asked.who, e)


def as_operators(table: Mapping[str, Served]) -> dict[str, Verb[Operating, Any, Any]]:
    """The verb table as operators ask it: each verb's method given an `Operating`
    (`operating` or `unverified` as the endpoint's caller), changes checked and audited."""
    return {name: _verb(name, s) for name, s in table.items()}


def _verb(name: str, s: Served) -> Verb[Operating, Any, Any]:
    return Verb(s.request, s.reply, _guarded(name, s), limit=s.limit, bound=s.bound,
                too_large=s.too_large)  # fmt: skip
