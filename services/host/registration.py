"""Registering with the seat's holder: at start, and again when a new holder says `held`.

After a takeover every host of the fleet registers again, and at ten thousand machines that is a
storm: the new holder announces a window (`SeatAnnounce.register_within`, seconds, sized by the
fleet it loaded) and each host waits a random moment within it before it asks, so the
registrations arrive spread evenly instead of all in the first few milliseconds. The holder
judges nobody down for the silence of a takeover (services/controller/fleet/fleet.py), so waiting
costs a machine nothing: its beats keep it up meanwhile.

`follow` is the task that hears every `held` from the agent's start (main.py subscribes before
the first registration, so a takeover during it is not missed): a new holder is registered
with, and our own holder back on NATS after an outage of its own is told everything again.
"""

import logging
import random
import time
from collections.abc import Callable

import anyio
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from mesh import bus, origin, subjects, wire
from mesh.auth.signing import Signing
from mesh.errors import MeshError
from mesh.model import Register, RegisterReply, SeatAnnounce
from services.host.reporting import Reports
from services.host.verbs import HostStatus

log = logging.getLogger("mesh.host")

ATTEMPT = 2.0  # the first registration request's answer window; doubled after each one
ATTEMPT_MOST = 16.0  # unanswered, up to this: a busy controller is not asked ever faster
RETRY_PAUSE = 1.0  # after `busy` (or a failure), about this long; doubled, up to ATTEMPT_MOST
NEWER_HOLDER_WAIT = 0.25  # between registrations answered by an older holder than announced
REFUSALS = ("bad_request", "forbidden")  # the controller's answer is final for these


class RegistrationRefused(MeshError):
    """The controller refused this host's registration for what it is, not for a passing fault."""


def delay(announce: SeatAnnounce) -> float:
    """How long to wait before registering with the holder that announced `held`: a random
    moment within the window it asked for (0 for a small fleet)."""
    return random.uniform(0.0, max(0.0, announce.register_within))


async def register(
    nc: Client, current: Callable[[], Register], status: HostStatus, *, at_least: int = 0
) -> None:
    """Register, retrying until some controller answers; log the wait once, not per attempt.
    With `at_least`, until the holder of that epoch (or a later one) answers: the old holder
    may still answer for a moment after a takeover, and the new one must hear from us. Each
    attempt says what is applied now: an apply that ends meanwhile must not be taken back."""
    registration = current()
    subject = subjects.ctl_host(registration.name, "register")
    waited = False
    attempt, pause = ATTEMPT, RETRY_PAUSE
    while True:
        registration = current()
        body = wire.encode(registration)
        try:
            # One request a window, answered or not (`no responders` aside: nobody heard it):
            # asked again every second within it, ten thousand hosts whose controller is slow
            # to answer would ask ever more often than it answers (issue 32's cold start).
            data = await bus.request(nc, subject, body, deadline=time.monotonic() + attempt,
                                     attempt_timeout=attempt)  # fmt: skip
        except bus.NoAnswer:
            if not waited:
                log.info("host %s: no controller answers yet; still trying", registration.name)
                waited = True
            # Asked again, the controller finds this registration already waiting and answers
            # both as one (mesh/batching.py); a longer wait asks less of a controller that is
            # slow because ten thousand hosts are asking.
            attempt = min(attempt * 2, ATTEMPT_MOST)
            continue
        try:
            reply = wire.decode_reply(data, RegisterReply)
        except wire.RemoteError as e:
            if e.code in REFUSALS:  # retrying the same registration cannot help
                raise RegistrationRefused(
                    f"host {registration.name}: registration refused: {e}"
                ) from None
            if e.code != "busy":
                log.warning("host %s: registration failed (%s), retrying", registration.name, e)
            await anyio.sleep(random.uniform(0.5, 1.5) * pause)  # spread: not all back at once
            pause = min(pause * 2, ATTEMPT_MOST)
            continue
        if reply.epoch < at_least:  # the old holder, answering as it steps down: again
            await anyio.sleep(NEWER_HOLDER_WAIT)
            continue
        status.registered = True
        status.epoch = reply.epoch
        status.tier = reply.tier
        status.labels = reply.labels
        log.info(
            "host %s registered with the controller (epoch %d, tier %d, labels %s)",
            registration.name, reply.epoch, reply.tier, reply.labels,
        )  # fmt: skip
        asked_tier = registration.tier not in (None, reply.tier)
        if asked_tier or (registration.labels and registration.labels != reply.labels):
            # The tier and labels decide what this machine gets: on a mesh with credentials
            # they are the operator's alone, and --tier/--label count for nothing.
            log.warning(
                "host %s: --tier/--label were not taken (the operator sets them: mesh machine "
                "add --tier --label, mesh tier, mesh label)", registration.name,
            )  # fmt: skip
        return


async def follow(
    nc: Client,
    held: Subscription,
    *,
    current: Callable[[], Register],
    status: HostStatus,
    signing: Signing,
    reports: Reports,
) -> None:
    """The seat's follower: acts on each announcement `held` brings (its subscription to
    mesh.seat.mesh-controller.held), until cancelled."""
    async for msg in origin.arrivals(held):
        # Signed by the controllers, or refused: a forged `held` would set every host registering.
        announce = signing.announcement(msg, subscribed=held.subject)
        if announce is None:
            continue
        if announce.epoch > status.epoch:  # a holder we have not registered with
            await anyio.sleep(delay(announce))  # spread the storm
            await register(nc, current, status, at_least=announce.epoch)
            await reports.both()
        elif announce.epoch == status.epoch:
            # Our holder, back on NATS after an outage of its own: what we reported
            # meanwhile may not have reached it.
            await reports.again()
