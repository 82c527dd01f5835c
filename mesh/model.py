"""The wire: every message between controller, hosts and clients as a strict msgspec.Struct.

Requests forbid unknown fields so a typo is an error, not a silently ignored key. Replies are
encoded with the same Structs, which keeps the JSON shapes of design.md §3 in one place.
"""

from datetime import datetime
from typing import Annotated

import msgspec

Name = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*\Z")
]
Tier = Annotated[int, msgspec.Meta(ge=0, le=9)]
Labels = Annotated[dict[str, str], msgspec.Meta(max_length=64)]
Interval = Annotated[float, msgspec.Meta(gt=0, le=3600)]


class Request(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every request body: unknown fields are refused."""


# --- operator verbs ---------------------------------------------------------------------------


class StatusRequest(Request):
    pass


class NodesRequest(Request):
    pass


class SeatInfo(msgspec.Struct):
    holder: str
    pid: int
    host: str
    epoch: int
    since: datetime


class Standby(msgspec.Struct):
    instance: str
    pid: int
    host: str
    since: datetime


class NodeCounts(msgspec.Struct):
    total: int
    up: int
    down: int


class StatusReply(msgspec.Struct):
    seat: SeatInfo | None
    standbys: list[Standby]
    nodes: NodeCounts
    plan: None = None


class Facts(msgspec.Struct, forbid_unknown_fields=True):
    os: str
    arch: str
    cpus: int
    memory: int  # bytes
    mesh_version: str
    hostname: str = ""
    python: str = ""


class ProcessState(msgspec.Struct):
    name: str
    state: str
    healthy: bool
    pid: int | None


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


class NodesReply(msgspec.Struct):
    nodes: list[Node]


# --- what a host says -------------------------------------------------------------------------


class Register(Request):
    name: Name
    tier: Tier | None  # None keeps the tier the store has (default 2 for a new machine)
    labels: Labels
    facts: Facts
    beat_interval: Interval
    pid: int


class RegisterReply(msgspec.Struct):
    name: str
    tier: int
    epoch: int


class Beat(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    seq: int
    interval: Interval


# --- the seat ---------------------------------------------------------------------------------


class SeatAnnounce(msgspec.Struct, forbid_unknown_fields=True):
    """Published on mesh.seat.mesh-controller.{held,standby,released}."""

    instance: str
    pid: int
    host: str
    since: datetime
    epoch: int = 0


# --- errors -----------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct):
    code: str
    message: str


class ErrorReply(msgspec.Struct):
    error: ErrorBody
