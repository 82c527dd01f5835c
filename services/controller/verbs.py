"""The controller's verbs: a fixed table from name to (request Struct, handler).

Nothing is dispatched by a name taken from a message (Salt CVE-2020-11651): the subject's verb
token is only ever a key into these tables. Every body is decoded strictly; a bad one gets an
error reply naming what was wrong and the controller keeps serving.
"""

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskGroup
from nats.aio.msg import Msg

from mesh import bus, wire
from mesh.model import (
    AssignRequest,
    BuildLogsReply,
    BuildLogsRequest,
    ChangeReply,
    DeclarationReply,
    DeclarationRequest,
    DiffReply,
    DiffRequest,
    Handover,
    HandoverReply,
    HandoverRequest,
    LabelReply,
    LabelRequest,
    ModulesReply,
    ModulesRequest,
    NodesReply,
    NodesRequest,
    PlanReply,
    PlanRequest,
    PlansReply,
    PlansRequest,
    PushRequest,
    Register,
    RegisterReply,
    SeatInfo,
    SecretReply,
    SecretRequest,
    SecretSetRequest,
    StatusReply,
    StatusRequest,
    TierReply,
    TierRequest,
)
from mesh.names import InvalidName, check_name
from services.controller.catalog import Catalog
from services.controller.fleet import Fleet
from services.controller.planner import Planner
from services.controller.standbys import Standbys

log = logging.getLogger(__name__)

# Slow verbs served at once. They share a store pool of 4 connections (and builds): more in
# flight only queue inside the controller, holding memory and their callers' time, so past
# this many a slow verb is answered `busy` at once and the caller tries again (`mesh` does).
SLOW_IN_FLIGHT = 16
# Host requests (register, secret) served at once. After a takeover every host registers again:
# they are served side by side rather than one behind another (and behind a store stall);
# past this many the rest wait in the subscription's buffer, in the order they came.
HOST_IN_FLIGHT = 32
HOST_SLOT_WAIT = 5.0  # longer than a host's attempt (1 s): it has asked again by then


class Holder(msgspec.Struct):
    """What the verbs need of the controller that holds the seat."""

    seat: SeatInfo  # fixed for as long as this controller holds the seat
    fleet: Fleet
    standbys: Standbys
    catalog: Catalog
    planner: Planner
    tasks: TaskGroup  # where verbs that wait on the store or a build run, off the hot path
    handover: Handover  # how this controller came to hold the seat
    stop: Callable[[], None]  # start a handover (the `handover` verb)
    # Slow verbs and host requests in flight (see SLOW_IN_FLIGHT, HOST_IN_FLIGHT).
    slow: anyio.CapacityLimiter = msgspec.field(
        default_factory=lambda: anyio.CapacityLimiter(SLOW_IN_FLIGHT)
    )
    host_requests: anyio.CapacityLimiter = msgspec.field(
        default_factory=lambda: anyio.CapacityLimiter(HOST_IN_FLIGHT)
    )


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


async def nodes(h: Holder, _: NodesRequest) -> NodesReply:
    return NodesReply(nodes=h.fleet.nodes(wanted=h.catalog.wanted))


async def register(h: Holder, machine: str, req: Register) -> RegisterReply:
    if req.name != machine:
        raise wire.BadRequest(
            f"name: {req.name!r} differs from the subject's machine {machine!r}", code="forbidden"
        )
    row = await h.fleet.register(req)
    return RegisterReply(name=row.name, tier=row.tier, epoch=h.seat.epoch, labels=row.labels)


async def push(h: Holder, req: PushRequest) -> ChangeReply:
    return await h.catalog.push(req)


async def assign(h: Holder, req: AssignRequest) -> ChangeReply:
    return await h.catalog.assign(req)


async def unassign(h: Holder, req: AssignRequest) -> ChangeReply:
    return await h.catalog.assign(req, undo=True)


async def modules(h: Holder, _: ModulesRequest) -> ModulesReply:
    return await h.catalog.modules()


async def declaration(h: Holder, req: DeclarationRequest) -> DeclarationReply:
    return await h.catalog.declaration(req.machine)


async def secret_set(h: Holder, req: SecretSetRequest) -> ChangeReply:
    return await h.catalog.secret_set(req)


async def diff(h: Holder, req: DiffRequest) -> DiffReply:
    return await h.catalog.diff(req)


async def build_logs(h: Holder, req: BuildLogsRequest) -> BuildLogsReply:
    return await h.catalog.build_logs(req)


async def plan(h: Holder, req: PlanRequest) -> PlanReply:
    return await h.catalog.plan(req.id)


async def plans(h: Holder, req: PlansRequest) -> PlansReply:
    return await h.catalog.plans(req.limit)


async def tier(h: Holder, req: TierRequest) -> TierReply:
    was, registered = await h.fleet.set_tier(req.machine, req.tier)
    return TierReply(machine=req.machine, tier=req.tier, was=was, registered=registered)


async def label(h: Holder, req: LabelRequest) -> LabelReply:
    labels, was, registered = await h.fleet.set_labels(req.machine, add=req.set, remove=req.remove)
    return LabelReply(machine=req.machine, labels=labels, was=was, registered=registered)


class Verb(msgspec.Struct, frozen=True):
    request: type
    handler: Callable[..., Awaitable[Any]]
    slow: bool = False  # waits on the store or a build: runs in its own task
    limit: int = wire.MAX_BODY


# Bytes of body per verb (docs/verbs.md, Limits); nats-server's max_payload (1 MiB) caps them all.
_SMALL = 4 * 1024  # names and numbers
_MODULE_BODY = 640 * 1024  # a manifest of up to 256 KiB, JSON-escaped; thousands of names
_SECRET_BODY = 768 * 1024  # a secret of up to 512 KiB, as base64

VERBS: dict[str, Verb] = {
    "status": Verb(StatusRequest, status, limit=_SMALL),
    "nodes": Verb(NodesRequest, nodes, limit=_SMALL),
    "push": Verb(PushRequest, push, slow=True, limit=_MODULE_BODY),
    "diff": Verb(DiffRequest, diff, slow=True, limit=_MODULE_BODY),
    "assign": Verb(AssignRequest, assign, slow=True, limit=_MODULE_BODY),
    "unassign": Verb(AssignRequest, unassign, slow=True, limit=_MODULE_BODY),
    "modules": Verb(ModulesRequest, modules, slow=True, limit=_SMALL),
    "declaration": Verb(DeclarationRequest, declaration, slow=True, limit=_SMALL),
    "secret-set": Verb(SecretSetRequest, secret_set, slow=True, limit=_SECRET_BODY),
    "build-logs": Verb(BuildLogsRequest, build_logs, slow=True, limit=_SMALL),
    "plan": Verb(PlanRequest, plan, slow=True, limit=_SMALL),
    "plans": Verb(PlansRequest, plans, slow=True, limit=_SMALL),
    "tier": Verb(TierRequest, tier, slow=True, limit=_SMALL),
    "label": Verb(LabelRequest, label, slow=True),  # up to 64 labels: as a registration
    "handover": Verb(HandoverRequest, hand_over, limit=_SMALL),
}


async def host_secret(h: Holder, machine: str, req: SecretRequest) -> SecretReply:
    return await h.catalog.secret_for(machine, req.name)


HOST_VERBS: dict[str, Verb] = {
    "register": Verb(Register, register),
    "secret": Verb(SecretRequest, host_secret, limit=_SMALL),
}


async def on_verb(h: Holder, msg: Msg) -> None:
    """mesh.ctl.<verb>"""

    name = msg.subject.split(".")[2]
    verb = VERBS.get(name)

    async def serve() -> Any:
        if verb is None:
            raise wire.BadRequest(
                f"unknown verb {name[:64]!r}; known: {', '.join(sorted(VERBS))}",
                code="unknown_verb",
            )
        return await verb.handler(h, wire.decode(msg.data, verb.request, limit=verb.limit))

    if verb is not None and verb.slow:
        slot = object()  # borrows one of SLOW_IN_FLIGHT; given back when answered
        try:
            h.slow.acquire_on_behalf_of_nowait(slot)
        except anyio.WouldBlock:

            async def busy() -> Any:
                raise wire.BadRequest(
                    f"the controller is busy ({SLOW_IN_FLIGHT} slow verbs in flight); try again",
                    code="busy",
                )

            log.warning("busy: refused %s (%d slow verbs in flight)", name, SLOW_IN_FLIGHT)
            await bus.answer(msg, busy)
            return
        try:
            h.tasks.start_soon(_answer_then_release, h.slow, slot, msg, serve)
            return
        except RuntimeError:  # stopping: the task group is closed; answer here instead
            h.slow.release_on_behalf_of(slot)
    await bus.answer(msg, serve)


async def _answer_then_release(
    limiter: anyio.CapacityLimiter, slot: object, msg: Msg, serve: Callable[[], Awaitable[Any]]
) -> None:
    try:
        await bus.answer(msg, serve)
    finally:
        limiter.release_on_behalf_of(slot)


async def on_host_verb(h: Holder, msg: Msg) -> None:
    """mesh.ctl.host.<machine>.<verb>: each in its own task (a slow `secret` does not hold up a
    `register`), at most HOST_IN_FLIGHT at once, started in the order they came. Neither verb
    needs more order than that: each reply goes to its own request, and registrations go
    through the fleet's (fair) lock one at a time. A host's applied/processes reports, which
    must stay in order, have a subscription of their own (main.py) and are not served here."""

    async def serve() -> Any:
        _, _, _, machine, name = msg.subject.split(".")
        try:
            check_name(machine, field="machine")
        except InvalidName as e:
            raise wire.BadRequest(str(e)) from None
        verb = HOST_VERBS.get(name)
        if verb is None:
            raise wire.BadRequest(
                f"unknown host verb {name[:64]!r}; known: {', '.join(sorted(HOST_VERBS))}",
                code="unknown_verb",
            )
        return await verb.handler(h, machine, wire.decode(msg.data, verb.request, limit=verb.limit))

    slot = object()
    got = False
    # Waiting here holds the next host requests in the subscription's buffer, in order.
    with anyio.move_on_after(HOST_SLOT_WAIT):
        await h.host_requests.acquire_on_behalf_of(slot)
        got = True
    if not got:

        async def busy() -> Any:
            raise wire.BadRequest(
                f"the controller is busy ({HOST_IN_FLIGHT} host requests in flight); try again",
                code="busy",
            )

        log.warning("busy: refused %s (%d host requests in flight)", msg.subject, HOST_IN_FLIGHT)
        await bus.answer(msg, busy)
        return
    try:
        h.tasks.start_soon(_answer_then_release, h.host_requests, slot, msg, serve)
        return
    except RuntimeError:  # stopping: the task group is closed; answer here instead
        h.host_requests.release_on_behalf_of(slot)
    await bus.answer(msg, serve)
