"""The wire: every message between controller, hosts and clients as a strict msgspec.Struct.

Requests forbid unknown fields so a typo is an error, not a silently ignored key. Replies are
encoded with the same Structs, which keeps the JSON shapes of docs/design.md in one place.
"""

from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import msgspec

Name = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*\Z")
]
MAX_TIER = 9  # tiers are 0 to 9
Tier = Annotated[int, msgspec.Meta(ge=0, le=MAX_TIER)]
# What a machine or a client says in words: one printable line, never a NUL (PostgreSQL's text
# and jsonb refuse it, and a control character in a log or a table is a lie waiting to happen).
Word = Annotated[str, msgspec.Meta(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*\Z")]
LabelKey = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*\Z")
]
Labels = Annotated[dict[LabelKey, Word], msgspec.Meta(max_length=64)]


def labels_said(labels: dict[str, str], *, none: str = "none") -> str:
    """Labels as people read them (and the audit keeps them): `role=web, zone=a`, by key."""
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or none


Interval = Annotated[float, msgspec.Meta(gt=0, le=3600)]
# Which mesh a process runs (mesh/version.py): `sha256:<hex>` (a mesh bundle) or `installed`;
# "" from a process that does not say.
Version = Annotated[str, msgspec.Meta(max_length=80, pattern=r"^[^\x00-\x1f\x7f]*\Z")]

# The words a plan's life is told in. Literals, so msgspec refuses any other word on decode and a
# type checker sees a typo; on the wire they are the same plain strings.
# `held` (waiting for `mesh plan approve`), `paused` and `cancelled` are the operator's words
# (docs/operations.md, Steering a change); a tier is `soaking` while its canaries (or, without
# canaries, the whole tier) must stay healthy before the plan goes on.
PlanState = Literal[
    "pending", "building", "held", "rolling", "paused", "done", "failed", "reverted", "cancelled",
    "rejected",  # a held plan ended by `plan reject`, nothing changed
]  # fmt: skip
StepState = Literal["pending", "applying", "done", "failed", "skipped", "reverted"]
TierState = Literal["pending", "rolling", "soaking", "done", "failed", "reverted"]
# `rollback`: a module back at an earlier version; `undrain`: a machine brought up to date as it
# leaves the drain (docs/operations.md, Steering a change); `restart`: a module's processes
# restarted tier by tier, no declaration changed.
Trigger = Literal["push", "assign", "unassign", "secret", "rollback", "undrain", "restart"]
Phase = Literal["forward", "revert"]  # rolling forward, or giving machines `before` back
# The words a machine's life is told in, between the mesh's own pieces (mesh.event.<name>.*):
# a supervised process's state; a tool server's state as a caller sees it (`ready`: callable);
# the kind of an apply's step (`Applied.step` is `KIND`, or `KIND NAME` for a step that acts on
# one thing: `bundle mesh:sha256:…`, `file hello/app.conf`: see `apply_step`); and a
# controller's standing at the seat, which its module's check reads (`mesh controller ready`)
# and `$SRV INFO` says.
# (`restarting`: exited, and started again after its backoff; a host before process limits
# said `backoff`, which a reader keeps as it came.)
ProcessStatus = Literal["starting", "running", "restarting", "exited", "failed", "stopped"]
ToolServerStatus = Literal["starting", "ready", "backoff", "failed", "stopped"]
ApplyStepKind = Literal[
    "fence",  # a declaration the host refused for its epoch (nothing of the machine changed)
    "apply",  # a failure of no named step
    "account",
    "bundle",
    "limits",  # a declared limit this machine cannot enforce (nothing of the machine changed)
    "file",
    "containers",
    "prepare",
    "processes",
    "tools",
    "replaces",
    "agent",
]
SeatRole = Literal["starting", "standby", "holding", "handing-over"]

# How a word of a newer mesh is taken. During an upgrade an older controller hears newer hosts
# (Peer), and a newer host may say a word the controller does not know (a new process state, a
# new step); an older client (`mesh nodes`, the console, `mesh mcp`) reads it in a newer
# controller's replies the same way. Refusing it would drop the whole report, and with it the
# machine's processes and health; so these fields decode any word, the reader keeps it as it
# came (`mesh nodes` shows it) and acts only on the words it knows: a process is healthy by its
# `healthy`, never by its state; a tool server is called only when `ready`; an apply's step is
# a failure of the machine unless its kind is `fence`. A type checker sees the Literals (a typo
# in a comparison or an assignment is an error); msgspec sees `str`.
if TYPE_CHECKING:
    HeardProcessStatus = ProcessStatus
    HeardToolServerStatus = ToolServerStatus
    HeardApplyStepKind = ApplyStepKind
else:
    HeardProcessStatus = HeardToolServerStatus = HeardApplyStepKind = str


def apply_step(kind: ApplyStepKind, name: str = "") -> str:
    """An apply's step as `Applied.step` says it: `KIND`, or `KIND NAME` (the name may hold
    spaces; the kind never does)."""
    return f"{kind} {name}" if name else kind


# Every code an error reply carries (docs/verbs.md); `bad_reply` is the client's own, never sent.
ErrorCode = Literal[
    "bad_request",
    "too_large",
    "unknown_verb",
    "forbidden",
    "internal",
    "unavailable",
    "busy",
    "not_found",
    "refused",
    "conflict",
    "no_builder",
    "no_standby",
    "build_failed",
    "timeout",
]


class Request(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every request body: unknown fields are refused."""


# --- pages (mesh/paging.py) --------------------------------------------------------------------
# A list verb answers a page of its items: at most `limit` of them, and never more bytes than
# the NATS server takes; `next` (null on the last page) is the cursor to ask for the page after.
# Its request omits `after` and `limit` when they are the defaults (omit_defaults): a first
# page asked for as before is the body a controller from before pages understands.

PAGE_LIMIT = 1000  # items per page when the request does not say
PAGE_MOST = 5000  # the most a request may ask for; a page's bytes usually decide first
Cursor = Annotated[str, msgspec.Meta(max_length=512)]  # `next` as a page gave it: opaque


def check_limit(limit: int) -> None:
    """A request's `limit`, refused in words that name it and its value (raised in a request's
    __post_init__, msgspec reports it as the body's validation error)."""
    if not 1 <= limit <= PAGE_MOST:
        raise ValueError(f"limit: {limit} is out of range (1 to {PAGE_MOST})")


class Peer(msgspec.Struct):
    """Base of what the mesh's own pieces (hosts, controllers) send each other. During an
    upgrade of the mesh (docs/operations.md) an old and a new version talk: an older reader
    skips the fields a newer writer added, so a field may be added (with a default) but never
    renamed or given another type. Types and sizes stay strict."""


# --- operator verbs ---------------------------------------------------------------------------


class StatusRequest(Request):
    pass


class NodesRequest(Request, omit_defaults=True):
    after: Cursor | None = None  # the previous page's `next`; None: the first page
    limit: int = PAGE_LIMIT
    # Only these machines, those the mesh knows (`mesh logs` asks whether one it could not
    # reach is known, and up); none: every machine, a page at a time.
    names: Annotated[list[Name], msgspec.Meta(max_length=64)] = []

    def __post_init__(self) -> None:
        check_limit(self.limit)


class SeatInfo(msgspec.Struct):
    holder: str
    pid: int
    host: str
    epoch: int
    since: datetime
    # What the holder found wrong with the store at takeover: its epoch below the bus's (it
    # lost writes in a failover), a standby without synchronous replication.
    warnings: list[str] = []
    version: str = ""  # the holder's running mesh (mesh/version.py)


class Standby(msgspec.Struct):
    instance: str
    pid: int
    host: str
    since: datetime
    version: str = ""  # the standby's running mesh, as it announced it


class NodeCounts(msgspec.Struct):
    total: int
    up: int
    down: int


class Soak(msgspec.Struct):
    """A soak in progress: the tier whose canaries (or whole self) must stay healthy until
    `until` before the plan goes on; `left`, the seconds to go when this was said."""

    tier: int
    until: datetime
    left: float


class PlanSummary(msgspec.Struct):
    """A plan in one line: what `status` shows of the plan in progress and `plans` lists."""

    id: int
    state: PlanState
    trigger: Trigger
    subject: str  # the module or secret it is about
    by: str
    created: datetime
    finished: datetime | None
    machines: int
    done: int  # steps done or skipped
    tier: int | None = None  # the tier rolling now
    phase: Phase = "forward"
    failure: str | None = None  # which machine failed and why (not `error`: that is a refusal)
    # Steering (docs/operations.md): the soak in progress; why the plan is (being) cancelled.
    soak: Soak | None = None
    cancelled: str | None = None


class Handover(msgspec.Struct):
    """How the seat last changed hands: this holder's takeover."""

    at: datetime
    from_: str | None = msgspec.field(name="from")  # the previous holder, if any
    to: str = ""
    planned: bool = False  # the previous holder let go (a handover), rather than crashed
    gap_ms: float | None = None  # planned: from its release to this holder's takeover


class StatusReply(msgspec.Struct):
    seat: SeatInfo | None
    standbys: list[Standby]
    nodes: NodeCounts
    plan: PlanSummary | None = None  # the plan in progress
    handover: Handover | None = None


class HandoverRequest(Request):
    pass


class HandoverReply(msgspec.Struct):
    holder: str
    to: list[str]  # the standbys that may take the seat
    message: str


class Facts(Peer):
    os: Word
    arch: Word
    cpus: int
    memory: int  # bytes
    mesh_version: Word
    hostname: Word = ""
    python: Word = ""
    # The container engine that answers on this machine ("engine 28.2.2, API 1.50"), "" for none:
    # a declaration with containers fails its apply here, so an operator sees it first.
    container_engine: Word = ""
    # The process limits it can enforce (services/host/limits.py): some of `memory`, `cpu`,
    # `tasks`, `files`; None: a host before limits, which said nothing. `cgroups`: `v1`, `v2`
    # or "" (none it may use).
    limits: list[Word] | None = None
    cgroups: Word = ""


class ProcessState(msgspec.Struct, omit_defaults=True):
    # omit_defaults: `trial` appears on the wire only when true, so every other report's JSON
    # is as it was before the field existed.
    name: str
    state: HeardProcessStatus
    healthy: bool
    pid: int | None
    # A start-first new version on trial beside its old one (same name): its health is not the
    # process's until it has replaced the old one, so a plan never counts it.
    trial: bool = False
    # A tool server (a [tool.NAME] of its module): healthy once it answered initialize and
    # listed its tools; `error` says why it is not (it does not speak MCP, it exited, ...).
    tool: bool = False
    error: str = ""
    # Its use (docs/modules.md, Process limits): memory in bytes and cpu in cores over the last few
    # seconds, of the whole cgroup (its children too); None from a host before limits.
    memory: int | None = None
    cpu: float | None = None
    # Why it last exited, while it is not running: "memory limit 64M reached", "exited with
    # code 1", "killed by signal 9".
    reason: str = ""
    # How often its host restarted it since it started this version, and how many of those
    # came in a row with no steady run between (30 s up): a plan fails a step at once when
    # that reaches its module's `crash_loop`. What its last check said while it runs and is
    # not healthy ("HTTP status 503"), and since when this instance runs.
    restarts: int = 0
    in_a_row: int = 0
    check: str = ""
    since: datetime | None = None
    # While it is not running: the last line it printed before it exited (its log's, the
    # time in front left out), often the cause itself: "OSError: [Errno 98] Address already
    # in use".
    said: str = ""


class Node(msgspec.Struct):
    name: str
    tier: int
    labels: dict[str, str]
    up: bool
    last_seen: datetime | None
    facts: Facts | None
    processes: list[ProcessState]
    digest_wanted: str | None = None
    digest_applied: str | None = None
    apply_error: str | None = None  # why the last apply of digest_wanted stopped, if it did
    version: str | None = None  # the host agent's running mesh; None: it never said
    # Skipped by every plan, keeping what it runs (`mesh drain`); `digest_wanted` is then what
    # the catalog composes for it, which it gets once undrained.
    drained: bool = False
    # Sent more than a host does within the last minute (beats, reports or requests past its
    # budget, dropped unread: services/controller/fleet/noisy.py).
    noisy: bool = False


class NodesReply(msgspec.Struct):
    nodes: list[Node]
    next: str | None = None  # the cursor of the page after this one; None: this is the last
    total: int = 0  # machines in the whole fleet, as the controller counts them now


# --- what a host says -------------------------------------------------------------------------


class Register(Peer):
    name: Name
    # The host's own wish, taken only at its first registration on a mesh without
    # authentication; otherwise the operator's placement decides (mesh.store.machines.register).
    tier: Tier | None
    labels: Labels
    facts: Facts
    beat_interval: Interval
    pid: int
    applied: str | None = None  # the digest of the declaration it has applied, if any
    version: Version = ""  # the host agent's running mesh (mesh/version.py)


class RegisterReply(msgspec.Struct):
    name: str
    tier: int
    epoch: int
    labels: dict[str, str] = {}  # the operator's, whatever the registration asked for


class Beat(Peer):
    name: Name
    seq: int
    interval: Interval


# --- the seat ---------------------------------------------------------------------------------


class SeatAnnounce(Peer):
    """Published on mesh.seat.mesh-controller.{held,standby,released}."""

    instance: str
    pid: int
    host: str
    since: datetime
    epoch: int = 0
    at: datetime | None = None  # `released`: when the holder let go (the new holder's gap)
    version: Version = ""  # the announcing controller's running mesh (mesh/version.py)
    # `held`: the seconds over which hosts spread their registrations with the new holder
    # (services/host/registration.py), sized by the fleet it holds; 0 for a small one.
    register_within: float = 0.0


# --- errors -----------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct):
    code: ErrorCode
    message: str


class ErrorReply(msgspec.Struct):
    error: ErrorBody


# --- modules ----------------------------------------------------------------------------------

Digest = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}\Z")]
Text = Annotated[str, msgspec.Meta(max_length=256 * 1024)]


By = Annotated[str, msgspec.Meta(max_length=200, pattern=r"^[^\x00]*\Z")]  # as the client says
# A change's note (`push --note`): one line a person wrote, no control characters.
NOTE_MOST = 500
Note = Annotated[str, msgspec.Meta(max_length=NOTE_MOST, pattern=r"^[^\x00-\x1f\x7f]*\Z")]
# A deployer's modules: a glob (fnmatch: `*`, `?`, `[...]`) over module names.
ModuleGlob = Annotated[
    str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_*?\[\]!-]+\Z")
]


# Where a client left a module's archive for the controller to adopt (mesh.blobs.stage): an
# object of the uploads' bucket, named by the client (its digest and a random part).
Upload = Annotated[str, msgspec.Meta(min_length=1, max_length=160, pattern=r"^[A-Za-z0-9_.-]+\Z")]


class PushRequest(Request, omit_defaults=True):
    # omit_defaults: a push without `hold` is the body a controller from before understands
    manifest: Text  # module.toml as written
    source: Digest  # the module's archive: in the uploads' bucket as `upload`, or stored already
    by: By = ""
    hold: bool = False  # record the plan `held`: no machine changes until `plan-approve`
    upload: Upload | None = None
    note: Note = ""  # why, in the pusher's words: kept with the version and its plan


CHANGED_LISTED = 1000  # machines a change's reply names at most: its plan lists every one


class ChangeReply(msgspec.Struct):
    """What push, assign, unassign and secret set answer: the plan, or null for no change."""

    plan: int | None
    machines: list[str]  # whose declarations changed, the first CHANGED_LISTED by name
    message: str
    version: str | None = None
    changed: int = 0  # how many machines' declarations changed (`machines` may list fewer)
    state: PlanState | None = None  # the plan's state as recorded (`held` with `hold`)


MACHINES_NAMED = 10000  # machines one assign or unassign may name (selectors take any number)


class AssignRequest(Request, omit_defaults=True):
    # omit_defaults: as PushRequest, `hold` is sent only when asked for
    module: Name
    machines: Annotated[list[Name], msgspec.Meta(max_length=MACHINES_NAMED)] = []
    tier: Tier | None = None
    labels: Labels = {}
    by: By = ""
    hold: bool = False  # as `push`


class RestartPlanRequest(Request, omit_defaults=True):
    """`mesh restart MODULE [MACHINE...]`: a plan that restarts the module's processes (and
    tool servers) on each machine that runs it, or those named, tier by tier."""

    module: Name
    machines: Annotated[list[Name], msgspec.Meta(max_length=MACHINES_NAMED)] = []
    by: By = ""
    hold: bool = False  # as `push`


class TierRequest(Request):
    machine: Name
    tier: Tier


class TierReply(msgspec.Struct):
    machine: str
    tier: int
    was: int
    registered: bool = True  # False: recorded for the machine's first registration


class LabelRequest(Request):
    machine: Name
    set: Labels = {}
    remove: Annotated[list[LabelKey], msgspec.Meta(max_length=64)] = []


class LabelReply(msgspec.Struct):
    machine: str
    labels: dict[str, str]
    was: dict[str, str]
    registered: bool = True  # False: recorded for the machine's first registration


# --- plans -------------------------------------------------------------------------------------


class PlanRequest(Request, omit_defaults=True):
    id: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]  # a PostgreSQL bigint
    after: Cursor | None = None  # a page of its steps: the previous page's `next`
    limit: int = PAGE_LIMIT  # steps per page
    changes: bool = False  # each step with what it changes (a held plan, read by its id)

    def __post_init__(self) -> None:
        check_limit(self.limit)


class PlansRequest(Request, omit_defaults=True):
    limit: int = 20  # the newest 20, unless asked for more
    after: Cursor | None = None

    def __post_init__(self) -> None:
        check_limit(self.limit)


class PlanStep(msgspec.Struct):
    machine: str
    tier: int
    state: StepState
    started: datetime | None
    finished: datetime | None
    error: str | None
    before: str | None  # declaration digests
    after: str
    reverted: bool = False  # the machine got its `before` declaration back
    # Asked for (`plan` with `changes`): what the step changes in the machine's declaration,
    # from what it had (or has, for a plan not started) to `after` (mesh.modules.diff.Change
    # as builtins); None when not asked.
    changes: list[Any] | None = None


class PlanTier(msgspec.Struct):
    tier: int
    state: TierState
    total: int
    done: int


class PlanProgress(PlanSummary):
    """What the holder tells on mesh.plan.<id> at every step or tier change and at the plan's
    end: its summary and each tier's counts, so a follower shows the tiers without asking
    `plan` (a holder from before says the summary alone: `tiers` empty)."""

    tiers: list[PlanTier] = msgspec.field(default_factory=list)


class PlanBuild(msgspec.Struct):
    bundle: str
    digest: str
    built: bool  # built for this plan (false: the build was cached)


class PlanSettings(msgspec.Struct):
    deadline: float = 60.0  # seconds per machine
    max_parallel: int = 0  # 0: the whole tier at once
    auto_revert: bool = True
    skip_down: bool = False
    # Canaries and soaks (docs/modules.md, [rollout]): `canary` as the manifest says it (N
    # machines of each tier, or "P%" of them, go first; None: none), `soak` in seconds, and the
    # tiers after which the plan pauses itself.
    canary: int | str | None = None
    soak: float = 0.0
    pause_after: list[int] = []
    # restarts of a process within its step that fail the step at once, with their cause
    crash_loop: int = 3


class PlanApproval(msgspec.Struct):
    by: str
    at: datetime
    digest: str  # what the plan did when it was given
    void: bool = False  # the plan does something else now: it counts for nothing


class PlanReply(msgspec.Struct):
    id: int
    state: PlanState
    trigger: Trigger
    subject: str
    by: str
    epoch: int  # the seat's epoch that recorded it
    created: datetime
    started: datetime | None
    finished: datetime | None
    phase: Phase
    failure: str | None  # which machine failed and why (not `error`: that is a refusal)
    settings: PlanSettings
    builds: list[PlanBuild]
    tiers: list[PlanTier]  # of every step, whichever page this is
    steps: list[PlanStep]  # a page of them, by tier then machine
    next: str | None = None
    total: int = 0  # steps in the whole plan
    soak: Soak | None = None  # as PlanSummary
    cancelled: str | None = None
    note: str = ""  # its push's `--note`
    # What it does, as one digest: sha256 over each step's tier, machine and new declaration's
    # digest (`plan approve --digest` binds an approval to it).
    digest: str = ""
    # A held plan's approvals so far (each bound to the digest it approved: one given for
    # another is void), and how many distinct operators it needs (`mesh policy`).
    approvals: list[PlanApproval] = []
    approvals_needed: int = 0


# --- steering a plan (docs/verbs.md: plan-approve, plan-pause, plan-resume, plan-cancel) ------


class SteerRequest(Request, omit_defaults=True):
    id: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    by: By = ""
    # `plan-approve` only: approve only if the plan still does exactly this (its `digest`, as
    # `plan` shows it): a plan whose change the catalog moved since it was reviewed is refused.
    digest: Digest | None = None
    reason: Note = ""  # `plan-reject` only: why, in the operator's words


# --- the mesh's policy (`mesh policy`): what a change needs before it runs --------------------

MOST_APPROVALS = 9


class PolicyRequest(Request):
    pass


class PolicySetRequest(Request):
    # distinct operators, none of them the plan's author, who approve a held plan before it runs
    approvals: Annotated[int, msgspec.Meta(ge=1, le=MOST_APPROVALS)]
    by: By = ""


class PolicyReply(msgspec.Struct):
    approvals: int
    set_by: str | None = None
    set_at: datetime | None = None
    message: str = ""


class SteerReply(msgspec.Struct):
    """What approving, pausing, resuming or cancelling a plan answers: its state now."""

    plan: int
    state: PlanState
    message: str
    phase: Phase = "forward"


class PlansReply(msgspec.Struct):
    plans: list[PlanSummary]
    next: str | None = None
    total: int = 0  # plans in the store


class ModulesRequest(Request, omit_defaults=True):
    after: Cursor | None = None
    limit: int = PAGE_LIMIT  # entries per page (a module on many machines is several)

    def __post_init__(self) -> None:
        check_limit(self.limit)


ASSIGNED_PER_ENTRY = 1000  # machines in one entry of `modules`; more: the next entries go on


class ModuleInfo(msgspec.Struct):
    name: str
    version: str
    pushed_at: datetime
    pushed_by: str
    # By name. A module on more than ASSIGNED_PER_ENTRY machines is listed in several entries
    # one after another, each with the next of its machines (a client joins them).
    assigned: list[str]
    processes: list[str]
    containers: list[str]
    tools: list[str] = []  # its tool servers
    number: int = 0  # the version's number in `mesh history` (0: a controller from before)


class ModulesReply(msgspec.Struct):
    modules: list[ModuleInfo]
    next: str | None = None
    total: int = 0  # modules (not entries)


class DeclarationRequest(Request):
    machine: Name


class DeclarationReply(msgspec.Struct):
    machine: str
    digest: str
    epoch: int
    declaration: msgspec.Raw
    holder: str = ""  # the controller that published it: hosts refuse one epoch from two


class SecretSetRequest(Request, omit_defaults=True):
    name: Name
    value: Annotated[str, msgspec.Meta(max_length=700 * 1024)]  # base64 of at most 512 KiB
    by: By = ""
    # The modules that may name it (a glob, mesh/auth/scopes.py); None keeps the one it had.
    modules: ModuleGlob | None = None


class SecretsRequest(Request):
    """`mesh secret list`: a page of the secrets that are set, by name."""

    after: Cursor | None = None  # the previous page's `next`
    limit: int = PAGE_LIMIT

    def __post_init__(self) -> None:
        check_limit(self.limit)


class SecretInfo(msgspec.Struct):
    """A secret as `secret list` shows it: never its value."""

    name: str
    version: int
    by: str  # who set it last ("" for the mesh itself: `init`, the key of the secrets)
    at: datetime  # when
    modules: list[str]  # the modules whose current version names it
    # The glob of modules that may name it besides admins' (`secret set --modules`); the
    # controller's secrets: its module alone.
    allowed: str | None = None


class SecretsReply(msgspec.Struct):
    secrets: list[SecretInfo]
    next: str | None = None
    total: int = 0


class SecretDeleteRequest(Request):
    name: Name
    by: By = ""


class SecretDeleteReply(msgspec.Struct):
    name: str
    message: str


# --- the key of the secrets (`mesh secret rotate-key`; services/controller/catalog/secretkeys.py) -


class RotateKeyRequest(Request):
    key: Annotated[str, msgspec.Meta(max_length=64)]  # base64 of the new key's 32 bytes
    replaces: Annotated[str, msgspec.Meta(max_length=64)]  # the id of the key it follows
    by: By = ""


class RotateKeyReply(msgspec.Struct):
    key: str  # the id of the key the secrets are under now
    previous: list[str]  # the ids of the keys dropped from the controller's key file
    sealed: int  # secrets an older mesh had stored in plaintext, sealed now
    rewrapped: int  # data keys re-wrapped under the new key
    plan: int | None  # the plan that gives the controllers' module its new key file
    machines: list[str]  # whose declarations that plan changes, the first CHANGED_LISTED
    changed: int  # how many
    message: str


class DiffRequest(Request, omit_defaults=True):
    manifest: Text
    source: Digest
    upload: Upload | None = None  # as a push's
    after: Cursor | None = None  # a page of the machines that would change
    limit: int = PAGE_LIMIT

    def __post_init__(self) -> None:
        check_limit(self.limit)


class MachineDiff(msgspec.Struct):
    machine: str
    before: str | None  # digest
    after: str
    changes: list[Any]  # mesh.modules.diff.Change as builtins


class DiffReply(msgspec.Struct):
    module: str
    version: str
    machines: list[MachineDiff]  # a page of them, by name
    builds: list[str]  # bundles that would be built first
    next: str | None = None
    total: int = 0  # machines that would change


class BuildLogsRequest(Request):
    module: Name
    bundle: Name | None = None


class BuildLogsReply(msgspec.Struct):
    key: str
    module: str
    bundle: str
    state: str
    builder: str | None
    log: str


# --- a module's versions and going back to one; machines out of the plans ----------------------
# (docs/verbs.md, history, rollback, drain). A version is named by its number (1 for a module's
# first push, then 2, 3, ... in the order they were first pushed) or by its digest (the source
# archive's sha256, what `modules` and `push` call `version`), or a unique prefix of it.

VersionWord = Annotated[str, msgspec.Meta(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9:]+\Z")]


class HistoryRequest(Request, omit_defaults=True):
    module: Name
    after: Cursor | None = None  # the previous page's `next`
    limit: int = PAGE_LIMIT

    def __post_init__(self) -> None:
        check_limit(self.limit)


class VersionEntry(msgspec.Struct):
    version: int  # its number in the module's history: 1, 2, 3, ...
    digest: str  # its source archive's sha256 (`modules`' `version`)
    pushed: datetime  # when it was first pushed
    by: str  # who pushed it, as the client said
    plan: int | None  # the last plan that rolled it out (a push, a rollback or an assign)
    state: PlanState | None  # how that plan ended (or where it is)
    current: bool = False  # the module's version now
    kept: bool = True  # its bundles are still stored: a rollback to it needs no push
    note: str = ""  # its push's `--note`


class HistoryReply(msgspec.Struct):
    module: str
    versions: list[VersionEntry]  # a page of them, newest first
    next: str | None = None
    total: int = 0  # versions in all


class VersionDiffRequest(Request):
    """`mesh history MODULE --diff A B`: what changed from version `a` to version `b`."""

    module: Name
    a: VersionWord
    b: VersionWord


class BundleChange(msgspec.Struct):
    bundle: str
    before: str | None  # its digest in version a (None: a has no such bundle)
    after: str | None  # in version b


class VersionDiffReply(msgspec.Struct):
    module: str
    a: int  # the versions' numbers
    b: int
    a_digest: str
    b_digest: str
    manifest: list[str]  # module.toml, a unified diff from a to b (empty: the same)
    bundles: list[BundleChange]  # those whose digest differs, by name


class RollbackRequest(Request):
    module: Name
    to: VersionWord | None = None  # a number or a digest (prefix); None: the one before
    by: By = ""


class DrainRequest(Request):
    machine: Name
    by: By = ""


class MachineChanged(msgspec.Struct):
    """Told on mesh.machine.<name> when an operator drains or undrains it (not stored)."""

    machine: str
    drained: bool


class DrainReply(msgspec.Struct):
    machine: str
    drained: bool  # as it is now
    was: bool  # as it was before
    message: str
    plan: int | None = None  # undrain: the plan that brings the machine up to date, if any


# --- builds (controller -> builder host) -------------------------------------------------------


class BuildRequest(Peer):
    key: str
    module: Name
    bundle: Name
    source: Digest
    path: str  # the bundle's source folder in the module
    argv: list[str]
    output: str  # relative to `path`
    timeout: float
    # command: run argv in the source; mesh: the builder's own recipe for the mesh's code
    kind: Literal["command", "mesh"] = "command"


class BuildReply(msgspec.Struct):
    ok: bool
    digest: str | None
    tail: str  # the last lines of the build's output
    log: str  # the object holding the whole log
    error: str = ""
    # The bundle and the log were left in `mesh-builds` for the controller to adopt (a builder
    # from before wrote them into the bundle store itself): the bundle as `staged_as`.
    staged: bool = False
    staged_as: str = ""


# --- applying declarations (host -> controller) -------------------------------------------------


class SecretRequest(Peer):
    name: Name


class SecretReply(msgspec.Struct):
    name: str
    version: int
    value: str  # base64; only ever sent to a host whose declaration names the secret


class Applied(Peer):
    """Published on mesh.event.<name>.applied after each apply, good or not."""

    name: Name
    digest: str
    epoch: int
    ok: bool
    step: str = ""  # where it stopped, when not ok: `KIND` or `KIND NAME` (apply_step)
    error: str = ""
    # The processes as they are at the moment of this report: a plan judges health on these,
    # never on a report from before the apply (the old version's "healthy").
    processes: list[ProcessState] = []

    @property
    def step_kind(self) -> HeardApplyStepKind:
        """The kind of `step`, when the apply was not ok (a word of a newer host, maybe)."""
        return cast(HeardApplyStepKind, self.step.partition(" ")[0])


# --- host verbs (mesh.host.<name>.<verb>) --------------------------------------------------------


# A time as a log line's stamp spells it (UTC, to the millisecond).
LogTime = Annotated[str, msgspec.Meta(pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\Z")]


class LogsRequest(Request, omit_defaults=True):
    # omit_defaults: a plain read stays what a host of an older version understands
    process: Name
    offset: Annotated[int, msgspec.Meta(ge=0)] | None = None  # None: the last `max` bytes
    max: Annotated[int, msgspec.Meta(ge=1, le=512 * 1024)] = 64 * 1024
    # Seconds the host may hold the request while there is nothing new (`mesh logs -f`): it
    # answers the moment output comes, so a follower asks once per chunk, not per interval.
    wait: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0
    # Without an offset: from where the last `tail` lines start, or the first line stamped
    # `since` or later (services/host/logwriter.py), instead of the last `max` bytes.
    tail: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    since: LogTime | None = None
    prepare: bool = False  # the output of its last preparation step, not the process's


class LogsReply(msgspec.Struct):
    process: str
    offset: int  # where the next read starts
    data: str


class RestartRequest(Request):
    process: Name


class RestartReply(msgspec.Struct):
    process: str
    restarted: bool


class ProcessesEvent(Peer):
    """Published on mesh.event.<name>.processes when a process changes state."""

    name: Name
    processes: list[ProcessState]


# --- tools (docs/verbs.md, tools) -------------------------------------------------------------

ToolName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]*\Z")
]
# A `tools` cursor carries a machine's, a server's and a tool's name (up to 128 characters,
# JSON-escaped) as base64url: longer than the other verbs' (docs/verbs.md, tools).
ToolCursor = Annotated[str, msgspec.Meta(max_length=1024, pattern=r"^[A-Za-z0-9_=-]*\Z")]


class ToolInfo(msgspec.Struct):
    """One tool of a tool server, as its tools/list said (bounded by the host)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = {}


class ToolServerReport(msgspec.Struct):
    """One tool server of a host: its state and the tools it last listed."""

    name: str
    state: HeardToolServerStatus
    error: str = ""  # why it is not ready, or what was left out of its tools
    tools: list[ToolInfo] = []
    timeout: float = 30.0  # seconds: its calls' limit (the declared `timeout`)


class ToolsEvent(Peer):
    """Published on mesh.event.<name>.tools when a tool server's state or tools change, and
    again when a new holder says `held`."""

    name: Name
    servers: list[ToolServerReport] = []


class ToolsRequest(Request, omit_defaults=True):
    machine: Name | None = None  # one machine's tools; all machines' without
    after: ToolCursor | None = None  # the previous page's `next`; None: the first page
    limit: int = PAGE_LIMIT

    def __post_init__(self) -> None:
        check_limit(self.limit)


class ToolEntry(msgspec.Struct):
    machine: str
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]
    state: HeardToolServerStatus = "ready"  # its tools are callable when ready
    up: bool = True  # the machine, as the controller sees it
    timeout: float = 30.0  # seconds: the tool server's limit for a call


class ToolsReply(msgspec.Struct):
    tools: list[ToolEntry]
    next: str | None = None  # ask again with `after` = this for the next page; null: the last


class ToolCallRequest(Request):
    """A call of one tool of one of a host's tool servers (its verb `tool`, docs/verbs.md)."""

    server: Name
    tool: ToolName
    arguments: dict[str, Any] = {}
    # Seconds; at most the tool server's own `timeout`, which is also the default.
    timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] | None = None


class ToolCallReply(msgspec.Struct):
    """The MCP result of a tools/call, as the tool server gave it."""

    machine: str
    server: str
    tool: str
    content: list[Any] = []
    is_error: bool = msgspec.field(default=False, name="isError")
    structured_content: Any = msgspec.field(default=None, name="structuredContent")


# --- trust: the audit log and named operators (docs/verbs.md: audit, operator-*) --------------

OperatorRole = Literal["admin", "deployer", "viewer", "tools", "agent"]  # as mesh.auth.policy.Role


class AuditRequest(Request, omit_defaults=True):
    limit: int = 50  # the newest 50, unless asked for more
    after: Cursor | None = None
    who: Name | None = None  # one operator's entries only

    def __post_init__(self) -> None:
        check_limit(self.limit)


class AuditEntry(msgspec.Struct):
    at: datetime
    who: str  # the operator the mesh verified (the subject it asked on), never the body's word
    verb: str
    subject: str  # what the change was about: a module, a machine, a plan, a secret's name
    outcome: str  # "ok", or the refusal's code (forbidden, not_found, conflict, ...)
    detail: str = ""  # the plan it made, or what the refusal said
    id: int = 0


class AuditReply(msgspec.Struct):
    entries: list[AuditEntry]
    next: str | None = None


# What an admin grants a scoped operator (mesh/auth/scopes.py): root | groups:G[,G...] |
# secrets:GLOB | accounts:A[,A...]
_ACCOUNTS = r"[a-z_][a-z0-9_-]{0,31}(?:,[a-z_][a-z0-9_-]{0,31})*"
ALLOW_PATTERN = (
    rf"^(?:root|groups:{_ACCOUNTS}|secrets:[A-Za-z0-9_*?\[\]!-]{{1,200}}|accounts:{_ACCOUNTS})\Z"
)
Allow = Annotated[str, msgspec.Meta(max_length=400, pattern=ALLOW_PATTERN)]


class OperatorAddRequest(Request, omit_defaults=True):
    """Recorded by `mesh operator add` before the operator's credentials count."""

    name: Name
    role: OperatorRole
    modules: ModuleGlob | None = None  # deployers only
    allow: Annotated[list[Allow], msgspec.Meta(max_length=32)] = []  # deployers only


class OperatorRemoveRequest(Request, omit_defaults=True):
    name: Name
    revert: bool = False  # unassign the modules it pushed last, each through a plan


class OperatorInfo(msgspec.Struct, omit_defaults=True):
    name: str
    role: str
    modules: str | None = None
    allow: list[str] = []


class Brought(msgspec.Struct):
    """What an operator brought into the mesh (`operator remove` lists it): the plans it asked
    for that are not over, the modules whose current version it pushed (with their processes
    and machines) and the secrets it set last."""

    plans: list[int] = []
    modules: list[str] = []
    processes: list[str] = []  # MODULE.PROCESS
    machines: list[str] = []  # where those modules are assigned
    secrets: list[str] = []


class OperatorReply(msgspec.Struct, omit_defaults=True):
    name: str
    role: str
    modules: str | None = None
    message: str = ""
    allow: list[str] = []
    brought: Brought | None = None  # `operator remove`
    reverted: list[int] = []  # the plans `--revert` made


# Changes made on the mesh's folder, not through a controller (`mesh machine add/remove`, `mesh
# cert rotate`): the command line records each once done, on the operator's own subject, so
# the audit log has it with the operator nats-server authenticated.
FolderChange = Literal["machine-add", "machine-remove", "cert-rotate"]


class FolderChangeRequest(Request):
    change: FolderChange
    subject: Word  # the machine, or the servers whose certificates were rotated
    detail: Annotated[str, msgspec.Meta(max_length=500, pattern=r"^[^\x00-\x1f\x7f]*\Z")] = ""


class FolderChangeReply(msgspec.Struct):
    message: str = ""


class OperatorsRequest(Request):
    pass


class OperatorsReply(msgspec.Struct):
    operators: list[OperatorInfo]


# --- join tokens (docs/verbs.md: token-*; mesh/tokens.py: the token as text) -----------------

TokenId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{12}\Z")]  # not a secret: a name
TOKEN_TTL_MOST = 30 * 86400.0  # seconds: a token that outlives a month is one nobody remembers
TOKEN_USES_MOST = 1000  # machines per token (each named in its `used_by`)


class TokenCreateRequest(Request, omit_defaults=True):
    """A join token's terms. The secret never reaches the controller: the command line makes
    it and sends its SHA-256 (mesh.tokens.secret_hash), which is all the store keeps."""

    secret_sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")]
    ttl: Annotated[float, msgspec.Meta(ge=1, le=TOKEN_TTL_MOST)] = 3600.0  # seconds
    uses: Annotated[int, msgspec.Meta(ge=1, le=TOKEN_USES_MOST)] = 1
    tier: Tier = 2  # as a machine nobody placed registers (mesh machine add without --tier)
    labels: Labels = {}
    control: bool = False  # joins the control plane: labelled role=control
    site: Name | None = None  # kept for a later feature


class TokenInfo(msgspec.Struct):
    """A join token as `token list` shows it: never its secret, nor its hash."""

    id: str
    created: datetime
    by: str  # the operator the mesh verified
    expires: datetime
    uses_left: int
    revoked: datetime | None
    tier: int
    labels: dict[str, str]  # what a machine joining with it is labelled (role=control included)
    control: bool
    site: str | None
    used_by: list[str]  # the machines that joined with it, in order


class TokenCreated(TokenInfo):
    """`token-create`'s answer: the token, and the credentials a machine joining with it
    connects with before it has its own (a bearer user JWT, for its token's `join` request
    alone, expiring with the token: services/controller/fleet/admission.py); None where the
    controllers cannot sign (no signing key)."""

    bearer: str | None = None


class TokenListRequest(Request, omit_defaults=True):
    limit: int = PAGE_LIMIT
    after: Cursor | None = None

    def __post_init__(self) -> None:
        check_limit(self.limit)


class TokenListReply(msgspec.Struct):
    tokens: list[TokenInfo]  # newest first
    next: str | None = None


class TokenRevokeRequest(Request):
    id: TokenId


class TokenRevokeReply(msgspec.Struct):
    id: str
    revoked: bool


class Grant(msgspec.Struct, frozen=True):
    """What a redeemed join token gives the machine that joins with it
    (services.controller.fleet.tokens.redeem)."""

    tier: int
    labels: dict[str, str]  # role=control included when `control`
    control: bool
    site: str | None = None


# --- a machine joining (`mesh join TOKEN`; services/controller/fleet/joining.py) ------------------

NkeyUser = Annotated[str, msgspec.Meta(pattern=r"^U[A-Z2-7]{55}\Z")]  # a user's public nkey


class JoinRequest(Request):
    """What `mesh join` sends, as its token's bearer, on mesh.join.<token id>.join: the token's
    secret (hashed and compared by the controller), the machine's name and its own public key
    (its seed never leaves it)."""

    secret: Annotated[str, msgspec.Meta(min_length=43, max_length=43, pattern=r"^[A-Za-z0-9_-]+\Z")]
    machine: Name
    public: NkeyUser


class JoinReply(msgspec.Struct):
    """The machine admitted: its credentials' JWT (signed for its key), the controllers' public
    key (what its host checks their signatures with), and where it was placed."""

    machine: str
    jwt: str
    controller: str | None
    tier: int
    labels: dict[str, str]
    control: bool
    site: str | None = None
    again: bool = False  # the same machine and key asking again (its answer was lost)


class JoinedKeyRequest(Request):
    machine: Name


class JoinedKeyReply(msgspec.Struct):
    """A joined machine's key, forgotten by the controller (`mesh machine remove` revokes it)."""

    machine: str
    public: str
