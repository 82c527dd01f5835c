"""What each identity on the mesh's NATS may publish and subscribe to: the one place the
permissions are decided (docs/security.md explains them).

- a **host** `<name>` speaks only on subjects scoped by its own name (Kubernetes
  NodeRestriction): its requests to the controller, its beat, its events, replies to its own
  verbs; it hears only its own verbs, the seat's announcements and its own inbox; it reads its
  own declaration and the bundle store; a builder host also writes to the bundle store;
- the **controller** (every instance shares one identity) serves every verb and owns JetStream;
- an **operator** is an `admin` (every verb), a `deployer` (reads, and push, diff, assign,
  unassign, rollback and steering plans: the controller limits those to the modules its glob
  matches, and what they ask of a machine: mesh/auth/scopes.py; of JetStream, only the uploads'
  bucket its pushes write to), a `viewer` (the verbs that only read, `tools` included: a viewer
  lists the fleet's tools but calls none) or a `tools` operator (lists and calls the fleet's tools,
  `mesh.host.<name>.tool`, and reads what that needs; changes nothing).

Reads are asked on `mesh.ctl.<verb>`; every other verb only on the operator's own subjects,
`mesh.op.<name>.<verb>`, which no other identity may publish on: the name there is the operator
the server authenticated, and the controller records it (docs/security.md, who asked).

The controller never decides who may call a verb from anything in the message: the server
enforces these lists, so a viewer's `push` never reaches it.
"""

from typing import Literal

import msgspec

from mesh import subjects
from mesh.blobs import BUILDS, BUNDLES, DECLARATIONS, SEAT, UPLOADS

Kind = Literal["host", "controller", "operator"]
Role = Literal["admin", "deployer", "viewer", "tools", "agent"]
ROLES: tuple[Role, ...] = ("admin", "deployer", "viewer", "tools", "agent")

# The controller verbs that only read. Every other verb, including one added later and not
# listed here, is for admins only: a new verb fails closed.
READ_VERBS = frozenset(
    {"status", "nodes", "plan", "plans", "modules", "declaration", "build-logs", "tools"}
    | {"history", "version-diff"}  # a module's versions (issue 27), and what changed
    | {"secrets"}  # the secrets that are set, never a value
    | {"audit", "operators"}  # who did what, and who may (issue 28)
    | {"policy"}  # what a held plan needs before it runs
)
# What a deployer may ask on its own subjects: changes of the modules its glob matches (the
# controller checks the module: services/controller/trust/operators.py), and the dry run of a push.
DEPLOYER_VERBS = (
    "push", "diff", "assign", "unassign", "rollback", "restart",
    "plan-approve", "plan-pause", "plan-resume", "plan-cancel", "plan-reject",
    "secret-set", "secret-delete",  # its own modules' secrets
)  # fmt: skip
# What an agent may ask on its own subjects: to propose a deployer's changes of the modules its
# glob matches, each recorded held until a person approves it (the controller sees to it: never
# approve, pause, resume, cancel, roll back, drain, operators or secrets).
AGENT_VERBS = ("push", "diff", "assign", "unassign", "restart")
HOST_READ_VERBS = ("status", "logs")  # mesh.host.<name>.<verb> an operator may ask
HOST_ADMIN_VERBS = ("restart",)
HOST_TOOL_VERBS = ("tool",)  # calling a tool: an admin's and a tools operator's
# What a `tools` operator (mesh mcp, an agent's credentials) may ask the controller: the fleet's
# tools, and what says which machines are there and up.
TOOLS_READ_VERBS = ("status", "nodes", "tools")
# What an operator may hear (the console's live view): hosts' beats and reports, the seat's
# announcements, plans' progress, machines drained or undrained. All of it is in what the read
# verbs answer anyway.
OPERATOR_WATCH = (
    subjects.HOST_BEATS,
    subjects.EVENTS,
    subjects.SEAT_EVENTS,
    subjects.PLANS,
    subjects.MACHINES,
)
# What a host may ask of the controller's operator verbs: the controller module's own health
# check (`check = { nats = "mesh.ctl.status" }`), which the host runs.
HOST_CHECK_VERBS = ("status",)
# NATS service discovery (mesh/discovery.py, docs/security.md): operators, viewers too, ask
# `$SRV.>`; the controllers answer every `$SRV` request; a host answers those for every
# service, for `mesh-host` and for itself, and asks nothing: the answers would show it the
# other machines' verbs and their counts, which are not its own (scope by name).
ASK_DISCOVERY = f"{subjects.SRV}.>"

_API = "$JS.API"
KV_STREAM = f"KV_{DECLARATIONS}"
OBJ_STREAM = f"OBJ_{BUNDLES}"
KV_SUBJECTS = f"$KV.{DECLARATIONS}"
OBJ_SUBJECTS = f"$O.{BUNDLES}"
BUILDS_STREAM = f"OBJ_{BUILDS}"
BUILDS_SUBJECTS = f"$O.{BUILDS}"
UPLOADS_STREAM = f"OBJ_{UPLOADS}"
UPLOADS_SUBJECTS = f"$O.{UPLOADS}"


class User(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    # omit_defaults: users.json without `modules` where none is given, which a mesh from
    # before named operators still reads
    name: str  # a host's machine name; "controller"; an operator's name
    kind: Kind
    public: str  # the nkey the server knows
    role: Role | None = None  # operators only
    builder: bool = False  # hosts only: may write build outputs to the bundle store
    modules: str | None = None  # a deployer's: the glob of the modules it may change

    def describe(self) -> str:
        if self.kind == "operator":
            scope = f", modules {self.modules}" if self.modules is not None else ""
            return f"operator {self.name} ({self.role}{scope})"
        if self.kind == "host":
            return f"host {self.name}" + (" (builder)" if self.builder else "")
        return f"the controllers ({self.name})"


class Permissions(msgspec.Struct, frozen=True):
    publish: list[str]
    subscribe: list[str]
    responses: bool = False  # may answer requests it received (allow_responses)


def inbox(user: User) -> str:
    """The inbox prefix of `user`: replies to it land under `<prefix>.>`, which nobody else may
    subscribe to. A host's is `_INBOX_<name>`; the rest use a dotted form no machine name can
    produce (names have no dots), so no machine can be named into another's inbox."""
    if user.kind == "host":
        return f"_INBOX_{user.name}"
    return f"_INBOX.{user.kind}.{user.name}"


def _bundle_reads() -> list[str]:
    # Objects are chunked under random names ($O.<bucket>.C.<nuid>): reads cannot be narrowed
    # to "the bundles this host was told to fetch"; a host checks every digest instead. One
    # message per request (mesh.blobs.get): no consumer (its deliver subject is not checked
    # against the creator's permissions) and no direct get (its answer is the stored bytes,
    # raw, on whatever reply subject the asker names). docs/security.md, the bus.
    return [f"{_API}.STREAM.MSG.GET.{OBJ_STREAM}"]


def _staging(subjects_: str, stream: str) -> list[str]:
    """Adding objects to a staging bucket (mesh.blobs.stage): its subjects, its stream's info
    and one message at a time of it; no purge, no delete, no consumer."""
    return [f"{subjects_}.>", f"{_API}.STREAM.INFO.{stream}", f"{_API}.STREAM.MSG.GET.{stream}"]


def _build_writes() -> list[str]:
    """A builder's: what it built, left in the builds' bucket for the controller to adopt
    (mesh.blobs.stage); nothing of the bundle store, which it cannot purge or overwrite."""
    return _staging(BUILDS_SUBJECTS, BUILDS_STREAM)


def _uploads() -> list[str]:
    """An operator's that pushes (admin, deployer): the module's archive, left in the uploads'
    bucket for the controller to adopt (mesh.client.changes.upload); nothing of the bundle
    store, nor of any other stream."""
    return _staging(UPLOADS_SUBJECTS, UPLOADS_STREAM)


def _bundle_writes() -> list[str]:
    """An admin's: module sources at push and plan diff; a digest squatted with other bytes
    is replaced (mesh.blobs.put), which purges the old chunks."""
    return [f"{OBJ_SUBJECTS}.>", f"{_API}.STREAM.PURGE.{OBJ_STREAM}"]


def _discovery_answers(name: str) -> list[str]:
    """What a host subscribes to for discovery: $SRV.<verb>, $SRV.<verb>.mesh-host and
    $SRV.<verb>.mesh-host.<its name>; never another host's. Literal subjects, no `*`: the
    server lets a subscription to `$SRV.>` through an allowed `$SRV.*` (its `>` token matches
    the `*`), and that one would hear the requests for every host."""
    return [
        subject
        for verb in ("PING", "INFO", "STATS")
        for subject in (subjects.srv(verb), subjects.srv(verb, subjects.HOST_SERVICE),
                        subjects.srv(verb, subjects.HOST_SERVICE, name))
    ]  # fmt: skip


def _host(user: User) -> Permissions:
    name = user.name
    publish = [
        subjects.ctl_host(name, ">"),
        subjects.host(name, "beat"),
        subjects.event(name, ">"),
        *(subjects.ctl(v) for v in HOST_CHECK_VERBS),
        # its own declaration only: a consumer whose filter is its key (the server checks the
        # filter in the subject against the one in the request)
        f"{_API}.STREAM.INFO.{KV_STREAM}",
        f"{_API}.CONSUMER.CREATE.{KV_STREAM}.*.{KV_SUBJECTS}.{name}",
        *_bundle_reads(),
    ]
    if user.builder:
        publish += _build_writes()
    return Permissions(
        publish=publish,
        subscribe=[
            subjects.host(name, "*"),
            subjects.seat(">"),
            f"{inbox(user)}.>",
            *_discovery_answers(name),
        ],
        responses=True,
    )


def _controller(user: User) -> Permissions:
    return Permissions(
        publish=[
            subjects.seat(">"),
            subjects.plan("*"),  # plans' progress (services/controller/plans/planner.py)
            subjects.machine("*"),  # a machine drained or undrained (changes/machines.py)
            subjects.host("*", "build"),
            subjects.host("*", "restart"),  # a restart plan's steps (plans/restarting.py)
            # a standby passes on the operators' requests it held (handover.py)
            subjects.OP_VERBS,
            f"{_API}.>",
            f"{KV_SUBJECTS}.>",
            f"$KV.{SEAT}.>",  # the seat's epoch on the bus (services/controller/seat/epochs.py)
            f"{OBJ_SUBJECTS}.>",
            f"{BUILDS_SUBJECTS}.>",  # what builders left there, deleted once adopted
            f"{UPLOADS_SUBJECTS}.>",  # what operators pushed, deleted once adopted
        ],
        subscribe=[
            subjects.ctl(">"),
            subjects.OP_VERBS,  # operators' own verb subjects (the name: who asked)
            subjects.JOIN_VERBS,  # machines joining, each with its token's credentials
            subjects.host("*", "beat"),
            subjects.event("*", ">"),
            subjects.seat(">"),
            f"{inbox(user)}.>",
            ASK_DISCOVERY,  # answered by every controller, holder or standby
        ],
        responses=True,
    )


def _operator(user: User) -> Permissions:
    reads = [
        *(subjects.ctl(v) for v in sorted(READ_VERBS)),
        *(subjects.host("*", v) for v in HOST_READ_VERBS),
        ASK_DISCOVERY,
    ]
    if user.role == "viewer":
        return Permissions(publish=reads, subscribe=[f"{inbox(user)}.>", *OPERATOR_WATCH])
    if user.role == "tools":
        return Permissions(
            publish=[
                *(subjects.ctl(v) for v in TOOLS_READ_VERBS),
                *(subjects.host("*", v) for v in HOST_TOOL_VERBS),
                ASK_DISCOVERY,
            ],
            subscribe=[f"{inbox(user)}.>", *OPERATOR_WATCH],
        )
    if user.role in ("deployer", "agent"):
        verbs = DEPLOYER_VERBS if user.role == "deployer" else AGENT_VERBS
        # JetStream: its uploads alone. No purge, delete, consumer or direct get of the mesh's
        # streams: a consumer's deliver subject is not checked against its creator's
        # permissions, and a purge of the bundle store fails every plan after it.
        return Permissions(
            publish=[*reads, *(subjects.op(user.name, v) for v in verbs), *_uploads()],
            subscribe=[f"{inbox(user)}.>", *OPERATOR_WATCH],
        )
    return Permissions(
        publish=[
            *(subjects.ctl(v) for v in sorted(READ_VERBS)),
            subjects.op(user.name, "*"),  # every verb, present and future, as itself
            ASK_DISCOVERY,
            *(
                subjects.host("*", v)
                for v in (*HOST_READ_VERBS, *HOST_ADMIN_VERBS, *HOST_TOOL_VERBS)
            ),
            *_jetstream_uses(),
            *_uploads(),
        ],
        subscribe=[f"{inbox(user)}.>", *OPERATOR_WATCH],
    )


def _jetstream_uses() -> list[str]:
    """An admin's: reading what JetStream holds, and writing the bundle store (a bundle put
    there by hand; a mesh whose controller makes no uploads' bucket yet)."""
    return [
        f"{_API}.STREAM.NAMES",
        f"{_API}.STREAM.MSG.GET.{OBJ_STREAM}",
        f"{_API}.DIRECT.GET.{OBJ_STREAM}.>",
        f"{_API}.CONSUMER.CREATE.{OBJ_STREAM}",
        f"{_API}.CONSUMER.CREATE.{OBJ_STREAM}.>",
        f"{_API}.CONSUMER.INFO.{OBJ_STREAM}.*",
        *_bundle_writes(),
        f"{_API}.INFO",
        f"{_API}.STREAM.INFO.*",
        f"{_API}.CONSUMER.CREATE.{KV_STREAM}",
        f"{_API}.CONSUMER.CREATE.{KV_STREAM}.>",
        f"{_API}.CONSUMER.INFO.{KV_STREAM}.*",
        f"{_API}.STREAM.MSG.GET.{KV_STREAM}",
        f"{_API}.DIRECT.GET.{KV_STREAM}.>",
    ]


def joiner(token_id: str) -> Permissions:
    """A machine joining with a token (`mesh join`), before it has credentials of its own: its
    token's `join` request, its answer; nothing else of the bus."""
    return Permissions(
        publish=[subjects.join(token_id, "join")],
        subscribe=[f"{subjects.join_inbox(token_id)}.>"],
    )


def permissions(user: User) -> Permissions:
    if user.kind == "host":
        return _host(user)
    if user.kind == "controller":
        return _controller(user)
    if user.role not in ROLES:
        raise ValueError(f"operator {user.name}: role {user.role!r} is not one of {ROLES}")
    return _operator(user)
