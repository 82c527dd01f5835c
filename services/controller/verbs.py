"""The controller's verbs: a fixed table from name to (request Struct, handler).

Nothing is dispatched by a name taken from a message (Salt CVE-2020-11651): the subject's verb
token is only ever a key into these tables. Every body is decoded strictly; a bad one gets an
error reply naming what was wrong and the controller keeps serving.
"""

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from mesh import wire
from mesh.model import (
    NodesReply,
    NodesRequest,
    Register,
    RegisterReply,
    SeatInfo,
    StatusReply,
    StatusRequest,
)
from mesh.names import InvalidName, check_name
from services.controller.fleet import Fleet
from services.controller.standbys import Standbys

log = logging.getLogger(__name__)


class Holder(msgspec.Struct):
    """What the verbs need of the controller that holds the seat."""

    seat: SeatInfo  # fixed for as long as this controller holds the seat
    fleet: Fleet
    standbys: Standbys


async def status(h: Holder, _: StatusRequest) -> StatusReply:
    return StatusReply(
        seat=h.seat,
        standbys=h.standbys.current(),
        nodes=h.fleet.counts(),
    )


async def nodes(h: Holder, _: NodesRequest) -> NodesReply:
    return NodesReply(nodes=h.fleet.nodes())


async def register(h: Holder, machine: str, req: Register) -> RegisterReply:
    if req.name != machine:
        raise wire.BadRequest(
            f"name: {req.name!r} differs from the subject's machine {machine!r}", code="forbidden"
        )
    row = await h.fleet.register(req)
    return RegisterReply(name=row.name, tier=row.tier, epoch=h.seat.epoch)


Verb = tuple[type, Callable[..., Awaitable[Any]]]

VERBS: dict[str, Verb] = {
    "status": (StatusRequest, status),
    "nodes": (NodesRequest, nodes),
}

HOST_VERBS: dict[str, Verb] = {
    "register": (Register, register),
}


async def _answer(msg: Msg, serve: Callable[[], Awaitable[Any]]) -> None:
    if not msg.reply:
        return  # a publish, not a request: nobody to answer
    try:
        body = wire.encode(await serve())
    except wire.BadRequest as e:
        body = wire.error(e.code, str(e))
    except Exception as e:
        log.exception("verb on %s failed", msg.subject)
        body = wire.error("internal", f"{type(e).__name__}: {e}")
    await msg.respond(body)


async def on_verb(h: Holder, msg: Msg) -> None:
    """mesh.ctl.<verb>"""

    async def serve() -> Any:
        name = msg.subject.split(".")[2]
        verb = VERBS.get(name)
        if verb is None:
            raise wire.BadRequest(
                f"unknown verb {name[:64]!r}; known: {', '.join(sorted(VERBS))}",
                code="unknown_verb",
            )
        req_type, handler = verb
        return await handler(h, wire.decode(msg.data, req_type))

    await _answer(msg, serve)


async def on_host_verb(h: Holder, msg: Msg) -> None:
    """mesh.ctl.host.<machine>.<verb>"""

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
        req_type, handler = verb
        return await handler(h, machine, wire.decode(msg.data, req_type))

    await _answer(msg, serve)
