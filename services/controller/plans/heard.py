"""What the planner reads of a machine to judge its step: the fleet's last report of it, and
the names of the processes (and tool servers) a declaration runs, decoded once per digest.
"""

from datetime import datetime

import msgspec

from mesh.model import ProcessState
from mesh.modules.compose import Declaration, tools_of
from services.controller.fleet.fleet import Fleet
from services.controller.plans import rollout

# Digests whose process names are remembered, the most recently used: every machine's
# declaration has its own digest, and a plan judges one or two per machine (after, before).
# Forgotten when the plan ends; this bounds what one very large plan keeps.
NAMES_KEPT = 16384


class Heard:
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        # digest -> the processes it declares, least recently used first (at most NAMES_KEPT)
        self._names: dict[str, frozenset[str]] = {}
        # A restart plan's machines: process -> when the instance running as the restart was
        # asked had started (None: none was heard running). Until a newer one runs, it is not
        # healthy for the plan.
        self._restarted: dict[str, dict[str, datetime | None]] = {}

    def report(self, name: str) -> rollout.Report:
        """What the fleet last heard of a machine, as the planner's rules take it."""
        f = self._fleet
        processes = f.processes.get(name, [])
        restarted = self._restarted.get(name)
        if restarted:
            processes = [
                msgspec.structs.replace(ps, healthy=False) if _not_again(ps, restarted) else ps
                for ps in processes
            ]
        return rollout.Report(
            up=f.up(name),
            applied=f.applied.get(name),
            failed=f.failed_digest.get(name),
            error=f.apply_errors.get(name),
            processes=processes,
            heard=name in f.processes,
        )

    def restarting(self, machine: str, names: list[str]) -> None:
        """A restart of these processes is asked on `machine`: each counts healthy again only
        once an instance started since runs (and is healthy)."""
        running = {ps.name: ps.since for ps in self._fleet.processes.get(machine, [])}
        self._restarted[machine] = {name: running.get(name) for name in names}

    def names(self, digest: str, body: bytes) -> frozenset[str]:
        names = self._names.pop(digest, None)
        if names is None:
            decl = msgspec.json.decode(body, type=Declaration)
            # tool servers too: a plan waits until each is ready (initialized, tools listed)
            names = frozenset(decl.processes) | frozenset(tools_of(decl))
            if len(self._names) >= NAMES_KEPT:  # forget the least recently used
                del self._names[next(iter(self._names))]
        self._names[digest] = names  # last: the most recently used
        return names

    def forget(self) -> None:
        """A plan ended: its digests are done with; the next plan brings its own."""
        self._names.clear()
        self._restarted.clear()


def _not_again(ps: ProcessState, restarted: dict[str, datetime | None]) -> bool:
    """Whether `ps` is still the instance that ran when its restart was asked."""
    if ps.name not in restarted or ps.trial:
        return False
    was = restarted[ps.name]
    return ps.since is None or (was is not None and ps.since <= was)
