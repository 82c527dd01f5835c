"""What the holder hears from hosts without answering: beats, and each host's `applied`,
`processes` and `tools` reports. A machine speaks only for itself: a report whose subject names
another machine than its body is ignored, as is a malformed one (noise, not a reason to stop),
and one that did not arrive as a report's subject (mesh/origin.py).

On the hosts' own connection (docs/architecture.md, the hosts' traffic), each subscription with
pending limits (past them nats-py drops what comes, counted in one line a window), and each
message within its machine's budget (noisy.py), checked as nats-py parses it: a host flooding
its own subjects costs the holder a check per message, not a message to build, queue and
decode, nor a place in the queue that another host's beat needed."""

import logging

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh import bus, origin, subjects, wire
from mesh.model import Applied, Beat, ProcessesEvent, ToolsEvent
from mesh.ratelimit import PerKey
from mesh.serving import Turns
from services.controller.fleet.fleet import Fleet
from services.controller.fleet.noisy import Budgets
from services.controller.fleet.publishing import Publisher

log = logging.getLogger("mesh.controller")

# A host reports each apply that fails, and one may report as fast as it can send: a machine's
# failures are logged FAILURES_SAID at once, then one each FAILURES_EVERY seconds with how many
# were not (`mesh nodes` shows the last one of each machine, whatever was logged).
FAILURES_SAID = 3
FAILURES_EVERY = 10.0
# What may wait in each subscription (nats-py's pending limits; its defaults are 512Ki messages
# and 128 MiB each): a takeover's fleet of 10,000 beating and reporting again fits many times
# over, and a flood past it is dropped by nats-py instead of queueing for minutes behind.
PENDING_MSGS = 50_000
BEATS_PENDING_BYTES = 16 * 1024 * 1024
REPORTS_PENDING_BYTES = 64 * 1024 * 1024  # a report may be MAX_REPORT (1 MiB)
KEPT_EVERY = 0.25  # seconds between looks at the reports kept past their machine's budget


class HostReports:
    def __init__(self, *, fleet: Fleet, publisher: Publisher, budgets: Budgets) -> None:
        self._fleet = fleet
        self._publisher = publisher
        self._budgets = budgets
        self._failures = PerKey[str](burst=FAILURES_SAID, every=FAILURES_EVERY)
        self._beat_turns = Turns()
        self._event_turns = Turns()

    async def subscribe(self, nc: Client) -> list[Subscription]:
        # Not in a queue group: a paused old holder that NATS has not dropped yet
        # must not take every other beat and report (docs/design.md, the seat).
        beats = await origin.subscribe(
            nc, subjects.HOST_BEATS, cb=self.on_beat,
            pending_msgs_limit=PENDING_MSGS, pending_bytes_limit=BEATS_PENDING_BYTES,
        )  # fmt: skip
        bus.admit(beats, self._budgets.admits("beats"))
        self._fleet.arrivals.sub = beats  # beats are judged by when they came (fleet.py)
        # One subscription for both: a host's `applied` and `processes` reports are handled
        # in the order it sent them (an older snapshot never wins).
        reports = await origin.subscribe(
            nc, subjects.EVENTS, cb=self.on_event,
            pending_msgs_limit=PENDING_MSGS, pending_bytes_limit=REPORTS_PENDING_BYTES,
        )  # fmt: skip
        bus.admit(reports, self._budgets.admits("reports"))
        return [beats, reports]

    async def take_kept(self, nc: Client) -> None:
        """Until cancelled: the reports kept past their machine's budget (the newest of each
        kind), taken as their turn comes, as if they had just come."""
        match = origin.matcher(subjects.EVENTS)
        while True:
            await anyio.sleep(KEPT_EVERY)
            for subject, body in self._budgets.due():
                msg = Msg(_client=nc, subject=subject, data=body)
                if origin.expected(subjects.EVENTS, msg, match):
                    await self.on_event(msg)

    async def on_beat(self, msg: Msg) -> None:
        await self._beat_turns.take()
        try:
            beat = wire.decode(msg.data, Beat)
        except wire.BadRequest as e:  # noise, not a reason to stop
            origin.STRAYS.refused(subjects.HOST_BEATS, msg, str(e))
            return
        if msg.subject != subjects.host(beat.name, "beat"):
            return  # a machine speaks only for itself
        self._fleet.beat(beat)

    async def on_event(self, msg: Msg) -> None:
        await self._event_turns.take()
        kind = subjects.last(msg.subject)
        if kind == "applied":
            self._applied(msg)
        elif kind == "processes":
            self._processes(msg)
        elif kind == "tools":
            self._tools(msg)

    def _tools(self, msg: Msg) -> None:
        try:
            event = wire.decode(msg.data, ToolsEvent, limit=wire.MAX_REPORT)
        except wire.BadRequest as e:
            origin.STRAYS.refused(subjects.EVENTS, msg, str(e))
            return
        if msg.subject == subjects.event(event.name, "tools"):  # only for itself
            self._fleet.heard_tools(event.name, event.servers)

    def _processes(self, msg: Msg) -> None:
        try:
            event = wire.decode(msg.data, ProcessesEvent)
        except wire.BadRequest as e:
            origin.STRAYS.refused(subjects.EVENTS, msg, str(e))
            return
        if msg.subject == subjects.event(event.name, "processes"):  # only for itself
            self._fleet.heard_processes(event.name, event.processes)

    def _applied(self, msg: Msg) -> None:
        try:
            applied = wire.decode(msg.data, Applied)
        except wire.BadRequest as e:
            origin.STRAYS.refused(subjects.EVENTS, msg, str(e))
            return
        if msg.subject != subjects.event(applied.name, "applied"):
            return  # a machine speaks only for itself
        if applied.ok:
            self._fleet.heard_applied(applied.name, applied.digest, None, applied.processes)
        else:
            # An ignored stale value says nothing of the machine; any other kind of step
            # (one of a newer host too: mesh/model.py) is a failure of it.
            if applied.step_kind != "fence":
                self._fleet.heard_applied(
                    applied.name, applied.digest, f"{applied.step}: {applied.error}",
                    applied.processes,
                )  # fmt: skip
            else:  # the key's newest value may be a stale put: put the stored one again
                self._publisher.wanted.pop(applied.name, None)
            self._say_failure(applied)

    def _say_failure(self, applied: Applied) -> None:
        if not self._failures.take(applied.name):
            self._failures.hold(applied.name)
            return
        unsaid = self._failures.held_for(applied.name)
        log.info("machine %s could not apply %s: %s: %s%s", applied.name, applied.digest[:19],
                 applied.step, applied.error,
                 f" (and {unsaid} more failure(s) not logged since the last said)"
                 if unsaid else "")  # fmt: skip
