"""What one host may send the holder: a budget per machine for each kind of message, spent before
anything is decoded. A machine over a budget is noisy: what is over is dropped and counted, the
machine named in one line per window and shown `noisy` in `mesh nodes` (issue 39).

A host's credentials let it publish as fast as its link allows on its own subjects, and the
holder would decode every message (a flood of beats left `status` unanswered for seconds, and a
backlog of minutes behind it). A host as mesh runs it stays far inside these: it beats every
`--beat` seconds (0.05 at the fastest), reports once per apply and per change of a process's
state (all again at `held`), and waits for the answer to each request it makes.
"""

import logging
import time
from collections.abc import Callable
from typing import Literal

import anyio

from mesh.ratelimit import PerKey

log = logging.getLogger("mesh.controller")

# Beats: BEAT_BURST at once, then one each BEAT_EVERY seconds (25 a second: a host beating
# every 0.05 s, the fastest `--beat`, stays inside).
BEAT_BURST = 50
BEAT_EVERY = 0.04
# Reports (`applied`, `processes`, `tools`): a machine whose processes all change state at once
# sends a burst of them; 50 a second after that. Past it the newest of each kind is kept (and
# taken in its turn, in the order they came): the holder's view of the machine ends as the
# machine last said, however long the flood, and never older than what it took before.
REPORT_BURST = 200
REPORT_EVERY = 0.02
REPORT_KINDS = frozenset({"applied", "processes", "tools"})  # kept past the budget: the newest
KEPT_MACHINES = 1000  # machines whose reports are kept at once (each at most 3 reports)
# Requests (`register`, `secret`): a host waits for each answer, so it has one or two in flight;
# past this many unanswered, a machine's requests are dropped unanswered (a host asks again
# after its pause). A count in flight, not a rate: a caller that waits for its answers is served
# as fast as the holder answers, however many it asks.
REQUESTS_IN_FLIGHT = 16
ASKING_BACK = 1.0  # seconds in which a request never answered stops counting as in flight
SAY_EVERY = 10.0  # seconds between the lines naming the noisy machines
NOISY_FOR = 60.0  # a machine over a budget is shown noisy this long after
NAMED = 10  # machines named a window, one line each; the rest in one line

Kind = Literal["beats", "reports", "requests"]


def _machine(subject: str, at: int) -> str | None:
    """Token `at` of `subject`: the machine of mesh.host.<name>.beat and mesh.event.<name>.<kind>
    (2) and of mesh.ctl.host.<name>.<verb> (3); None if it has fewer tokens (a stray, which the
    subscription refuses after: mesh/origin.py)."""
    tokens = subject.split(".", at + 1)
    return tokens[at] if len(tokens) > at else None


class Budgets:
    """Every machine's budgets, for as long as the controller runs (a host that floods one
    holder floods the next). Each kind is checked as nats-py parses a message (`admits`,
    mesh.bus.admit), before anything is built of it."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._beats = PerKey[str](burst=BEAT_BURST, every=BEAT_EVERY, clock=clock)
        self._reports = PerKey[str](burst=REPORT_BURST, every=REPORT_EVERY, clock=clock)
        # machine -> its newest report of each kind past the budget, oldest first: while a
        # machine has some, what it sends joins them (a report taken before them would let an
        # older one win afterwards)
        self._kept: dict[str, dict[str, tuple[str, bytes]]] = {}
        # Requests in flight: one taken as it comes, given back as it is answered; one that is
        # never answered (refused as a stray, dropped by pending limits) comes back in a second.
        self._asking = PerKey[str](burst=REQUESTS_IN_FLIGHT, every=ASKING_BACK, clock=clock)
        # What was dropped, as PerKey counts what it holds back: said once a window.
        self._dropped = PerKey[tuple[str, Kind]](burst=1, every=SAY_EVERY, clock=clock)
        self._noisy: dict[str, float] = {}  # machine -> when it was last over a budget

    def admits(self, kind: Kind) -> Callable[[str, bytes], bool]:
        """Whether to take a message of `kind` with this subject and body (False: dropped,
        counted; a report kept to be taken in turn: `due`); a request taken is `answered` once
        it is."""
        if kind == "reports":
            return self._admits_report
        budget, at = (self._beats, 2) if kind == "beats" else (self._asking, 3)

        def admits(subject: str, body: bytes) -> bool:
            machine = _machine(subject, at)
            if machine is None or budget.take(machine):
                return True
            self._drop(machine, kind)
            return False

        return admits

    def _admits_report(self, subject: str, body: bytes) -> bool:
        machine = _machine(subject, 2)
        if machine is None:
            return True
        kept = self._kept.get(machine)
        if kept is None and self._reports.take(machine):
            return True
        report = subject.rsplit(".", 1)[-1]
        if report in REPORT_KINDS and (kept is not None or len(self._kept) < KEPT_MACHINES):
            if kept is None:
                kept = self._kept[machine] = {}
            kept.pop(report, None)  # the newest goes last: they are taken in the order they came
            kept[report] = (subject, body)
        self._drop(machine, "reports")
        return False

    def due(self) -> list[tuple[str, bytes]]:
        """The kept reports whose machine's budget allows them now, each machine's in the order
        they came, as (subject, body): taken as if they had just come (mesh/origin.py still
        judges each subject)."""
        due: list[tuple[str, bytes]] = []
        for machine in list(self._kept):
            kept = self._kept[machine]
            while kept and self._reports.take(machine):
                due.append(kept.pop(next(iter(kept))))
            if not kept:
                del self._kept[machine]
        return due

    def answered(self, machine: str) -> None:
        """A request of `machine` was answered: one more may be in flight."""
        self._asking.refund(machine)

    def _drop(self, machine: str, kind: Kind) -> None:
        self._dropped.hold((machine, kind))
        self._noisy[machine] = self._clock()

    def noisy(self, machine: str) -> bool:
        """Whether `machine` was over a budget within the last NOISY_FOR seconds."""
        at = self._noisy.get(machine)
        return at is not None and self._clock() - at < NOISY_FOR

    def say(self) -> None:
        """Once a window: one line for each machine that was over a budget in it (the first
        NAMED; the rest in one line), with what was dropped."""
        counted = self._dropped.held()
        if counted is None:
            return
        now = self._clock()
        self._noisy = {m: at for m, at in self._noisy.items() if now - at < NOISY_FOR}
        if not counted:
            return
        machines: dict[str, dict[Kind, int]] = {}
        for (machine, kind), n in counted.items():
            machines.setdefault(machine, {})[kind] = n
        loudest = sorted(machines.items(), key=lambda m: -sum(m[1].values()))
        for machine, dropped in loudest[:NAMED]:
            what = ", ".join(f"{n} {kind}" for kind, n in sorted(dropped.items()))
            kept = " (of reports, the newest of each kind kept for its turn)" if (
                "reports" in dropped) else ""  # fmt: skip
            log.warning(
                "machine %s is noisy: dropped %s over its budget in the last %gs, before "
                "decoding%s (a host sends far less: one not behaving as a host)",
                machine[:64], what, SAY_EVERY, kept,
            )  # fmt: skip
        if len(loudest) > NAMED:
            rest = sum(sum(d.values()) for _, d in loudest[NAMED:])
            log.warning("... and %d more noisy machine(s): %d message(s) dropped",
                        len(loudest) - NAMED, rest)  # fmt: skip

    async def keep_saying(self) -> None:
        """`say`, every second (it says only once a window has passed), until cancelled."""
        while True:
            await anyio.sleep(1.0)
            self.say()
