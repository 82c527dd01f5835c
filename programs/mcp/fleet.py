"""The fleet's own verbs as tools of `mesh mcp`, beside the machines' tools: status, nodes, plans,
a plan, a push's dry run, history, logs, audit; assign, unassign, push, rollback, drain,
undrain, and approving or rejecting a held plan. Each asked as the operator whose credentials
`mesh mcp` runs with, on the library's client (mesh/client/), as the command line asks it:
changes on the operator's own subjects (`mesh.op.<name>.<verb>`), so the controller records
them as that operator, holds an agent's, and refuses what its role may not do.

A tool is named `mesh_<verb>` (no dot: a machine's tool, `MACHINE.SERVER.TOOL`, has two). Its
inputSchema is its arguments' struct, its outputSchema the verb's reply struct (mesh/model.py);
a result carries the reply as structuredContent and as JSON text. What the operator's role may
not ask (mesh/auth/policy.py) is not listed, and a call to it is refused before anything is
sent; nats-server and the controller enforce the same lists whatever is asked. Every refusal
(a role, arguments of the wrong shape, the controller's `forbidden` or `conflict`) is a tool
error (`isError`) of one line.
"""

import getpass
import logging
import time
from argparse import ArgumentTypeError
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import mcp.types as types
import msgspec
from nats.aio.client import Client

from mesh import blobs
from mesh.auth import creds as credentials
from mesh.auth.policy import (
    AGENT_VERBS,
    DEPLOYER_VERBS,
    HOST_READ_VERBS,
    HOST_TOOL_VERBS,
    READ_VERBS,
    ROLES,
    TOOLS_READ_VERBS,
)
from mesh.client import changes
from mesh.client.asking import VerbFailed, ask, connected
from mesh.client.logs import read_logs, since
from mesh.client.pages import ask_list
from mesh.errors import MeshError
from mesh.model import (
    PAGE_MOST,
    AssignRequest,
    AuditReply,
    AuditRequest,
    ChangeReply,
    DiffReply,
    DiffRequest,
    Digest,
    DrainReply,
    DrainRequest,
    HistoryReply,
    HistoryRequest,
    Labels,
    LogsReply,
    LogsRequest,
    Name,
    NodesReply,
    NodesRequest,
    Note,
    OperatorsReply,
    OperatorsRequest,
    PlanReply,
    PlanRequest,
    PlansReply,
    PlansRequest,
    Request,
    RestartPlanRequest,
    RollbackRequest,
    StatusReply,
    SteerReply,
    SteerRequest,
    Tier,
    VersionWord,
)
from mesh.modules import gate
from mesh.modules.load import LocalModule, load

log = logging.getLogger("mesh.mcp")

READ_TIMEOUT = 10.0  # seconds a read is retried for (no responders, busy, a handover)
ROLE_EVERY = 30.0  # seconds the operator's role is trusted before it is asked again

# --- arguments: each tool's inputSchema (unknown arguments refused, as a request's are) --------

Most = Annotated[int, msgspec.Meta(ge=1, le=PAGE_MOST, description="at most this many items")]
PlanId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1, description="the plan's id")]
Folder = Annotated[str, msgspec.Meta(min_length=1, max_length=4096,
                                     description="the module's folder, on the machine that "
                                     "runs mesh mcp")]  # fmt: skip


Since = Annotated[str, msgspec.Meta(
    max_length=40, description="a while ago (90s, 15m, 2h, 7d) or a time (2026-12-07T19:40:00Z)"
)]  # fmt: skip


class NoArgs(Request):
    pass


class Listing(Request):
    limit: Most | None = None


class PlansArgs(Request):
    limit: Most = 20  # the newest 20, as `mesh plan`


class PlanArgs(Request):
    id: PlanId
    changes: bool = False  # each step with what it changes in its machine's declaration
    limit: Most | None = None


class DiffArgs(Request):
    folder: Folder
    limit: Most | None = None


class PushArgs(Request):
    folder: Folder
    hold: bool = False
    note: Note = ""


class HistoryArgs(Request):
    module: Name
    limit: Most | None = None


class LogsArgs(Request):
    machine: Name
    process: Name
    tail: Annotated[int, msgspec.Meta(ge=1, le=100_000)] | None = None
    since: Since | None = None
    prepare: bool = False  # the output of its last preparation step


class AuditArgs(Request):
    who: Name | None = None
    limit: Most = 50


class AssignArgs(Request):
    module: Name
    machines: Annotated[list[Name], msgspec.Meta(max_length=10000)] = []
    tier: Tier | None = None
    labels: Labels = {}
    hold: bool = False


class RollbackArgs(Request):
    module: Name
    to: VersionWord | None = None  # a number or a digest; none: the version before


class RestartArgs(Request):
    module: Name
    machines: Annotated[list[Name], msgspec.Meta(max_length=10000)] = []  # none: every one
    hold: bool = False


class MachineArgs(Request):
    machine: Name


class ApproveArgs(Request):
    id: PlanId
    digest: Digest | None = None  # only if the plan still does what this digest says


class RejectArgs(Request):
    id: PlanId
    reason: Note = ""


# --- how each is asked ------------------------------------------------------------------------


@dataclass(frozen=True)
class Asking:
    """One call's connection, as its operator."""

    nc: Client
    url: str


Runner = Callable[[Asking, "FleetVerb", Any], Awaitable[Any]]


@dataclass(frozen=True)
class FleetVerb:
    """A tool of the fleet: the verb it asks, its arguments (inputSchema), the verb's reply
    (outputSchema), how it is asked (`run`, with `body` the request made of the arguments),
    its annotations and, from mesh/auth/policy.py, the roles that may ask it."""

    verb: str  # the controller's verb (`logs`: the host's)
    args: type[Request]
    reply: type
    hints: types.ToolAnnotations
    run: Runner
    about: str
    body: Callable[[Any], Any] = lambda a: a

    @property
    def roles(self) -> frozenset[str]:
        return roles_of(self.verb)


async def read(on: Asking, tool: FleetVerb, a: Any) -> Any:
    return await ask(on.nc, url=on.url, verb=tool.verb, reply=tool.reply, timeout=READ_TIMEOUT,
                     body=msgspec.json.encode(tool.body(a)))  # fmt: skip


async def pages(on: Asking, tool: FleetVerb, a: Any) -> Any:
    """Every page (the first `limit` items), as one reply."""
    return await ask_list(on.nc, url=on.url, verb=tool.verb, reply=tool.reply,
                          request=tool.body(a), timeout=READ_TIMEOUT,
                          want=getattr(a, "limit", None))  # fmt: skip


async def change(on: Asking, tool: FleetVerb, a: Any) -> Any:
    """Tried once per answer window, as the command line asks a change: a slow answer must not
    be taken for a lost request and sent again."""
    return await ask(on.nc, url=on.url, verb=tool.verb, reply=tool.reply,
                     timeout=changes.CHANGE_TIMEOUT, body=msgspec.json.encode(tool.body(a)),
                     attempt=changes.CHANGE_TIMEOUT)  # fmt: skip


def _module(folder: str) -> LocalModule:
    try:
        return load(Path(folder))
    except gate.Refused as e:
        raise VerbFailed(str(e)) from None
    except OSError as e:
        raise VerbFailed(f"{folder}: {e.strerror or e}") from None


async def _push(on: Asking, _: FleetVerb, a: PushArgs) -> ChangeReply:
    return await changes.push(on.nc, url=on.url, module=_module(a.folder), hold=a.hold,
                              note=a.note)  # fmt: skip


async def _diff(on: Asking, _: FleetVerb, a: DiffArgs) -> DiffReply:
    module = _module(a.folder)
    staged = await changes.upload(on.nc, module)
    request = DiffRequest(manifest=module.manifest_text, source=module.version, upload=staged)
    return await ask_list(on.nc, url=on.url, verb="diff", reply=DiffReply, request=request,
                          timeout=changes.CHANGE_TIMEOUT, want=a.limit,
                          attempt=changes.CHANGE_TIMEOUT)  # fmt: skip


async def _logs(on: Asking, _: FleetVerb, a: LogsArgs) -> LogsReply:
    if a.tail is not None and a.since is not None:
        raise VerbFailed("tail and since: one or the other")
    try:
        at = since(a.since) if a.since is not None else None
    except ArgumentTypeError as e:
        raise VerbFailed(f"since: {e}") from None
    request = LogsRequest(process=a.process, tail=a.tail, since=at, prepare=a.prepare)
    return await read_logs(on.nc, a.machine, request, READ_TIMEOUT)


def _assigning(a: AssignArgs) -> AssignRequest:
    if not a.machines and a.tier is None and not a.labels:
        raise VerbFailed("name machines, or select them with tier or labels")
    return AssignRequest(module=a.module, machines=a.machines, tier=a.tier, labels=a.labels,
                         by=getpass.getuser(), hold=a.hold)  # fmt: skip


def _draining(a: MachineArgs) -> DrainRequest:
    return DrainRequest(machine=a.machine, by=getpass.getuser())


# --- the table --------------------------------------------------------------------------------


def roles_of(verb: str) -> frozenset[str]:
    """The roles that may ask `verb`, from the lists nats-server is configured with."""
    may = {"admin"}
    if verb in READ_VERBS or verb in HOST_READ_VERBS:
        may |= {"deployer", "agent", "viewer"}
    may |= {"deployer"} if verb in DEPLOYER_VERBS else set()
    may |= {"agent"} if verb in AGENT_VERBS else set()
    may |= {"tools"} if verb in TOOLS_READ_VERBS or verb in HOST_TOOL_VERBS else set()
    return frozenset(may)


READS = types.ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)


def _hints(*, destructive: bool, idempotent: bool) -> types.ToolAnnotations:
    return types.ToolAnnotations(read_only_hint=False, destructive_hint=destructive,
                                 idempotent_hint=idempotent, open_world_hint=False)  # fmt: skip


ADDS = _hints(destructive=False, idempotent=True)  # asked again: nothing more changes
REMOVES = _hints(destructive=True, idempotent=True)
ONCE = _hints(destructive=False, idempotent=False)
UNDOES = _hints(destructive=True, idempotent=False)

# fmt: off
VERBS: dict[str, FleetVerb] = {
    "mesh_status": FleetVerb("status", NoArgs, StatusReply, READS, read,
        "The mesh: the controller holding the seat, its standbys, the current plan, node counts."),
    "mesh_nodes": FleetVerb("nodes", Listing, NodesReply, READS, pages,
        "Every machine: its tier, labels, up or down, drained, processes and tool servers.",
        lambda a: NodesRequest()),
    "mesh_plans": FleetVerb("plans", PlansArgs, PlansReply, READS, pages,
        "The newest plans (changes rolling out), newest first.", lambda a: PlansRequest()),
    "mesh_plan": FleetVerb("plan", PlanArgs, PlanReply, READS, pages,
        "One plan and its steps; `changes`: what each step changes (review a held plan, then "
        "approve it with its `digest`).", lambda a: PlanRequest(id=a.id, changes=a.changes)),
    "mesh_plan_diff": FleetVerb("diff", DiffArgs, DiffReply, READS, _diff,
        "A dry run of pushing the module in `folder` (on the machine running mesh mcp): what "
        "would change on each machine. Its archive is uploaded; no machine changes."),
    "mesh_history": FleetVerb("history", HistoryArgs, HistoryReply, READS, pages,
        "A module's versions, newest first, and how each rolled out.",
        lambda a: HistoryRequest(module=a.module)),
    "mesh_logs": FleetVerb("logs", LogsArgs, LogsReply, READS, _logs,
        "A process's output, from its machine's host: the last 64 KiB, the last `tail` lines, "
        "or the lines `since`."),
    "mesh_audit": FleetVerb("audit", AuditArgs, AuditReply, READS, pages,
        "Who changed what, newest first (the operator the mesh verified).",
        lambda a: AuditRequest(who=a.who)),
    "mesh_assign": FleetVerb("assign", AssignArgs, ChangeReply, ADDS, change,
        "Assign a module to machines (named, or a tier's, or those with labels): a plan rolls "
        "it out (`hold`: held until approved).", _assigning),
    "mesh_unassign": FleetVerb("unassign", AssignArgs, ChangeReply, REMOVES, change,
        "Take a module off machines: its processes there stop.", _assigning),
    "mesh_push": FleetVerb("push", PushArgs, ChangeReply, ONCE, _push,
        "Validate and upload the module in `folder` (on the machine running mesh mcp): a new "
        "version, rolled out by a plan to the machines it is assigned to."),
    "mesh_rollback": FleetVerb("rollback", RollbackArgs, ChangeReply, UNDOES, change,
        "Take a module back to an earlier version (`to`: its number or digest; none: the one "
        "before the current one).",
        lambda a: RollbackRequest(module=a.module, to=a.to, by=getpass.getuser())),
    "mesh_drain": FleetVerb("drain", MachineArgs, DrainReply, REMOVES, change,
        "Take a machine out of every plan (it keeps what it runs; plans skip it).", _draining),
    "mesh_undrain": FleetVerb("undrain", MachineArgs, DrainReply, ADDS, change,
        "Put a drained machine back; a plan brings it up to date.", _draining),
    "mesh_plan_approve": FleetVerb("plan-approve", ApproveArgs, SteerReply, ONCE, change,
        "Approve a held plan (with `digest`: only if it still does what that digest says); it "
        "runs once it has the approvals the mesh's policy asks for.",
        lambda a: SteerRequest(id=a.id, by=getpass.getuser(), digest=a.digest)),
    "mesh_plan_reject": FleetVerb("plan-reject", RejectArgs, SteerReply, UNDOES, change,
        "Reject a held plan: it ends rejected, no machine changed (`reason`: why).",
        lambda a: SteerRequest(id=a.id, by=getpass.getuser(), reason=a.reason)),
    "mesh_restart": FleetVerb("restart", RestartArgs, ChangeReply, ONCE, change,
        "Restart a module's processes on the machines that run it (or those named), tier by "
        "tier through its health gates; no declaration changes (`hold`: held until approved).",
        lambda a: RestartPlanRequest(module=a.module, machines=a.machines, by=getpass.getuser(),
                                     hold=a.hold)),
}
# fmt: on


def output_schema(reply: type) -> dict[str, Any]:
    """The reply struct's JSON Schema with the struct itself at the top (MCP wants an object
    there, not msgspec's `$ref`), its definitions beside it."""
    schema = msgspec.json.schema(reply)
    defs = schema.get("$defs", {})
    return {**defs[schema["$ref"].rsplit("/", 1)[1]], "$defs": defs}


def input_schema(args: type) -> dict[str, Any]:
    return output_schema(args)


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)],
                                is_error=True)  # fmt: skip


class FleetVerbs:
    """The fleet's verbs as the operator of `creds` may ask them; each call on a connection of
    its own (`connected`: a publish nats-server refuses ends it `forbidden` at once)."""

    def __init__(self, *, url: str, creds: str | None) -> None:
        self._url = url
        self._creds = creds
        self._operator = credentials.read(creds).operator if creds else None
        self._role: str | None = None
        self._asked = -ROLE_EVERY

    async def role(self) -> str | None:
        """The operator's role, as the controller records it (re-asked at most every
        ROLE_EVERY s); None: no operator (a bus without credentials), or not known yet."""
        if self._operator is None or time.monotonic() - self._asked < ROLE_EVERY:
            return self._role
        try:
            async with connected(url=self._url, creds=self._creds, what="operators") as nc:
                reply = await ask(nc, url=self._url, verb="operators", reply=OperatorsReply,
                                  timeout=READ_TIMEOUT,
                                  body=msgspec.json.encode(OperatorsRequest()))  # fmt: skip
        except VerbFailed as e:
            if e.code != "forbidden":  # no controller now: the role known before, if any
                log.warning("could not ask the operator's role: %s", e)
                return self._role
            self._role = "tools"  # the one role that may not read the operators
        else:
            mine = [o.role for o in reply.operators if o.name == self._operator]
            self._role = mine[0] if mine and mine[0] in ROLES else "none"  # removed: nothing
        self._asked = time.monotonic()
        return self._role

    async def allowed(self) -> dict[str, FleetVerb]:
        role = await self.role()
        return {n: v for n, v in VERBS.items() if role is None or role in v.roles}

    async def may_call_tools(self) -> bool:
        """Whether the machines' tools are these credentials' to call (`mesh.host.<name>.tool`)."""
        role = await self.role()
        return role is None or role in roles_of(HOST_TOOL_VERBS[0])

    async def tools(self) -> list[types.Tool]:
        listed = []
        for name, v in (await self.allowed()).items():
            listed.append(types.Tool(name=name, description=v.about,
                                     input_schema=input_schema(v.args),
                                     output_schema=output_schema(v.reply),
                                     annotations=v.hints))  # fmt: skip
        return listed

    async def call(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        tool = VERBS[name]
        if name not in await self.allowed():
            return _error(f"forbidden: operator {self._operator} ({self._role}) may not "
                          f"{tool.verb} (its role allows {_may(self._role)})")  # fmt: skip
        try:
            args = msgspec.convert(arguments or {}, tool.args)
        except msgspec.ValidationError as e:
            return _error(f"{name}: bad arguments: {e}")
        try:
            async with connected(url=self._url, creds=self._creds, what=tool.verb) as nc:
                reply = await tool.run(Asking(nc, self._url), tool, args)
        except (MeshError, blobs.BlobMissing) as e:
            return _error(" ".join(str(e).split()) or type(e).__name__)
        structured = msgspec.to_builtins(reply)
        text = msgspec.json.encode(structured).decode()
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    structured_content=structured)  # fmt: skip


def _may(role: str | None) -> str:
    said = [n for n, v in VERBS.items() if role in v.roles]
    return ", ".join(said) if said else "none of the fleet's verbs"
