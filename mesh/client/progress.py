"""Following a plan to its end as its holder tells it, asking as little as it can.

The holder tells a plan's progress on mesh.plan.<id> at every step or tier change and at its
end (`PlanProgress`: the summary and each tier's counts). A follower subscribes first, then asks
`plan` once (every step; subscribed before, so nothing told meanwhile is missed), and from then
on shows what it is told. It asks `plan` again only when it must: at the end (the steps the
outcome shows), after a quiet while (a message lost, or a holder with nothing to say: a step
waiting for a machine's health), and when a `held` says the seat changed hands (a new holder
tells nothing until its next step). Each ask rides over a handover or a takeover as `ask` does.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import nats.errors
from anyio.streams.memory import MemoryObjectReceiveStream
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh import subjects, wire
from mesh.client.asking import VerbFailed
from mesh.client.pages import ask_list
from mesh.model import PlanProgress, PlanReply, PlanRequest

FINAL = ("done", "failed", "reverted", "cancelled", "rejected")
QUIET = 3.0  # seconds without a word from the holder before `plan` is asked
# A plan held for its approval, or paused, may wait for hours with nothing to tell; the verb
# that moves it on tells it at once, so `plan` is asked far less often meanwhile.
WAITING = ("held", "paused")
QUIET_WAITING = 30.0
ASK_WITHIN = 30.0  # one ask of `plan`, across a handover or a takeover
TOLD_QUEUE = 64  # messages waiting to be shown; past that they are dropped (the next ask has them)


@asynccontextmanager
async def _told(nc: Client, plan_id: int) -> AsyncIterator[MemoryObjectReceiveStream[Msg]]:
    """The plan's progress and the seat's `held`, as they come, subscribed (and flushed) before
    the caller asks anything."""
    send, receive = anyio.create_memory_object_stream[Msg](TOLD_QUEUE)

    async def heard(msg: Msg) -> None:
        try:
            send.send_nowait(msg)
        except (anyio.WouldBlock, anyio.ClosedResourceError):  # a quiet while asks instead
            pass

    subs = [await nc.subscribe(subjects.plan(plan_id), cb=heard),
            await nc.subscribe(subjects.seat("held"), cb=heard)]  # fmt: skip
    try:
        await nc.flush()
        with receive:
            yield receive
    finally:
        with anyio.CancelScope(shield=True):
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except nats.errors.Error:  # the connection is gone: so are its subscriptions
                    pass
        send.close()


async def follow_plan(
    nc: Client,
    *,
    url: str,
    plan_id: int,
    show: Callable[[PlanReply | PlanProgress], None],
    timeout: float = ASK_WITHIN,
    quiet: float = QUIET,
) -> PlanReply:
    """Follow plan `plan_id` until it ends, handing `show` each state: a `PlanReply` when
    `plan` was asked (every step), a `PlanProgress` when the holder told one. The plan as it
    ended (every step)."""

    async def asked() -> PlanReply:
        try:
            return await ask_list(nc, url=url, verb="plan", reply=PlanReply,
                                  request=PlanRequest(id=plan_id), timeout=timeout)  # fmt: skip
        except nats.errors.ConnectionClosedError:
            raise VerbFailed(
                f"the connection to NATS at {url} closed while following plan {plan_id}; "
                f"`mesh plan {plan_id} --follow` follows it again"
            ) from None

    async with _told(nc, plan_id) as told:
        plan = await asked()
        show(plan)
        state = plan.state
        while state not in FINAL:
            msg = None
            with anyio.move_on_after(QUIET_WAITING if state in WAITING else quiet):
                msg = await told.receive()
            if msg is not None and msg.subject == subjects.plan(plan_id):
                try:
                    progress = wire.decode(msg.data, PlanProgress)
                except wire.BadRequest:
                    continue  # not the holder's words: what it says next, or a quiet while
                if progress.state not in FINAL:
                    state = progress.state
                    show(progress)
                    continue
            plan = await asked()  # quiet, a new holder, or the end: every step
            state = plan.state
            show(plan)
    return plan
