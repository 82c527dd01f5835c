"""The planner's rules without a mesh (services/controller/plans/rollout.py): batching, skipping
down machines, deadlines, judging reports, stopping at a failure and reverting, with time as plain
numbers. The same rules run under whole meshes in test_plans.py and test_faults.py."""

from datetime import UTC, datetime

import msgspec
import pytest

from mesh.model import PlanSettings, ProcessState, StepState
from mesh.modules.compose import encode, merge
from mesh.store.plans import Step
from services.controller.plans import rollout
from services.controller.plans.rollout import Report

AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
HELLO = frozenset({"hello"})


def names(digest: str, body: bytes) -> frozenset[str]:
    del body  # every declaration in these tests runs hello
    return HELLO


def step(
    machine: str, *, tier: int = 0, state: StepState = "pending", before: str | None = "old"
) -> Step:
    return Step(
        machine=machine, tier=tier, state=state, after=f"new-{machine}", after_body=b"{}",
        before=before, before_body=b"{}",
    )  # fmt: skip


def healthy(digest: str, *, up: bool = True) -> Report:
    return Report(up=up, applied=digest, processes=[ProcessState("hello", "running", True, 1)])


def sent(steps: list[Step], *, settings: PlanSettings, now: float, down: set[str] = frozenset()):
    """Start a tier the way the planner does: send the first batch and await it."""
    t = rollout.rolling(steps, tier=steps[0].tier, settings=settings)
    assert t is not None
    batch = rollout.next_batch(t)
    for s in batch:
        rollout.send(s, up=s.machine not in down, skip_down=settings.skip_down, at=AT)
    rollout.await_(t, batch, now=now)
    return t, batch


def test_max_parallel_sends_batches_and_refills_as_steps_finish() -> None:
    steps = [step(f"node-{i}") for i in range(5)]
    t, batch = sent(steps, settings=PlanSettings(max_parallel=2), now=0.0)
    assert [s.machine for s in batch] == ["node-0", "node-1"]
    assert rollout.next_batch(t) == []  # no room until one finishes
    reports = {"node-0": healthy("new-node-0")}
    v = rollout.look(
        t, machines={"node-0"}, report=lambda m: reports.get(m, Report()), names=names,
        now=1.0, at=AT,
    )  # fmt: skip
    assert v.failure is None and [s.machine for s in v.done] == ["node-0"]
    assert steps[0].state == "done" and [s.machine for s in v.changed] == ["node-0"]
    assert [s.machine for s in rollout.next_batch(t)] == ["node-2"]  # one freed place
    assert not t.finished


def test_max_parallel_zero_sends_the_whole_tier() -> None:
    steps = [step(f"node-{i}") for i in range(4)]
    _, batch = sent(steps, settings=PlanSettings(max_parallel=0), now=0.0)
    assert len(batch) == 4


def test_skip_down_skips_a_down_machine_and_does_not_wait_for_it() -> None:
    steps = [step("node-1"), step("node-2")]
    t, _ = sent(steps, settings=PlanSettings(skip_down=True), now=0.0, down={"node-2"})
    assert steps[1].state == "skipped" and steps[1].published
    assert steps[1].error == (
        "machine node-2 is down: skipped; it gets this declaration when it comes back"
    )
    assert set(t.active) == {"node-1"}


def test_without_skip_down_a_down_machine_fails_at_its_deadline() -> None:
    steps = [step("node-2")]
    t, _ = sent(steps, settings=PlanSettings(deadline=60), now=0.0, down={"node-2"})
    assert steps[0].state == "applying"
    v = rollout.look(t, machines=set(), report=lambda m: Report(up=False), names=names,
                     now=60.0, at=AT)  # fmt: skip
    assert v.failure == "machine node-2: machine node-2 is down"


def test_the_deadline_expires_exactly_at_its_boundary() -> None:
    steps = [step("node-1")]
    t, _ = sent(steps, settings=PlanSettings(deadline=60), now=100.0)
    running = Report(applied="new-node-1", processes=[ProcessState("hello", "running", False, 7)])
    v = rollout.look(t, machines=set(), report=lambda m: running, names=names, now=159.999, at=AT)
    assert v.failure is None and steps[0].state == "applying"
    assert rollout.soonest(t, now=159.5) == pytest.approx(0.5)
    v = rollout.look(t, machines=set(), report=lambda m: running, names=names, now=160.0, at=AT)
    assert v.failure == "machine node-1: process hello is running, not healthy, after 60s"
    assert steps[0].state == "failed" and steps[0].finished == AT


def test_a_trial_process_health_does_not_count() -> None:
    trial = Report(
        applied="old",
        processes=[
            ProcessState("hello", "running", True, 1),  # the old version, serving
            ProcessState("hello", "running", True, 2, trial=True),
        ],
    )
    assert rollout.judge(report=trial, digest="new", names=lambda: HELLO) is None
    # Applied, but the only healthy entry is a trial: not done.
    only_trial = Report(
        applied="new",
        processes=[
            ProcessState("hello", "starting", False, 1),
            ProcessState("hello", "running", True, 2, trial=True),
        ],
    )
    assert rollout.judge(report=only_trial, digest="new", names=lambda: HELLO) is None
    waiting = Report(applied="old", processes=[ProcessState("hello", "starting", False, 2, True)])
    why = rollout.why(machine="n", report=waiting, digest="new", names=HELLO, deadline=60)
    assert why == "process hello (new version) is starting, not healthy, after 60s"


def test_a_report_for_an_old_digest_does_not_count() -> None:
    old_ok = healthy("old")
    assert rollout.judge(report=old_ok, digest="new", names=lambda: HELLO) is None
    old_failed = Report(applied="older", failed="old", error="files: disk full")
    assert rollout.judge(report=old_failed, digest="new", names=lambda: HELLO) is None
    failed = Report(applied="old", failed="new", error="prepare: exit 3")
    assert rollout.judge(report=failed, digest="new", names=lambda: HELLO) == "prepare: exit 3"
    assert rollout.judge(report=healthy("new"), digest="new", names=lambda: HELLO) is True


def test_a_crash_loop_fails_a_step_at_once_with_its_cause() -> None:
    """A process its host restarted `crash_loop` times in a row fails the step as soon as that
    is heard, saying how it last exited; below that, or once it ran steadily, the step waits."""

    def judged(in_a_row: int, *, healthy: bool = False) -> bool | str | None:
        ps = ProcessState("hello", "restarting", healthy, None, reason="exited with code 3",
                          restarts=in_a_row, in_a_row=in_a_row)  # fmt: skip
        report = Report(applied="d", processes=[ps])
        return rollout.judge(report=report, digest="d", names=lambda: HELLO, crash_loop=3)

    assert judged(2) is None
    assert judged(3) == (
        "process hello is in a crash loop: exited with code 3; restarted 3 time(s) in a row"
    )
    assert judged(3, healthy=True) is True  # healthy as it was heard: not a loop now
    # without a crash_loop (a revert settling), nothing fails for it
    loop = Report(applied="d", processes=[ProcessState("hello", "restarting", False, None,
                                                       in_a_row=9)])  # fmt: skip
    assert rollout.judge(report=loop, digest="d", names=lambda: HELLO) is None


def test_a_step_past_its_deadline_names_what_the_host_said() -> None:
    def why(ps: ProcessState) -> str:
        report = Report(applied="d", processes=[ps])
        return rollout.why(machine="node-2", report=report, digest="d", names=HELLO, deadline=60)

    sick = ProcessState("hello", "running", False, 7, check="HTTP status 503", restarts=1)
    assert why(sick) == (
        "process hello is running, not healthy, after 60s: its check said: HTTP status 503; "
        "restarted 1 time(s)"
    )
    trial = ProcessState("hello", "running", False, 8, trial=True, check="connection refused")
    assert rollout.why(machine="node-2", report=Report(applied="old", processes=[trial]),
                       digest="d", names=HELLO, deadline=60) == (
        "process hello (new version) is running, not healthy, after 60s: its check said: "
        "connection refused"
    )  # fmt: skip
    killed = ProcessState("hello", "restarting", False, None, reason="memory limit 64M reached",
                          restarts=2, in_a_row=2)  # fmt: skip
    assert why(killed) == (
        "process hello is restarting, not healthy, after 60s: memory limit 64M reached; "
        "restarted 2 time(s) in a row"
    )


def test_reasons_a_step_ran_out_of_time() -> None:
    def why(report: Report) -> str:
        return rollout.why(machine="node-2", report=report, digest="d", names=HELLO, deadline=60)

    assert why(Report(up=False)) == "machine node-2 is down"
    assert why(Report(applied="old")) == "did not apply its new declaration within 60s"
    assert why(Report(applied="d")) == "process hello is not running after 60s"
    backoff = Report(applied="d", processes=[ProcessState("hello", "restarting", False, None)])
    assert why(backoff) == "process hello is restarting, not healthy, after 60s"
    assert why(healthy("d")) == "not healthy after 60s"
    # a tool server (named `hello` here) says why it is not ready
    broken = ProcessState("hello", "backoff", False, 42, tool=True, error="does not speak MCP: x")
    assert why(Report(applied="d", processes=[broken])) == (
        "tool server hello is backoff, not ready, after 60s: does not speak MCP: x"
    )


def test_a_failure_fails_the_tier_s_other_awaited_steps() -> None:
    steps = [step("node-1"), step("node-2"), step("node-3")]
    t, _ = sent(steps, settings=PlanSettings(), now=0.0)
    reports = {
        "node-1": healthy("new-node-1"),
        "node-2": Report(failed="new-node-2", error="accounts: getent exit 1"),
    }

    def look(machines: set[str]) -> rollout.Verdict:
        return rollout.look(t, machines=machines, report=lambda m: reports.get(m, Report()),
                            names=names, now=1.0, at=AT)  # fmt: skip

    assert look({"node-1"}).failure is None  # done before node-2's failure is heard
    v = look({"node-2"})
    assert v.failure == "machine node-2: accounts: getent exit 1"
    assert [(s.machine, s.state) for s in steps] == [
        ("node-1", "done"), ("node-2", "failed"), ("node-3", "failed"),
    ]  # fmt: skip
    assert steps[2].error == "not finished when the plan stopped at machine node-2"
    assert {s.machine for s in v.changed} == {"node-1", "node-2", "node-3"}


def test_a_failure_in_tier_0_leaves_tiers_1_and_2_untouched_and_reverts_only_tier_0() -> None:
    steps = [step("node-0", tier=0), step("node-1", tier=1), step("node-2", tier=2)]
    assert rollout.tiers(steps) == [0, 1, 2]
    t, _ = sent(steps, settings=PlanSettings(deadline=5), now=0.0)
    assert list(t.active) == ["node-0"]  # only tier 0's step was sent
    v = rollout.look(t, machines=set(), report=lambda m: Report(), names=names, now=5.0, at=AT)
    assert v.failure == "machine node-0: did not apply its new declaration within 5s"
    for s in steps[1:]:
        assert (s.state, s.published, s.started) == ("pending", False, None)
    assert rollout.recorded_failure(steps) == v.failure  # a new holder does not roll on
    order = [(tier, rollout.to_revert(steps, tier=tier)) for tier in rollout.revert_order(steps)]
    assert [(tier, [s.machine for s in mine]) for tier, mine in order] == [
        (2, []), (1, []), (0, ["node-0"]),
    ]  # fmt: skip


def test_revert_goes_tier_by_tier_in_reverse_and_notes_who_did_not_settle() -> None:
    steps = [step(f"node-{t}", tier=t, state="done") for t in (0, 1, 2)]
    for s in steps:
        s.published = True
    steps[2].state = "failed"
    assert rollout.revert_order(steps) == [2, 1, 0]
    waiting = {s.machine: s for s in steps}
    reports = {"node-0": healthy("old"), "node-2": Report(applied="old")}  # node-2 not healthy
    rollout.settled(waiting, machines={"node-0", "node-2"}, report=lambda m: reports[m],
                    names=names)  # fmt: skip
    assert set(waiting) == {"node-1", "node-2"}
    rollout.reverted(steps, unsettled={"node-1": "machine node-1 is down"})
    assert [(s.state, s.reverted) for s in steps] == [
        ("reverted", True), ("reverted", True), ("failed", True),
    ]  # fmt: skip
    assert steps[1].error == "revert: machine node-1 is down"
    assert rollout.to_revert(steps, tier=0) == []  # reverted once only


def test_a_revert_of_a_machine_that_had_nothing_gives_it_an_empty_declaration() -> None:
    s = step("node-1", before=None)
    s.before_body = None
    body, digest = encode(merge("node-1", []))
    assert rollout.before(s) == (digest, body)
    assert rollout.before(step("node-2")) == ("old", b"{}")


def test_a_continued_plan_sends_its_applying_steps_again_before_new_ones() -> None:
    steps = [step("node-1", state="applying"), step("node-2"), step("node-3", state="done")]
    t = rollout.rolling(steps, tier=0, settings=PlanSettings(max_parallel=1))
    assert t is not None
    assert [s.machine for s in rollout.resumed(t)] == ["node-1"]
    rollout.send(steps[0], up=True, skip_down=False, at=AT)
    assert steps[0].started is None  # sent again as it was
    rollout.await_(t, rollout.resumed(t), now=0.0)
    assert rollout.next_batch(t) == []  # node-1 takes the one place
    assert rollout.rolling([step("n", state="done")], tier=0, settings=PlanSettings()) is None


def test_prepare_skips_machines_with_nothing_to_change_and_takes_their_tier_now() -> None:
    steps = [step("node-1"), step("node-2")]
    rollout.prepare(
        steps,
        composed={"node-1": ("a", b"A"), "node-2": ("b", b"B")},
        stored={"node-1": ("a", b"A", 1)},
        tier_of={"node-1": 1, "node-2": 2},
        at=AT,
    )
    assert (steps[0].state, steps[0].tier, steps[0].error) == (
        "skipped", 1, "no change by the time the plan started",
    )  # fmt: skip
    assert (steps[1].state, steps[1].tier, steps[1].before, steps[1].after) == (
        "pending", 2, None, "b",
    )  # fmt: skip


def test_each_tier_is_told_as_plan_shows_it() -> None:
    """The progress the holder tells counts the tiers as `plan` does from the store: done and
    skipped steps are done; a failed step fails its tier, a reverted one reverts it."""
    steps = [
        step("a", tier=0, state="done"), step("b", tier=0, state="skipped"),
        step("c", tier=1, state="done"), step("d", tier=1, state="applying"),
        step("e", tier=2), step("f", tier=3, state="failed"), step("g", tier=4, state="done"),
    ]  # fmt: skip
    steps[-1].reverted = True
    shown = [rollout.tier_shown(t) for t in rollout.tier_counts(steps)]
    assert [(t.tier, t.state, t.done, t.total) for t in shown] == [
        (0, "done", 2, 2), (1, "rolling", 1, 2), (2, "pending", 0, 1), (3, "failed", 0, 1),
        (4, "reverted", 1, 1),
    ]  # fmt: skip


def test_a_trial_report_keeps_its_wire_shape() -> None:
    # Only a trial says so: every other report's JSON is as before the field existed.
    plain = msgspec.json.encode(ProcessState("hello", "running", True, 1))
    assert plain == b'{"name":"hello","state":"running","healthy":true,"pid":1}'
    trial = msgspec.json.encode(ProcessState("hello", "running", True, 1, trial=True))
    assert msgspec.json.decode(trial, type=ProcessState).trial


# --- canaries, soaks and pauses (docs/operations.md, Steering a change) ------------------------


def test_canaries_are_a_count_or_a_share_of_each_tier_rounded_up() -> None:
    assert rollout.canaries(10, None) == 0
    assert rollout.canaries(10, 1) == 1
    assert rollout.canaries(3, 5) == 3  # never more than the tier
    assert rollout.canaries(3, "10%") == 1  # 0.3 of a machine is one machine
    assert rollout.canaries(10, "25%") == 3
    assert rollout.canaries(10, "100%") == 10
    assert rollout.canaries(0, 2) == 0


def test_canaries_go_first_by_name_and_the_soak_follows_them() -> None:
    steps = [step(name, tier=2) for name in ("node-9", "node-3", "node-5")] + [step("n", tier=1)]
    waves = rollout.waves(steps, tier=2, settings=PlanSettings(canary=1, soak=30))
    assert [([s.machine for s in w.steps], w.soaks, w.canary) for w in waves] == [
        (["node-3"], True, True), (["node-5", "node-9"], False, False),
    ]  # fmt: skip
    # A takeover finds the same canaries, whatever the steps' order.
    again = rollout.waves(list(reversed(steps)), tier=2, settings=PlanSettings(canary=1, soak=30))
    assert [s.machine for s in again[0].steps] == ["node-3"]


def test_without_canaries_or_with_a_tier_of_canaries_the_whole_tier_soaks() -> None:
    steps = [step("a", tier=0), step("b", tier=0)]
    for settings in (PlanSettings(soak=10), PlanSettings(canary="100%", soak=10)):
        [wave] = rollout.waves(steps, tier=0, settings=settings)
        assert [s.machine for s in wave.steps] == ["a", "b"] and wave.soaks
    [plain] = rollout.waves(steps, tier=0, settings=PlanSettings())
    assert not plain.soaks and not plain.canary
    # Canaries without a soak: they go first, the rest once they are done; nobody waits.
    first, rest = rollout.waves(steps, tier=0, settings=PlanSettings(canary=1))
    assert first.canary and not first.soaks and not rest.soaks


def test_a_soak_is_started_once_goes_on_after_a_takeover_and_is_never_repeated() -> None:
    until = datetime(2026, 11, 30, 12, 5, tzinfo=UTC)
    assert rollout.soak_stage(tier=0, soak_tier=None, soak_until=None) == "start"
    assert rollout.soak_stage(tier=2, soak_tier=1, soak_until=None) == "start"
    assert rollout.soak_stage(tier=1, soak_tier=1, soak_until=until) == "soaking"
    assert rollout.soak_stage(tier=1, soak_tier=1, soak_until=None) == "passed"
    assert rollout.soak_stage(tier=0, soak_tier=1, soak_until=until) == "passed"


def test_only_machines_done_soak_and_one_no_longer_healthy_stops_the_plan() -> None:
    steps = [step("c1", state="done"), step("c2", state="skipped"), step("c3", state="done")]
    watched = rollout.soaking(rollout.Wave(steps, soaks=True))
    assert [s.machine for s in watched] == ["c1", "c3"]
    reports = {"c1": healthy("new-c1"), "c3": healthy("new-c3")}

    def look(machines: set[str], *, left: float) -> str | None:
        return rollout.soak_look(watched, machines=machines, report=lambda m: reports[m],
                                 names=names, soak=30, left=left, at=AT)  # fmt: skip

    assert look({"c1", "c3"}, left=20) is None
    reports["c3"] = Report(applied="new-c3", processes=[
        ProcessState("hello", "running", False, 7, error="exec check: exit 1"),
    ])  # fmt: skip
    assert look({"c1"}, left=10) is None  # judged when its report changes
    failure = look({"c3"}, left=10)
    assert failure == (
        "machine c3: process hello is running, not healthy: exec check: exit 1 "
        "during the soak (20.0s of 30s)"
    )
    assert (steps[2].state, steps[2].finished) == ("failed", AT)
    assert steps[0].state == "done"  # the others stay as they were: the revert takes them
    assert rollout.recorded_failure(steps) == failure  # a new holder never rolls on past it


def test_why_a_machine_no_longer_holds_during_its_soak() -> None:
    def why(report: Report) -> str | None:
        return rollout.unsoaked(report=report, digest="d", names=lambda: HELLO)

    assert why(healthy("d")) is None
    assert why(healthy("d", up=False)) == "went down"
    # Not heard from since a takeover, or only its registration (no processes yet): not
    # judged until it reports.
    assert why(Report()) is None
    assert why(Report(applied="d", heard=False)) is None
    assert why(Report(applied="old", failed="d", error="x", heard=False)) == "its apply failed: x"
    assert why(Report(up=False)) == "went down"
    assert why(Report(applied="old", failed="d", error="prepare: exit 3")) == (
        "its apply failed: prepare: exit 3"
    )
    assert why(healthy("other")) == "no longer reports its new declaration applied"
    assert why(Report(applied="d")) == "process hello is not running"
    trial = ProcessState("hello", "running", True, 2, trial=True)
    assert why(Report(applied="d", processes=[trial])) == "process hello is not running"


def test_the_plan_pauses_itself_after_its_tiers_once_each() -> None:
    settings = PlanSettings(pause_after=[0, 2])
    assert rollout.pause_due(tier=0, settings=settings, paused_after=None)
    assert not rollout.pause_due(tier=1, settings=settings, paused_after=0)
    # resumed, or taken over: not again
    assert not rollout.pause_due(tier=0, settings=settings, paused_after=0)
    assert rollout.pause_due(tier=2, settings=settings, paused_after=0)
    assert not rollout.pause_due(tier=2, settings=settings, paused_after=2)
    assert not rollout.pause_due(tier=0, settings=PlanSettings(), paused_after=None)


def test_a_soaking_tier_is_shown_soaking_unless_it_failed() -> None:
    steps = [step("a", state="done"), step("b")]
    [counted] = rollout.tier_counts(steps)
    assert rollout.tier_shown(counted, soaking=True).state == "soaking"
    assert rollout.tier_shown(counted).state == "rolling"
    steps[0].state = "failed"
    [counted] = rollout.tier_counts(steps)
    assert rollout.tier_shown(counted, soaking=True).state == "failed"


# --- drained machines (`mesh drain`) ---------------------------------------------------------


def test_a_drained_machine_s_step_is_skipped_unsent_when_it_would_start() -> None:
    pending, in_flight, free = step("node-1"), step("node-2", state="applying"), step("node-3")
    assert rollout.skip_drained(pending, drained=True, at=AT) is True
    assert (pending.state, pending.published, pending.started, pending.finished) == (
        "skipped", False, None, AT,
    )  # fmt: skip
    assert pending.error is not None and "machine node-1 is drained" in pending.error
    assert "mesh undrain node-1" in pending.error
    # A step already in flight (resumed by a new holder) goes on; one not drained starts.
    assert rollout.skip_drained(in_flight, drained=True, at=AT) is False
    assert in_flight.state == "applying"
    assert rollout.skip_drained(free, drained=False, at=AT) is False and free.state == "pending"


def test_a_revert_keeps_machines_drained_since_they_changed_noting_it_once() -> None:
    changed = [step("node-1", state="done"), step("node-2", state="failed")]
    for s in changed:
        s.published = True
    changed[1].error = "process hello is starting, not healthy, after 60s"
    drained = {"node-2"}.__contains__
    for _ in range(2):  # a new holder reverting again notes nothing twice
        kept = rollout.kept_by_drain(changed, drained=drained)
        assert [s.machine for s in kept] == ["node-2"]
    assert changed[1].error == (
        "process hello is starting, not healthy, after 60s; machine node-2 is drained: not "
        "reverted; it keeps this declaration"
    )
    assert changed[0].error is None and not any(s.reverted for s in changed)


def test_a_drained_machine_is_never_a_canary() -> None:
    """The canaries are machines that change: a drained one (its step pending, or already
    skipped for the drain, as a takeover finds it) goes with the rest, where it is skipped."""
    steps = [step(name, tier=2) for name in ("node-1", "node-3", "node-5")]
    settings = PlanSettings(canary=1, soak=30)
    drained = {"node-1"}.__contains__
    waves = rollout.waves(steps, tier=2, settings=settings, drained=drained)
    assert [([s.machine for s in w.steps], w.canary) for w in waves] == [
        (["node-3"], True), (["node-1", "node-5"], False),
    ]  # fmt: skip
    rollout.skip_drained(steps[0], drained=True, at=AT)
    again = rollout.waves(steps, tier=2, settings=settings)  # undrained since: skipped stays
    assert [s.machine for s in again[0].steps] == ["node-3"]
    # A share counts the machines that change; with one left, the whole tier soaks after it.
    assert [len(w.steps) for w in rollout.waves(steps[:2], tier=2, settings=settings)] == [2]
