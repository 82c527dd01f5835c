"""Placement that follows labels: a machine that registers for the first time, or whose labels
change, gets each module a standing selector of it matches (`mesh assign MODULE --label K=V`),
and loses each one whose selectors it matched and matches no more. Each through an ordinary
plan of that machine (an assign or unassign, with the module's rollout), asked as the operator
who made the selector; the holder's fleet tells it of each such machine."""

import logging

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from mesh import wire
from mesh.model import AssignRequest
from mesh.store import modules, selectors
from services.controller.changes.modules import Changes
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)

QUEUED = 10_000  # machines waiting to be placed: a fleet registering at once fits


class FollowLabels:
    def __init__(self, *, changes: Changes, epoch: int) -> None:
        self._changes = changes
        self._epoch = epoch
        self._send: ObjectSendStream[tuple[str, dict[str, str] | None, dict[str, str]]]
        self._receive: ObjectReceiveStream[tuple[str, dict[str, str] | None, dict[str, str]]]
        self._send, self._receive = anyio.create_memory_object_stream(QUEUED)

    def heard(self, machine: str, was: dict[str, str] | None, labels: dict[str, str]) -> None:
        """A machine registered for the first time (`was` None) or was labelled: placed in
        turn. Past QUEUED waiting, it is placed at its next labelling or the next holder."""
        try:
            self._send.send_nowait((machine, was, labels))
        except anyio.WouldBlock:
            log.warning("machine %s: not placed by its labels now (%d waiting)", machine, QUEUED)

    async def run(self) -> None:
        """Until cancelled: each machine heard of, placed."""
        async with self._receive:
            async for machine, was, labels in self._receive:
                try:
                    await self._place(machine, was, labels)
                except wire.BadRequest as e:  # a conflict, the store gone: said, not fatal
                    log.warning("machine %s: placing by labels: %s", machine, e)

    async def _place(
        self, machine: str, was: dict[str, str] | None, labels: dict[str, str]
    ) -> None:
        async with self._changes.pool.acquire() as conn:
            standing = await selectors.every(conn)
            wanted = {s.module: s for s in standing if s.matches(labels)}
            lost = {
                s.module: s
                for s in standing
                if was is not None and s.matches(was) and s.module not in wanted
            }
            if not wanted and not lost:  # most machines of most fleets: nothing more to read
                return
            has = await modules.assigned_to(conn, machine)
        for module, s in sorted(wanted.items()):
            if module not in has:
                await self._change(module, machine, s, unassign=False)
        for module, s in sorted(lost.items()):
            if module in has:
                await self._change(module, machine, s, unassign=True)

    async def _change(
        self, module: str, machine: str, s: selectors.Selector, *, unassign: bool
    ) -> None:
        verb = "unassign" if unassign else "assign"
        said = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        log.info("machine %s %s %s: %s by its labels (%s)", machine,
                 "no longer matches" if unassign else "matches", said, verb, module)  # fmt: skip
        audit = Audit(who=s.by or "mesh", verb=verb, subject=module, epoch=self._epoch)
        req = AssignRequest(module=module, machines=[machine], by=s.by or "mesh")
        change = self._changes.unassign if unassign else self._changes.assign
        await change(req, audit, standing=False)
