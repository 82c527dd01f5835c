"""The controller's verbs: a fixed table naming, for each, the method that serves it (a part's,
found by its class among the holder's parts: mesh/serving.py's `Parts`), its request and reply,
who may ask it, and its bounds; as nats.py's `micro` binds a handler into its endpoint config.

Nothing is dispatched by a name taken from a message (Salt CVE-2020-11651): the subject's verb
token is only ever a key into these tables. Every body is decoded strictly (mesh/serving.py); a
bad one gets an error reply naming what was wrong and the controller keeps serving. A change is
checked against who asked and given its `Audit` by trust/operators.py.
"""

import msgspec

from mesh import paging, subjects, wire
from mesh.auth.policy import READ_VERBS
from mesh.model import (
    JoinReply,
    JoinRequest,
    Register,
    RegisterReply,
    SecretReply,
    SecretRequest,
)
from mesh.serving import Bound, Endpoint, Parts, Verb
from services.controller.changes.machines import Machines
from services.controller.changes.modules import Changes
from services.controller.changes.operators import Operators
from services.controller.changes.policy import PolicyChanges
from services.controller.changes.restarts import Restarts
from services.controller.changes.secrets import SecretChanges
from services.controller.fleet import joining
from services.controller.fleet.joining import Joins
from services.controller.fleet.publishing import MAX_DECLARATION
from services.controller.fleet.registering import Registrations
from services.controller.fleet.tokens import Tokens
from services.controller.plans.approvals import HeldChanges
from services.controller.plans.steering import Steering
from services.controller.serving.holding import Holding
from services.controller.serving.views import Views
from services.controller.trust import operators
from services.controller.trust.operators import Served, Trust

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


# Bytes of body per verb (docs/verbs.md, Limits); nats-server's max_payload (1 MiB) caps them all.
_SMALL = 4 * 1024  # names and numbers
_MODULE_BODY = 640 * 1024  # a manifest of up to 256 KiB, JSON-escaped; thousands of names
_SECRET_BODY = 768 * 1024  # a secret of up to 512 KiB, as base64

_PAGED = paging.HINT  # what a too_large reply of a verb that pages says (mesh/paging.py)

# Who may ask (docs/security.md): `reader`, the verbs of mesh/auth/policy.py's READ_VERBS;
# `deployer`, its DEPLOYER_VERBS, on the modules a deployer's glob matches; `admin` the rest
# (tests/test_trust.py checks that the table and the policy agree).
TABLE: dict[str, Served] = {
    "status": Served(Holding.status, "reader", limit=_SMALL),
    "nodes": Served(Views.nodes, "reader", limit=_SMALL, too_large=_PAGED),
    # from memory, like nodes; a page at a time (`after`, `next`)
    "tools": Served(Views.tools, "reader", limit=_SMALL, too_large=_PAGED),
    "push": Served(Changes.push, "deployer", SLOW, _MODULE_BODY),
    # the dry run of a push: it changes nothing, so the audit keeps nothing of it
    "diff": Served(Views.diff, "deployer", SLOW, _MODULE_BODY, _PAGED, audited=False),
    "assign": Served(Changes.assign, "deployer", SLOW, _MODULE_BODY),
    "unassign": Served(Changes.unassign, "deployer", SLOW, _MODULE_BODY),
    # a plan restarting a module's processes tier by tier (changes/restarts.py)
    "restart": Served(Restarts.restart, "deployer", SLOW, _MODULE_BODY),
    "modules": Served(Views.modules, "reader", SLOW, _SMALL, _PAGED),
    # A declaration is at most MAX_DECLARATION (768 KiB): it fits a reply on a server of the
    # default max_payload (1 MiB); only a smaller one can refuse it.
    "declaration": Served(
        Views.declaration, "reader", SLOW, _SMALL,
        too_large=f"a declaration may be {MAX_DECLARATION} bytes: the NATS server's "
        "max_payload must be larger than that",
    ),
    # a deployer's for its own modules' secrets (trust/operators.py)
    "secret-set": Served(SecretChanges.secret_set, "deployer", SLOW, _SECRET_BODY),
    "secret-delete": Served(SecretChanges.secret_delete, "deployer", SLOW, _SMALL),
    "secrets": Served(Views.secrets, "reader", SLOW, _SMALL, _PAGED),
    "build-logs": Served(Views.build_logs, "reader", SLOW, _SMALL),
    "plan": Served(Views.plan, "reader", SLOW, _SMALL, _PAGED),
    "plans": Served(Views.plans, "reader", SLOW, _SMALL, _PAGED),
    "tier": Served(Machines.tier, "admin", SLOW, _SMALL),
    "label": Served(Machines.label, "admin", SLOW),  # up to 64 labels: as a registration
    "handover": Served(Holding.hand_over, "admin", limit=_SMALL),
    # Steering a plan (docs/verbs.md): approving makes a held change (plans/approvals.py)
    "plan-approve": Served(HeldChanges.approve, "deployer", SLOW, _SMALL),
    "plan-pause": Served(Steering.pause, "deployer", SLOW, _SMALL),
    "plan-resume": Served(Steering.resume, "deployer", SLOW, _SMALL),
    "plan-cancel": Served(Steering.cancel, "deployer", SLOW, _SMALL),
    "plan-reject": Served(HeldChanges.reject, "deployer", SLOW, _SMALL),  # a held one, ended
    # what a held plan needs before it runs (`mesh policy`): approvals by distinct operators
    "policy": Served(Views.policy, "reader", SLOW, _SMALL),
    "policy-set": Served(PolicyChanges.policy_set, "admin", SLOW, _SMALL),
    # going back, and machines out of the plans (docs/operations.md, Steering a change)
    "history": Served(Views.history, "reader", SLOW, _SMALL, _PAGED),
    "version-diff": Served(Views.version_diff, "reader", SLOW, _SMALL),
    "rollback": Served(Changes.rollback, "deployer", SLOW, _SMALL),
    "drain": Served(Machines.drain, "admin", SLOW, _SMALL),
    "undrain": Served(Machines.undrain, "admin", SLOW, _SMALL),
    # trust (docs/security.md): the audit log, and the operators the mesh records
    "audit": Served(Trust.audit_log, "reader", SLOW, _SMALL, _PAGED),
    "operators": Served(Trust.operator_list, "reader", SLOW, _SMALL),
    "operator-add": Served(Operators.add, "admin", SLOW, _SMALL),
    "operator-remove": Served(Operators.remove, "admin", SLOW, _SMALL),
    # machine add/remove and cert rotate, done on the mesh's folder: their audit entries
    "folder-change": Served(Operators.folder_change, "admin", SLOW, _SMALL),
    # the key of the secrets (`mesh secret rotate-key`): an admin's, one change at a time
    "secret-rotate-key": Served(SecretChanges.secret_rotate_key, "admin", SLOW, _SMALL),
    # join tokens (services/controller/fleet/tokens.py): admins' alone, listing them too (who
    # may join, and how, is not a viewer's to read; a listing changes nothing: not audited);
    # up to 64 labels
    "token-create": Served(Tokens.create, "admin", SLOW),
    "token-list": Served(Tokens.listing, "admin", SLOW, _SMALL, _PAGED, audited=False),
    "token-revoke": Served(Tokens.revoke, "admin", SLOW, _SMALL),
    # a joined machine's key, forgotten for `mesh machine remove` to revoke (joining.py)
    "joined-forget": Served(Joins.forget, "admin", SLOW, _SMALL),
}  # fmt: skip
# As operators ask them: a change checked against who asked, its `by` that operator, audited.
VERBS = operators.as_operators(TABLE)
# On an operator's own subjects, the changes (reads are asked on mesh.ctl.<verb>: listing them
# twice would count each in two places, in discovery's stats and the metrics).
OWN_VERBS = {name: v for name, v in VERBS.items() if name not in READ_VERBS}


class Asking(msgspec.Struct, frozen=True):
    """A host's request: the holder's parts, and the machine its subject names (checked)."""

    parts: Parts
    machine: str


def asking(parts: Parts, subject: str) -> Asking:
    machine = wire.subject_name(subjects.ctl_host_machine(subject), field="machine")
    return Asking(parts=parts, machine=machine)


async def register(a: Asking, req: Register) -> RegisterReply:
    if req.name != a.machine:
        raise wire.BadRequest(
            f"name: {req.name!r} differs from the subject's machine {a.machine!r}",
            code="forbidden",
        )
    row = await a.parts.of(Registrations).register(req)
    epoch = a.parts.of(Holding).seat.epoch
    return RegisterReply(name=row.name, tier=row.tier, epoch=epoch, labels=row.labels)


async def host_secret(a: Asking, req: SecretRequest) -> SecretReply:
    """A secret the machine's declaration names, checked again as it is served (views.py)."""
    return await a.parts.of(Views).secret_for(a.machine, req.name)


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
        VERBS,
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
