"""Every subject mesh uses, in one place (docs/architecture.md). Names are checked before use."""

SEAT = "mesh-controller"
QUEUE = "mesh-controller"  # queue group of every controller verb subscription

CTL_VERBS = "mesh.ctl.*"  # operator verbs: mesh.ctl.<verb>
CTL_HOST_VERBS = "mesh.ctl.host.*.*"  # what a host asks: mesh.ctl.host.<name>.<verb>
# An operator's verbs: mesh.op.<operator>.<verb>. Only that operator's credentials may publish
# under its name (nats-server checks it), so the name is the operator the mesh verified.
OP_VERBS = "mesh.op.*.*"
HOST_BEATS = "mesh.host.*.beat"
EVENTS = "mesh.event.*.*"  # what hosts report: mesh.event.<name>.<kind>
SEAT_EVENTS = f"mesh.seat.{SEAT}.*"
PLANS = "mesh.plan.*"  # the holder's plan progress: mesh.plan.<id>
MACHINES = "mesh.machine.*"  # the holder's word: a machine drained, undrained, or skipped for it
# A machine joining with a token: mesh.join.<token id>.<verb>. Only the token's own bearer
# credentials may publish under its id (the controller signed them: services/controller/
# admission.py), so the id is the token the server let it use.
JOIN_VERBS = "mesh.join.*.*"


def ctl(verb: str) -> str:
    return f"mesh.ctl.{verb}"


def op(operator: str, verb: str) -> str:
    """An operator's own verb subject (docs/security.md, who asked)."""
    return f"mesh.op.{operator}.{verb}"


def op_operator(subject: str) -> str:
    """The <operator> of mesh.op.<operator>.<verb> (unchecked: the caller checks it)."""
    return subject.split(".")[2]


def join(token_id: str, verb: str) -> str:
    return f"mesh.join.{token_id}.{verb}"


def join_token(subject: str) -> str:
    """The <token id> of mesh.join.<token id>.<verb> (unchecked: the caller checks it)."""
    return subject.split(".")[2]


def join_inbox(token_id: str) -> str:
    """A joining machine's inbox prefix: its token's own (mesh.auth.policy)."""
    return f"_INBOX_join_{token_id}"


def ctl_host(name: str, verb: str) -> str:
    return f"mesh.ctl.host.{name}.{verb}"


def host(name: str, verb: str) -> str:
    return f"mesh.host.{name}.{verb}"


def event(name: str, kind: str) -> str:
    """A host's report: `applied`, `processes` (or `>` in permissions)."""
    return f"mesh.event.{name}.{kind}"


def seat(event: str) -> str:
    return f"mesh.seat.{SEAT}.{event}"


def plan(plan_id: int | str) -> str:
    """A plan's progress (its summary at every step or tier change), or `*` in permissions."""
    return f"mesh.plan.{plan_id}"


def machine(name: str) -> str:
    """The holder tells that a machine was drained or undrained (told, not stored: the console
    asks `nodes` again), or `*` in permissions."""
    return f"mesh.machine.{name}"


# NATS service discovery (mesh/discovery.py): $SRV.<PING|INFO|STATS>[.<name>[.<id>]].
SRV = "$SRV"
CONTROLLER_SERVICE = "mesh-controller"  # its id: the controller's instance name
HOST_SERVICE = "mesh-host"  # its id: the machine's name


def srv(verb: str, name: str | None = None, id: str | None = None) -> str:
    """A discovery subject: for every service, for those of `name`, or for one instance."""
    return ".".join([SRV, verb, *([name] if name else []), *([id] if name and id else [])])


def last(subject: str) -> str:
    """The last token: a verb's name, a report's or a seat event's kind. Only ever a key into a
    fixed table or compared with a constant, never dispatched on."""
    return subject.rsplit(".", 1)[-1]


def ctl_host_machine(subject: str) -> str:
    """The <name> of mesh.ctl.host.<name>.<verb> (unchecked: the caller checks it)."""
    return subject.split(".")[3]
