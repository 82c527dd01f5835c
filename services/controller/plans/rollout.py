"""The planner's decisions, as pure functions over plain data: no I/O, no clock.

The planner (planner.py) does the store writes, the publishing and the waiting; what it decides
is here, so each rule can be tested in microseconds instead of through a whole mesh
(tests/test_rollout.py): which steps of a tier to send next (`max_parallel` at a time), when a
machine's report makes a step done or failed and why, when a step's deadline has passed, what a
failure does to the tier's other steps, which machines a revert gives their old declaration
back, tier by tier in reverse, and which a drain keeps out of both. Times come in as arguments:
`now` is monotonic seconds (for deadlines), `at` the wall-clock time written into a step.

The operator's hand (docs/operations.md, Steering a change) is here too: a tier's waves (its
canaries, then the rest), when a soak starts, goes on or has passed, whether a machine stayed
healthy through it, and when the plan pauses itself (`pause_after`).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Literal

import msgspec

from mesh.model import PlanSettings, PlanTier, ProcessState, TierState
from mesh.modules import gate
from mesh.modules.compose import encode, merge
from mesh.store.plans import Step, TierCounts

# digest and body of a declaration -> the names of the processes it declares
Names = Callable[[str, bytes], frozenset[str]]


class Report(msgspec.Struct, frozen=True):
    """What the fleet last heard of one machine."""

    up: bool = True
    applied: str | None = None  # the digest it reports applied
    failed: str | None = None  # the digest whose apply stopped
    error: str | None = None  # where and why that apply stopped
    processes: list[ProcessState] = []
    # Its processes reported since this holder took the seat (a registration says only the
    # digest applied; its processes come in a report of their own, moments later).
    heard: bool = True


# --- one machine ---------------------------------------------------------------------------------


def judge(
    *, report: Report, digest: str, names: Callable[[], frozenset[str]], crash_loop: int = 0
) -> bool | str | None:
    """True: `digest` applied and every process it declares healthy; a string: why it failed
    (its apply, or a process its host restarted `crash_loop` times in a row); None: not yet. A
    report about another digest (an old one) decides nothing, and a start-first trial's health
    is not its process's: the old version is still the one serving. `names` (the processes
    `digest` declares) is asked only once it is applied: decoding a declaration costs, and a
    tier of thousands is judged at every report."""
    if report.failed == digest:
        return report.error if report.error is not None else "the apply failed"
    if report.applied != digest:
        return None
    states = {ps.name: ps for ps in report.processes if not ps.trial}
    waiting = False
    for name in names():
        ps = states.get(name)
        if ps is not None and not ps.healthy and crash_loop and ps.in_a_row >= crash_loop:
            return f"process {name} is in a crash loop: {cause(ps)}"  # in_a_row: never empty
        waiting = waiting or ps is None or not ps.healthy
    return None if waiting else True


def cause(ps: ProcessState) -> str:
    """What a process's host says of why it is not healthy: how it last exited, what its check
    said, how often it was restarted; "" when the host says nothing more."""
    said = [ps.reason + (f" (its last line: {ps.said})" if ps.said else "")] if ps.reason else []
    said += [f"its check said: {ps.check}"] if ps.check else []
    said += [ps.error] if ps.error else []  # a tool server's (it does not speak MCP, ...)
    if ps.in_a_row:
        said.append(f"restarted {ps.in_a_row} time(s) in a row")
    elif ps.restarts:
        said.append(f"restarted {ps.restarts} time(s)")
    return "; ".join(said)


def why(
    *, machine: str, report: Report, digest: str, names: frozenset[str], deadline: float
) -> str:
    """Why a machine is not there yet, for a step that ran out of time."""
    if not report.up:
        return f"machine {machine} is down"
    if report.applied != digest:
        trials = [ps for ps in report.processes if ps.trial and not ps.healthy]
        if trials:  # a start-first trial still waiting for its checks
            said = cause(trials[0])
            return (f"process {trials[0].name} (new version) is {trials[0].state}, not healthy, "
                    f"after {deadline:g}s" + (f": {said}" if said else ""))  # fmt: skip
        return f"did not apply its new declaration within {deadline:g}s"
    states = {ps.name: ps for ps in report.processes if not ps.trial}
    for name in sorted(names):
        ps = states.get(name)
        if ps is None:
            return f"process {name} is not running after {deadline:g}s"
        if ps.tool and not ps.healthy:  # a tool server says why (it does not speak MCP, ...)
            why = f": {ps.error}" if ps.error else ""
            return f"tool server {name} is {ps.state}, not ready, after {deadline:g}s{why}"
        if not ps.healthy:
            said = cause(ps)
            return f"process {name} is {ps.state}, not healthy, after {deadline:g}s" + (
                f": {said}" if said else ""
            )
    return f"not healthy after {deadline:g}s"


def before(step: Step) -> tuple[str, bytes]:
    """The declaration a revert gives the machine back: digest and body."""
    if step.before is not None and step.before_body is not None:
        return step.before, step.before_body
    body, digest = encode(merge(step.machine, []))  # it had none: nothing runs there again
    return digest, body


# --- a plan --------------------------------------------------------------------------------------


def tiers(steps: list[Step]) -> list[int]:
    """The plan's tiers in the order they roll forward."""
    return sorted({s.tier for s in steps})


def tier_counts(steps: list[Step]) -> list[TierCounts]:
    """Each tier's steps counted, as the store counts them for `plan` (store.plans.tiers)."""
    by_tier: dict[int, list[Step]] = {}
    for s in steps:
        by_tier.setdefault(s.tier, []).append(s)
    return [_counted(tier, mine) for tier, mine in sorted(by_tier.items())]


def _counted(tier: int, steps: list[Step]) -> TierCounts:
    states = [s.state for s in steps]
    return TierCounts(
        tier=tier, total=len(steps), done=sum(s in ("done", "skipped") for s in states),
        failed="failed" in states, reverted=any(s.reverted for s in steps),
        moving="applying" in states or "done" in states,
    )  # fmt: skip


def tier_shown(t: TierCounts, *, soaking: bool = False) -> PlanTier:
    """A tier as `plan` and the told progress show it: its counts and its state (`soaking`:
    the plan's soak in progress is this tier's)."""
    state: TierState
    if t.failed:
        state = "failed"
    elif t.reverted:
        state = "reverted"
    elif soaking:
        state = "soaking"
    elif t.done == t.total:
        state = "done"
    else:
        state = "rolling" if t.moving else "pending"
    return PlanTier(tier=t.tier, state=state, total=t.total, done=t.done)


def revert_order(steps: list[Step]) -> list[int]:
    """The order a revert takes: the last tier changed first."""
    return sorted({s.tier for s in steps}, reverse=True)


def recorded_failure(steps: list[Step]) -> str | None:
    """The failure of a plan continued from the store: a failed step already there (written
    with its plan's stop) means it never rolls on."""
    bad = next((s for s in steps if s.state == "failed"), None)
    return f"machine {bad.machine}: {bad.error}" if bad else None


def prepare(
    steps: list[Step],
    *,
    composed: dict[str, tuple[str, bytes]],
    stored: dict[str, tuple[str, bytes, int]],  # digest, body, the epoch that wrote it
    tier_of: dict[str, int],
    at: datetime,
    restart: bool = False,
) -> None:
    """A plan starting: each step's new and old declarations and its machine's tier as it is
    now (`mesh tier` may have moved it); a step whose machine has nothing to change is skipped
    (a restart's keeps its declaration: it has nothing to change, and is restarted)."""
    for s in steps:
        if s.machine not in composed:  # a restart's machine with no declaration any more
            s.state, s.finished, s.error = "skipped", at, "it has no declaration to restart"
            continue
        s.after, s.after_body = composed[s.machine]
        old = stored.get(s.machine)
        s.before, s.before_body = (old[0], old[1]) if old else (None, None)
        s.tier = tier_of[s.machine]
        if s.before == s.after and not restart:
            s.state, s.finished = "skipped", at
            s.error = "no change by the time the plan started"


def to_revert(steps: list[Step], *, tier: int) -> list[Step]:
    """A tier's machines that got a new declaration and have not had the old one back."""
    return [s for s in steps if s.tier == tier and s.published and not s.reverted]


def reverted(steps: list[Step], *, unsettled: dict[str, str]) -> None:
    """Mark a tier's reverted steps; `unsettled` maps the machines that did not settle on their
    old declaration within the deadline to why, noted on their steps (never waited for longer)."""
    for s in steps:
        s.reverted = True
        if s.state != "failed":
            s.state = "reverted"  # `finished` stays when its forward step finished
        if s.machine in unsettled:
            note = f"revert: {unsettled[s.machine]}"
            s.error = f"{s.error}; {note}" if s.error else note


# --- one tier forward ----------------------------------------------------------------------------


@dataclass
class Tier:
    """One tier rolling forward: the steps not sent yet, and the ones sent and awaited, each
    with its deadline in monotonic seconds."""

    steps: list[Step]
    limit: int
    deadline: float
    queue: list[Step]
    crash_loop: int = 0  # restarts in a row that fail a step at once (0: none do)
    active: dict[str, tuple[Step, float]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Nothing left to send or to wait for: the tier is complete."""
        return not self.queue and not self.active


def rolling(steps: list[Step], *, tier: int, settings: PlanSettings) -> Tier | None:
    """A tier's steps still to roll (pending, or applying when a plan is continued); None when
    there are none. `max_parallel` 0 means the whole tier at once."""
    mine = [s for s in steps if s.tier == tier and s.state in ("pending", "applying")]
    if not mine:
        return None
    return Tier(
        steps=mine,
        limit=settings.max_parallel or len(mine),
        deadline=settings.deadline,
        queue=[s for s in mine if s.state == "pending"],
        crash_loop=settings.crash_loop,
    )


def resumed(t: Tier) -> list[Step]:
    """Steps in flight when the last holder stopped: sent again, then awaited."""
    return [s for s in t.steps if s.state == "applying"]


def next_batch(t: Tier) -> list[Step]:
    """The steps to send now: as many as `max_parallel` leaves room for."""
    room = t.limit - len(t.active)
    if room <= 0 or not t.queue:
        return []
    batch, t.queue = t.queue[:room], t.queue[room:]
    return batch


def send(step: Step, *, up: bool, skip_down: bool, at: datetime) -> None:
    """A step whose new declaration is being sent: applying; or, with `skip_down` and its
    machine down, skipped (it gets the declaration when it comes back)."""
    if step.state != "pending":
        return  # resumed: sent again as it was
    step.state, step.started, step.published = "applying", at, True
    if skip_down and not up:
        step.state, step.finished = "skipped", at
        step.error = (f"machine {step.machine} is down: skipped; it gets this "
                      "declaration when it comes back")  # fmt: skip


# --- drained machines (`mesh drain`): out of every plan, keeping what they run ------------------


def drain_note(machine: str) -> str:
    return (f"machine {machine} is drained: skipped; it keeps what it runs until `mesh undrain "
            f"{machine}`")  # fmt: skip


def skip_drained(step: Step, *, drained: bool, at: datetime) -> bool:
    """A step about to start on a drained machine is skipped, unsent: its machine's declaration
    is neither stored nor published (a step already in flight, resumed by a new holder, goes
    on). True if it was skipped. Asked at the moment each step would start, so a machine
    drained while its plan rolls is skipped from then on."""
    if step.state != "pending" or not drained:
        return False
    step.state, step.finished, step.error = "skipped", at, drain_note(step.machine)
    return True


def kept_by_drain(steps: list[Step], *, drained: Callable[[str], bool]) -> list[Step]:
    """Of a tier's steps to revert, those of machines drained since they changed: they keep the
    new declaration (a drained machine keeps what it runs, a revert included), noted on the
    step once; they are reverted by no plan, and undrained, their machine gets what the catalog
    composes for it then."""
    kept = [s for s in steps if drained(s.machine)]
    for s in kept:
        said = f"machine {s.machine} is drained: not reverted; it keeps this declaration"
        if s.error is None or said not in s.error:
            s.error = f"{s.error}; {said}" if s.error else said
    return kept


def await_(t: Tier, steps: list[Step], *, now: float) -> None:
    """Wait for these sent steps (not the skipped ones) until `now` + the deadline."""
    t.active.update((s.machine, (s, now + t.deadline)) for s in steps if s.state == "applying")


def soonest(t: Tier, *, now: float) -> float:
    """Seconds until the first awaited step's deadline (0 if past)."""
    first = min((d for _, d in t.active.values()), default=now)
    return max(0.0, first - now)


@dataclass
class Verdict:
    done: list[Step]  # steps that became done
    failure: str | None  # why the plan stops: "machine NAME: why"
    changed: list[Step]  # steps whose state to write


def look(
    t: Tier,
    *,
    machines: set[str],
    report: Callable[[str], Report],
    names: Names,
    now: float,
    at: datetime,
) -> Verdict:
    """Judge the awaited steps of the machines whose reports changed, then the deadlines. The
    first failure (a failed apply, else the first step past its deadline) stops the tier: the
    other awaited steps fail too, changed but not seen through (the revert covers them)."""
    done: list[Step] = []
    failed: tuple[Step, str] | None = None
    for machine in machines & t.active.keys():
        s = t.active[machine][0]
        verdict = judge(
            report=report(machine), digest=s.after, names=partial(names, s.after, s.after_body),
            crash_loop=t.crash_loop,
        )  # fmt: skip
        if verdict is True:
            done.append(s)
            del t.active[machine]
        elif isinstance(verdict, str):
            failed = (s, verdict)
            break
    if failed is None:
        late = next((s for s, d in t.active.values() if now >= d), None)
        if late is not None:
            failed = (
                late,
                why(machine=late.machine, report=report(late.machine), digest=late.after,
                    names=names(late.after, late.after_body), deadline=t.deadline),
            )  # fmt: skip
    for s in done:
        s.state, s.finished = "done", at
    if failed is None:
        return Verdict(done=done, failure=None, changed=list(done))
    bad, reason = failed
    bad.state, bad.finished, bad.error = "failed", at, reason
    for s, _ in t.active.values():
        if s is not bad:
            s.state, s.finished = "failed", at
            s.error = f"not finished when the plan stopped at machine {bad.machine}"
    changed = [s for s in t.steps if s.state in ("done", "failed")]
    return Verdict(done=done, failure=f"machine {bad.machine}: {reason}", changed=changed)


# --- one tier back -------------------------------------------------------------------------------


def settled(
    waiting: dict[str, Step], *, machines: set[str], report: Callable[[str], Report], names: Names
) -> None:
    """Drop from `waiting` the machines (among those whose reports changed) that settled on
    their old declaration, well or not: a revert notes trouble, it does not fail again."""
    for machine in machines & waiting.keys():
        digest, body = before(waiting[machine])
        verdict = judge(report=report(machine), digest=digest, names=partial(names, digest, body))
        if verdict is not None:
            del waiting[machine]


# --- canaries, soaks and pauses (docs/operations.md, Steering a change) ------------------------


def canaries(size: int, canary: int | str | None) -> int:
    """How many machines of a tier of `size` go first: `canary` machines, or its share of the
    tier rounded up (10% of 3 machines is 1), never more than the tier; 0 without canaries."""
    if canary is None or size == 0:
        return 0
    count, share = gate.canary(canary)
    return min(size, count or math.ceil(size * share / 100))


@dataclass
class Wave:
    """Steps of one tier that go together: its canaries, or the rest (or the whole tier);
    `soaks`: the plan soaks after them."""

    steps: list[Step]
    soaks: bool
    canary: bool = False


def waves(
    steps: list[Step],
    *,
    tier: int,
    settings: PlanSettings,
    drained: Callable[[str], bool] = lambda _: False,
) -> list[Wave]:
    """A tier's steps in the order they go. With canaries, the first of the tier by machine
    name (the same on every holder: a takeover finds the same canaries), then the rest; the
    soak follows the canaries. Without (or when the canaries are the whole tier), one wave
    the soak follows. A machine a plan skips (drained, its step pending or skipped for it)
    is never a canary: the canaries are machines that change, and the soak watches them."""
    mine = sorted((s for s in steps if s.tier == tier), key=lambda s: s.machine)
    going = [s for s in mine if not _passed_by(s, drained=drained)]
    n = canaries(len(going), settings.canary)
    soaks = settings.soak > 0
    if 0 < n < len(going):
        first = going[:n]
        return [
            Wave(first, soaks=soaks, canary=True),
            Wave([s for s in mine if s not in first], soaks=False),
        ]
    return [Wave(mine, soaks=soaks, canary=n > 0)]


def _passed_by(step: Step, *, drained: Callable[[str], bool]) -> bool:
    """A step the plan skips for a drain: skipped already, or pending on a drained machine."""
    if step.state == "skipped":
        return step.error == drain_note(step.machine)
    return step.state == "pending" and drained(step.machine)


SoakStage = Literal["start", "soaking", "passed"]


def soak_stage(*, tier: int, soak_tier: int | None, soak_until: datetime | None) -> SoakStage:
    """Where the plan stands with tier `tier`'s soak, from what the store keeps (the soak in
    progress or last passed: tiers soak in order): not started, in progress, or passed (a
    takeover never soaks a tier twice)."""
    if soak_tier is None or soak_tier < tier:
        return "start"
    if soak_tier == tier and soak_until is not None:
        return "soaking"
    return "passed"


def soaking(wave: Wave) -> list[Step]:
    """The machines a soak watches: the wave's steps done (not those skipped)."""
    return [s for s in wave.steps if s.state == "done"]


def unsoaked(*, report: Report, digest: str, names: Callable[[], frozenset[str]]) -> str | None:
    """Why a machine whose step is done is no longer what it was during its soak; None while
    it is: up, its declaration applied, every process healthy (a start-first trial aside).
    A machine not heard from yet (a new holder's fleet, until the host reports again after
    `held`) is judged once it is: up, it will be; one that stays silent goes down."""
    if not report.up:
        return "went down"
    if report.failed == digest:
        return f"its apply failed: {report.error or 'no reason given'}"
    if report.applied is None or not report.heard:
        return None
    if report.applied != digest:
        return "no longer reports its new declaration applied"
    states = {ps.name: ps for ps in report.processes if not ps.trial}
    for name in sorted(names()):
        ps = states.get(name)
        if ps is None:
            return f"process {name} is not running"
        if not ps.healthy:
            said = cause(ps)
            return f"process {name} is {ps.state}, not healthy" + (f": {said}" if said else "")
    return None


def soak_look(
    steps: list[Step],
    *,
    machines: set[str],
    report: Callable[[str], Report],
    names: Names,
    soak: float,
    left: float,
    at: datetime,
) -> str | None:
    """Judge the soaking machines among `machines`: the first that is no longer healthy fails
    its step (the plan stops there, and the rest of its tier never starts); the plan's
    failure, or None."""
    for s in steps:
        if s.machine not in machines:
            continue
        why = unsoaked(report=report(s.machine), digest=s.after,
                       names=partial(names, s.after, s.after_body))  # fmt: skip
        if why is not None:
            s.state, s.finished = "failed", at
            s.error = f"{why} during the soak ({soak - left:.1f}s of {soak:g}s)"
            return f"machine {s.machine}: {s.error}"
    return None


def pause_due(*, tier: int, settings: PlanSettings, paused_after: int | None) -> bool:
    """The plan pauses itself after `tier` (`pause_after`), once: not again after a resume or
    a takeover (`paused_after`, the last tier it paused after, is kept in the store)."""
    return tier in settings.pause_after and (paused_after is None or paused_after < tier)


def restart_settings(settings: PlanSettings) -> PlanSettings:
    """A restart's plan: the module's `[rollout]`, but a failure only stops it (a restart
    changed no declaration: there is nothing to revert)."""
    return msgspec.structs.replace(settings, auto_revert=False)
