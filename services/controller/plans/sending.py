"""A plan's steps sent: each machine's `after` (or, reverting, `before`) declaration stored and
published, in one fenced transaction with the steps' state; a restart plan's steps sent as
restarts instead (restarting.py); a step whose machine is drained as it would start skipped,
told to watchers, its declaration kept as the one it would have got (`nodes` shows it wanted).
"""

import logging
from datetime import UTC, datetime

from nats.aio.client import Client

from mesh.model import MachineChanged
from mesh.store import plans
from services.controller.fleet.fleet import Fleet, tell_changed
from services.controller.fleet.publishing import Publisher
from services.controller.plans import restarting, rollout
from services.controller.plans.heard import Heard
from services.controller.plans.progress import Progress
from services.controller.plans.writes import PlanWrites

log = logging.getLogger(__name__)


class Sending:
    def __init__(
        self, *, fleet: Fleet, writes: PlanWrites, publisher: Publisher, nc: Client | None,
        heard: Heard, progress: Progress,
    ) -> None:  # fmt: skip
        self._fleet = fleet
        self._writes = writes
        self._publisher = publisher
        self._nc = nc
        self._heard = heard
        self._progress = progress

    async def send(self, p: plans.Plan, steps: list[plans.Step], which: str) -> None:
        """Send each step: its `after` (or, reverting, `before`) declaration stored and
        published, or, a restart's, its restarts asked."""
        now = datetime.now(UTC)
        bodies: dict[str, tuple[str, bytes]] = {}
        passed: list[str] = []  # drained: told, as no host reports what it now wants
        for s in steps:
            if which == "after" and self._skipped_for_drain(p, s, at=now):
                passed.append(s.machine)
                continue  # nothing stored or published: it keeps what it runs
            self._fleet.wants_what_it_is_sent(s.machine)
            if which == "after":
                bodies[s.machine] = (s.after, s.after_body)
                up = self._fleet.up(s.machine)
                rollout.send(s, up=up, skip_down=p.settings.skip_down, at=now)
            else:
                bodies[s.machine] = rollout.before(s)
            self._fleet.forget_error(s.machine)  # an old failure is not this step's
        if p.trigger == "restart" and which == "after":  # restarted, not sent anew
            async with self._writes.on(p.id) as w:
                await w.steps(steps)
            sent = [s for s in steps if s.machine in bodies and s.state == "applying"]
            await restarting.restart(self._nc, self._fleet, self._heard, module=p.subject,
                                     steps=sent)  # fmt: skip
        else:
            async with self._writes.on(p.id) as w:
                await w.declarations(bodies)
                await w.steps(steps)
            await self._publisher.publish(bodies)
        for machine in passed:
            await tell_changed(self._nc, MachineChanged(machine=machine, drained=True))
        await self._progress.show(p)

    def _skipped_for_drain(self, p: plans.Plan, s: plans.Step, *, at: datetime) -> bool:
        """A step whose machine is drained as it would start: skipped (rollout.skip_drained),
        and `nodes` shows what it would have got as its wanted declaration."""
        if not rollout.skip_drained(s, drained=self._fleet.drained(s.machine), at=at):
            return False
        self._fleet.skipped_for_drain(s.machine, s.after)
        log.info("plan %d: machine %s is drained: skipped", p.id, s.machine)
        return True
