"""The seat as the holder answers for it: `status` (who holds it, its standbys, the fleet's
counts, the plan rolling) and `handover` (answered first; the seat handed over once the reply
is out)."""

from collections.abc import Callable
from dataclasses import dataclass

import anyio.lowlevel
from anyio.abc import TaskGroup

from mesh import wire
from mesh.model import (
    Handover,
    HandoverReply,
    HandoverRequest,
    SeatInfo,
    StatusReply,
    StatusRequest,
)
from services.controller.fleet.fleet import Fleet
from services.controller.plans.planner import Planner
from services.controller.seat.standbys import Standbys


@dataclass
class Holding:
    seat: SeatInfo  # fixed for as long as this controller holds the seat
    handover: Handover  # how this controller came to hold the seat
    standbys: Standbys
    fleet: Fleet
    planner: Planner
    tasks: TaskGroup  # where the handover starts once its reply is out
    stop: Callable[[], None]  # start a handover

    async def status(self, _: StatusRequest) -> StatusReply:
        return StatusReply(
            seat=self.seat,
            standbys=self.standbys.current(),
            nodes=self.fleet.counts(),
            plan=self.planner.progress.current,
            handover=self.handover,
        )

    async def hand_over(self, _: HandoverRequest) -> HandoverReply:
        """Answered first; the handover starts once the reply is out."""
        standbys = [s.instance for s in self.standbys.current()]
        if not standbys:
            raise wire.BadRequest(
                "no standby controller to hand the seat to (start one: mesh controller run)",
                code="no_standby",
            )
        self.tasks.start_soon(_after_reply, self.stop)
        return HandoverReply(
            holder=self.seat.holder, to=standbys,
            message=f"{self.seat.holder} hands the seat over to a standby ({', '.join(standbys)})",
        )  # fmt: skip


async def _after_reply(stop: Callable[[], None]) -> None:
    await anyio.lowlevel.checkpoint()  # let the reply go out first
    stop()
