"""The controller's verbs: fixed tables from name to Verb (request, reply, limit, handler).

Nothing is dispatched by a name taken from a message (Salt CVE-2020-11651): the subject's verb
token is only ever a key into these tables. Every body is decoded strictly (mesh/serving.py); a
bad one gets an error reply naming what was wrong and the controller keeps serving.
"""

from collections.abc import Callable

import anyio.lowlevel
import msgspec
from anyio.abc import TaskGroup

from mesh import paging, subjects, wire
from mesh.auth.policy import READ_VERBS
from mesh.model import (
    AssignRequest,
    AuditReply,
    AuditRequest,
    BuildLogsReply,
    BuildLogsRequest,
    ChangeReply,
    DeclarationReply,
    DeclarationRequest,
    DiffReply,
    DiffRequest,
    DrainReply,
    DrainRequest,
    FolderChangeReply,
    FolderChangeRequest,
    Handover,
    HandoverReply,
    HandoverRequest,
    HistoryReply,
    HistoryRequest,
    JoinedKeyReply,
    JoinedKeyRequest,
    JoinReply,
    JoinRequest,
    LabelReply,
    LabelRequest,
    ModulesReply,
    ModulesRequest,
    NodesReply,
    NodesRequest,
    OperatorAddRequest,
    OperatorRemoveRequest,
    OperatorReply,
    OperatorsReply,
    OperatorsRequest,
    PlanReply,
    PlanRequest,
    PlansReply,
    PlansRequest,
    PushRequest,
    Register,
    RegisterReply,
    RollbackRequest,
    RotateKeyReply,
    RotateKeyRequest,
    SeatInfo,
    SecretReply,
    SecretRequest,
    SecretSetRequest,
    StatusReply,
    StatusRequest,
    SteerReply,
    SteerRequest,
    TierReply,
    TierRequest,
    TokenCreated,
    TokenCreateRequest,
    TokenListReply,
    TokenListRequest,
    TokenRevokeReply,
    TokenRevokeRequest,
    ToolsReply,
    ToolsRequest,
)
from mesh.serving import Bound, Endpoint, Verb
from mesh.store import modules as catalog
from services.controller.changes.machines import Drains
from services.controller.changes.modules import Changes
from services.controller.changes.secrets import SecretChanges
from services.controller.fleet import joining, tokens
from services.controller.fleet.admission import Admission
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.publishing import MAX_DECLARATION, Publisher
from services.controller.plans.approvals import HeldChanges
from services.controller.plans.planner import Planner
from services.controller.plans.steering import Steering
from services.controller.seat.standbys import Standbys
from services.controller.serving.views import Views
from services.controller.trust import operators

# Slow verbs served at once. They share a store pool of 4 connections (and builds): more in
# flight only queue inside the controller, holding memory and their callers' time, so past
# this many a slow verb is answered `busy` at once and the caller tries again (`mesh` does).
SLOW_IN_FLIGHT = 16
# Secrets served at once: side by side rather than one behind another (and behind a store
# stall); past this many the rest wait in the subscription's buffer, in the order they came.
HOST_IN_FLIGHT = 32
HOST_SLOT_WAIT = 5.0  # longer than a host's attempt (2 s): it has asked again by then
# Registrations waiting for their batch (services/controller/fleet/fleet.py): a waiting one costs a
# future and its request, so a whole takeover's storm may wait at once.
REGISTRATIONS_IN_FLIGHT = 20_000
SLOW = Bound("slow verbs", SLOW_IN_FLIGHT)
HOST_REQUESTS = Bound("host requests", HOST_IN_FLIGHT, wait=HOST_SLOT_WAIT)
# Past that many, `busy` at once (the host backs off, services/host/registration.py): waiting
# for a slot would hold the subscription, and a storm would overflow its buffer.
REGISTRATIONS = Bound("registrations", REGISTRATIONS_IN_FLIGHT)


class Holder(msgspec.Struct):
    """What the verbs need of the controller that holds the seat."""

    seat: SeatInfo  # fixed for as long as this controller holds the seat
    fleet: Fleet
    standbys: Standbys
    changes: Changes  # the catalog's: push, assign, rollback (changes.py)
    approvals: HeldChanges  # a held plan approved (approvals.py)
    secrets: SecretChanges  # a secret set, the key of the secrets rotated (secretchanges.py)
    drains: Drains  # a machine out of every plan and back (draining.py)
    views: Views
    publisher: Publisher
    planner: Planner
    tasks: TaskGroup  # where verbs that wait on the store or a build run, off the hot path
    handover: Handover  # how this controller came to hold the seat
    stop: Callable[[], None]  # start a handover (the `handover` verb)
    steering: Steering  # pause, resume, cancel a plan (approve is a change: `approvals`)
    trust: operators.Trust  # who asked, what it may change, the audit log (operators.py)
    admission: Admission | None = None  # signs a joining machine's credentials (admission.py)


class Asking(msgspec.Struct, frozen=True):
    """A host's request: the holder, and the machine its subject names (checked)."""

    holder: Holder
    machine: str


def asking(h: Holder, subject: str) -> Asking:
    machine = wire.subject_name(subjects.ctl_host_machine(subject), field="machine")
    return Asking(holder=h, machine=machine)


async def status(h: Holder, _: StatusRequest) -> StatusReply:
    return StatusReply(
        seat=h.seat,
        standbys=h.standbys.current(),
        nodes=h.fleet.counts(),
        plan=h.planner.current,
        handover=h.handover,
    )


async def hand_over(h: Holder, _: HandoverRequest) -> HandoverReply:
    """Answered first; the handover starts once the reply is out."""
    standbys = [s.instance for s in h.standbys.current()]
    if not standbys:
        raise wire.BadRequest(
            "no standby controller to hand the seat to (start one: mesh controller run)",
            code="no_standby",
        )
    h.tasks.start_soon(_after_reply, h.stop)
    return HandoverReply(
        holder=h.seat.holder, to=standbys,
        message=f"{h.seat.holder} hands the seat over to a standby ({', '.join(standbys)})",
    )  # fmt: skip


async def _after_reply(stop: Callable[[], None]) -> None:
    await anyio.lowlevel.checkpoint()  # let the reply go out first
    stop()


async def nodes(h: Holder, req: NodesRequest) -> NodesReply:
    return h.views.nodes(req)


async def tools(h: Holder, req: ToolsRequest) -> ToolsReply:
    return h.views.tools(req)


async def register(a: Asking, req: Register) -> RegisterReply:
    if req.name != a.machine:
        raise wire.BadRequest(
            f"name: {req.name!r} differs from the subject's machine {a.machine!r}",
            code="forbidden",
        )
    row = await a.holder.fleet.register(req)
    return RegisterReply(name=row.name, tier=row.tier, epoch=a.holder.seat.epoch, labels=row.labels)


async def push(h: Holder, req: PushRequest) -> ChangeReply:
    return await h.changes.push(req)


async def assign(h: Holder, req: AssignRequest) -> ChangeReply:
    return await h.changes.assign(req)


async def unassign(h: Holder, req: AssignRequest) -> ChangeReply:
    return await h.changes.assign(req, undo=True)


async def modules(h: Holder, req: ModulesRequest) -> ModulesReply:
    return await h.views.modules(req)


async def declaration(h: Holder, req: DeclarationRequest) -> DeclarationReply:
    return await h.views.declaration(req.machine)


async def secret_set(h: Holder, req: SecretSetRequest) -> ChangeReply:
    return await h.secrets.secret_set(req)


async def diff(h: Holder, req: DiffRequest) -> DiffReply:
    return await h.views.diff(req)


async def build_logs(h: Holder, req: BuildLogsRequest) -> BuildLogsReply:
    return await h.views.build_logs(req)


async def plan(h: Holder, req: PlanRequest) -> PlanReply:
    return await h.views.plan(req)


async def plans(h: Holder, req: PlansRequest) -> PlansReply:
    return await h.views.plans(req)


# --- steering a plan (steering.py; approving is a catalog change, changes.py) -----------------


async def plan_approve(h: Holder, req: SteerRequest) -> SteerReply:
    reply = await h.approvals.approve(req)
    await h.planner.tell(req.id)
    return reply


async def plan_pause(h: Holder, req: SteerRequest) -> SteerReply:
    return await h.steering.pause(req)


async def plan_resume(h: Holder, req: SteerRequest) -> SteerReply:
    return await h.steering.resume(req)


async def plan_cancel(h: Holder, req: SteerRequest) -> SteerReply:
    return await h.steering.cancel(req)


async def tier(h: Holder, req: TierRequest) -> TierReply:
    was, registered = await h.fleet.set_tier(req.machine, req.tier)
    return TierReply(machine=req.machine, tier=req.tier, was=was, registered=registered)


async def label(h: Holder, req: LabelRequest) -> LabelReply:
    labels, was, registered = await h.fleet.set_labels(req.machine, add=req.set, remove=req.remove)
    return LabelReply(machine=req.machine, labels=labels, was=was, registered=registered)


async def history(h: Holder, req: HistoryRequest) -> HistoryReply:
    return await h.views.history(req)


async def rollback(h: Holder, req: RollbackRequest) -> ChangeReply:
    return await h.changes.rollback(req)


async def drain(h: Holder, req: DrainRequest) -> DrainReply:
    return await h.drains.drain(req)


async def undrain(h: Holder, req: DrainRequest) -> DrainReply:
    return await h.drains.drain(req, undo=True)


async def audit(h: Holder, req: AuditRequest) -> AuditReply:
    return await operators.audit_log(h.trust, req)


async def operator_add(h: Holder, req: OperatorAddRequest) -> OperatorReply:
    return await operators.operator_add(h.trust, req)


async def operator_remove(h: Holder, req: OperatorRemoveRequest) -> OperatorReply:
    reply = await operators.operator_remove(h.trust, req)
    if not req.revert or reply.brought is None:
        return reply
    reverted = []
    for module in reply.brought.modules:
        async with h.trust.pool.acquire() as conn:
            assigned = await catalog.assignments(conn)
        on = sorted(m for m, mods in assigned.items() if module in mods)
        if not on:
            continue
        with operators.asked_as("unassign", module):
            done = await h.changes.assign(AssignRequest(module=module, machines=on), undo=True)
        reverted += [done.plan] if done.plan is not None else []
    return msgspec.structs.replace(reply, reverted=reverted)


async def folder_change(h: Holder, req: FolderChangeRequest) -> FolderChangeReply:
    return await operators.folder_change(h.trust, req)


async def operator_list(h: Holder, req: OperatorsRequest) -> OperatorsReply:
    return await operators.operator_list(h.trust, req)


# Bytes of body per verb (docs/verbs.md, Limits); nats-server's max_payload (1 MiB) caps them all.
_SMALL = 4 * 1024  # names and numbers
_MODULE_BODY = 640 * 1024  # a manifest of up to 256 KiB, JSON-escaped; thousands of names
_SECRET_BODY = 768 * 1024  # a secret of up to 512 KiB, as base64

_PAGED = paging.HINT  # what a too_large reply of a verb that pages says (mesh/paging.py)


async def secret_rotate_key(h: Holder, req: RotateKeyRequest) -> RotateKeyReply:
    return await h.secrets.secret_rotate_key(req)


async def token_create(h: Holder, req: TokenCreateRequest) -> TokenCreated:
    made = await tokens.create(h.trust, req)
    bearer = h.admission.bearer(made.id, expires=made.expires) if h.admission else None
    return TokenCreated(**msgspec.structs.asdict(made), bearer=bearer)


async def joined_forget(h: Holder, req: JoinedKeyRequest) -> JoinedKeyReply:
    return await joining.joined_forget(h.trust, req)


async def token_list(h: Holder, req: TokenListRequest) -> TokenListReply:
    return await tokens.listing(h.trust, req)


async def token_revoke(h: Holder, req: TokenRevokeRequest) -> TokenRevokeReply:
    return await tokens.revoke(h.trust, req)


VERBS: dict[str, Verb] = {
    "status": Verb(StatusRequest, StatusReply, status, limit=_SMALL),
    "nodes": Verb(NodesRequest, NodesReply, nodes, limit=_SMALL, too_large=_PAGED),
    # from memory, like nodes; a page at a time (`after`, `next`)
    "tools": Verb(ToolsRequest, ToolsReply, tools, limit=_SMALL, too_large=_PAGED),
    "push": Verb(PushRequest, ChangeReply, push, bound=SLOW, limit=_MODULE_BODY),
    "diff": Verb(DiffRequest, DiffReply, diff, bound=SLOW, limit=_MODULE_BODY, too_large=_PAGED),
    "assign": Verb(AssignRequest, ChangeReply, assign, bound=SLOW, limit=_MODULE_BODY),
    "unassign": Verb(AssignRequest, ChangeReply, unassign, bound=SLOW, limit=_MODULE_BODY),
    "modules": Verb(
        ModulesRequest, ModulesReply, modules, bound=SLOW, limit=_SMALL, too_large=_PAGED
    ),
    # A declaration is at most MAX_DECLARATION (768 KiB): it fits a reply on a server of the
    # default max_payload (1 MiB); only a smaller one can refuse it.
    "declaration": Verb(
        DeclarationRequest,
        DeclarationReply,
        declaration,
        bound=SLOW,
        limit=_SMALL,
        too_large=f"a declaration may be {MAX_DECLARATION} bytes: the NATS server's "
        "max_payload must be larger than that",
    ),
    "secret-set": Verb(SecretSetRequest, ChangeReply, secret_set, bound=SLOW, limit=_SECRET_BODY),
    "build-logs": Verb(BuildLogsRequest, BuildLogsReply, build_logs, bound=SLOW, limit=_SMALL),
    "plan": Verb(PlanRequest, PlanReply, plan, bound=SLOW, limit=_SMALL, too_large=_PAGED),
    "plans": Verb(PlansRequest, PlansReply, plans, bound=SLOW, limit=_SMALL, too_large=_PAGED),
    "tier": Verb(TierRequest, TierReply, tier, bound=SLOW, limit=_SMALL),
    # up to 64 labels: as a registration
    "label": Verb(LabelRequest, LabelReply, label, bound=SLOW),
    "handover": Verb(HandoverRequest, HandoverReply, hand_over, limit=_SMALL),
    # Steering a plan (docs/verbs.md): admins' verbs, as every verb not in READ_VERBS.
    "plan-approve": Verb(SteerRequest, SteerReply, plan_approve, bound=SLOW, limit=_SMALL),
    "plan-pause": Verb(SteerRequest, SteerReply, plan_pause, bound=SLOW, limit=_SMALL),
    "plan-resume": Verb(SteerRequest, SteerReply, plan_resume, bound=SLOW, limit=_SMALL),
    "plan-cancel": Verb(SteerRequest, SteerReply, plan_cancel, bound=SLOW, limit=_SMALL),
    # going back, and machines out of the plans (docs/operations.md, Steering a change)
    "history": Verb(
        HistoryRequest, HistoryReply, history, bound=SLOW, limit=_SMALL, too_large=_PAGED
    ),
    "rollback": Verb(RollbackRequest, ChangeReply, rollback, bound=SLOW, limit=_SMALL),
    "drain": Verb(DrainRequest, DrainReply, drain, bound=SLOW, limit=_SMALL),
    "undrain": Verb(DrainRequest, DrainReply, undrain, bound=SLOW, limit=_SMALL),
    # trust (issue 28, docs/security.md): the audit log, and the operators the mesh records
    "audit": Verb(AuditRequest, AuditReply, audit, bound=SLOW, limit=_SMALL, too_large=_PAGED),
    "operators": Verb(OperatorsRequest, OperatorsReply, operator_list, bound=SLOW, limit=_SMALL),
    "operator-add": Verb(OperatorAddRequest, OperatorReply, operator_add, bound=SLOW, limit=_SMALL),
    "operator-remove": Verb(
        OperatorRemoveRequest, OperatorReply, operator_remove, bound=SLOW, limit=_SMALL
    ),
    # machine add/remove and cert rotate, done on the mesh's folder: their audit entries
    "folder-change": Verb(
        FolderChangeRequest, FolderChangeReply, folder_change, bound=SLOW, limit=_SMALL
    ),
    # the key of the secrets (`mesh secret rotate-key`): an admin's, one change at a time
    "secret-rotate-key": Verb(
        RotateKeyRequest, RotateKeyReply, secret_rotate_key, bound=SLOW, limit=_SMALL
    ),
    # join tokens (services/controller/fleet/tokens.py): admins' alone, listing them too (not in
    # READ_VERBS: who may join, and how, is not a viewer's to read); up to 64 labels
    "token-create": Verb(TokenCreateRequest, TokenCreated, token_create, bound=SLOW),
    # a joined machine's key, forgotten for `mesh machine remove` to revoke (joining.py)
    "joined-forget": Verb(
        JoinedKeyRequest, JoinedKeyReply, joined_forget, bound=SLOW, limit=_SMALL
    ),
    "token-list": Verb(
        TokenListRequest, TokenListReply, token_list, bound=SLOW, limit=_SMALL, too_large=_PAGED
    ),
    "token-revoke": Verb(
        TokenRevokeRequest, TokenRevokeReply, token_revoke, bound=SLOW, limit=_SMALL
    ),
}
# As operators ask them: a change checked against who asked, its `by` that operator, audited.
OPERATOR_VERBS = operators.as_operators(VERBS, trust=lambda h: h.trust)
# On an operator's own subjects, the changes (reads are asked on mesh.ctl.<verb>: listing them
# twice would count each in two places, in discovery's stats and the metrics).
OWN_VERBS = {name: v for name, v in OPERATOR_VERBS.items() if name not in READ_VERBS}


async def host_secret(a: Asking, req: SecretRequest) -> SecretReply:
    return await a.holder.views.secret_for(a.machine, req.name)


# Host requests are served side by side, each in its own task (a slow `secret` does not hold
# up a `register`), started in the order they came: at most HOST_IN_FLIGHT secrets, and every
# registration that comes, waiting for the fleet to write it with the others in one batch.
# Neither verb needs more order than that: each reply goes to its own request. A host's
# applied/processes reports, which must stay in order, have a subscription of their own
# (reports.py) and are not served here.
HOST_VERBS: dict[str, Verb] = {
    "register": Verb(Register, RegisterReply, register, bound=REGISTRATIONS),
    "secret": Verb(SecretRequest, SecretReply, host_secret, bound=HOST_REQUESTS, limit=_SMALL),
}

# What may wait in the host requests' subscription (nats-py's pending limits): a takeover's
# storm of registrations (REGISTRATIONS_IN_FLIGHT) fits; a flood past it is dropped by nats-py,
# not queued for minutes (whose answers the server would refuse as too late, each a line).
HOST_PENDING = (REGISTRATIONS_IN_FLIGHT, 32 * 1024 * 1024)

# The controller's subscriptions, in the `mesh-controller` queue group (handover.py): the
# operators' verbs on the controller's connection, the hosts' requests on the hosts' own, with
# their beats and reports (docs/architecture.md, the hosts' traffic).
VERB_ENDPOINTS = (
    Endpoint(
        "verbs",
        subjects.CTL_VERBS,
        OPERATOR_VERBS,
        queue=subjects.QUEUE,
        caller=operators.unverified,
    ),
    # mesh.op.<operator>.<verb>: only that operator may publish there (docs/security.md)
    Endpoint(
        "operator-verbs",
        subjects.OP_VERBS,
        OWN_VERBS,
        queue=subjects.QUEUE,
        caller=operators.operating,
    ),
)
# A machine joining with a token: its request, on the hosts' connection with theirs.
JOIN_VERBS: dict[str, Verb] = {
    "join": Verb(JoinRequest, JoinReply, joining.join, bound=HOST_REQUESTS, limit=_SMALL),
}
HOST_ENDPOINTS = (
    Endpoint(
        "host-requests",
        subjects.CTL_HOST_VERBS,
        HOST_VERBS,
        queue=subjects.QUEUE,
        caller=asking,
        what="host verb",
        pending=HOST_PENDING,
    ),
    Endpoint(
        "join",
        subjects.JOIN_VERBS,
        JOIN_VERBS,
        queue=subjects.QUEUE,
        caller=joining.joining,
        what="join verb",
    ),
)
ENDPOINTS = (*VERB_ENDPOINTS, *HOST_ENDPOINTS)  # as discovery lists them
