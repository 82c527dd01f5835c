"""The nemesis (issue 29, tests/nemesis/): its checker on hand-made histories (each promise
broken once is found; a clean history passes), its schedule's determinism, and short runs on
the network-namespace cluster with fixed seeds (slow, root only).

bench/nemesis.py is the same run from the command line, longer; docs/performance.md (Faults)
records its results.
"""

import copy
import itertools

import netns
import pytest
from nemesis.checker import DOCUMENTED, EXIT_WITHIN, STATUS_TIMEOUT, check
from nemesis.run import describe, run
from nemesis.schedule import KINDS, schedule


def clean() -> list[dict]:
    """A run where everything held: two holders in turn, a push, an assign and a secret
    acknowledged and in the store, status answered, hosts applying rising epochs."""
    return [
        {"t": 0.0, "type": "note", "what": "seed 0"},
        {"t": 1.0, "type": "op", "phase": "invoke", "id": 1, "op": "status"},
        {"t": 1.2, "type": "op", "phase": "ok", "id": 1, "op": "status", "holder": "ctl-0",
         "epoch": 3},
        {"t": 1.2, "type": "epoch", "source": "status", "holder": "ctl-0", "epoch": 3},
        {"t": 1.5, "type": "epoch", "source": "bus", "holder": "ctl-0", "epoch": 3, "revision": 4},
        {"t": 2.0, "type": "op", "phase": "invoke", "id": 2, "op": "push", "module": "nem"},
        {"t": 2.5, "type": "epoch", "source": "declared", "machine": "node-1", "epoch": 3},
        {"t": 2.7, "type": "epoch", "source": "applied", "machine": "node-1", "epoch": 3,
         "digest": "d1", "ok": True},
        {"t": 3.0, "type": "op", "phase": "ok", "id": 2, "op": "push", "plan": 1,
         "version": "v1", "outcome": "done"},
        {"t": 4.0, "type": "fault", "phase": "start", "id": 3, "kind": "kill", "role": "holder",
         "target": "ctl-0"},
        {"t": 5.0, "type": "op", "phase": "invoke", "id": 4, "op": "status"},
        {"t": 6.5, "type": "op", "phase": "ok", "id": 4, "op": "status", "holder": "ctl-1",
         "epoch": 4},
        {"t": 6.5, "type": "epoch", "source": "status", "holder": "ctl-1", "epoch": 4},
        {"t": 7.0, "type": "epoch", "source": "bus", "holder": "ctl-1", "epoch": 4, "revision": 5},
        {"t": 8.0, "type": "fault", "phase": "end", "id": 3, "kind": "kill", "target": "ctl-0"},
        {"t": 9.0, "type": "op", "phase": "invoke", "id": 5, "op": "assign", "module": "extra",
         "machines": ["node-2"]},
        {"t": 9.5, "type": "epoch", "source": "declared", "machine": "node-1", "epoch": 4},
        {"t": 9.6, "type": "epoch", "source": "applied", "machine": "node-1", "epoch": 4,
         "digest": "d2", "ok": True},
        {"t": 10.0, "type": "op", "phase": "ok", "id": 5, "op": "assign", "plan": 2,
         "outcome": "done"},
        {"t": 11.0, "type": "op", "phase": "invoke", "id": 6, "op": "secret", "name": "tok"},
        {"t": 12.0, "type": "op", "phase": "ok", "id": 6, "op": "secret", "plan": None,
         "version": "2"},
        {"t": 13.0, "type": "op", "phase": "invoke", "id": 7, "op": "push", "module": "nem"},
        {"t": 13.5, "type": "op", "phase": "fail", "id": 7, "op": "push", "error": "no answer"},
        {"t": 20.0, "type": "final",
         "seats": [{"epoch": 3, "holder": "ctl-0"}, {"epoch": 4, "holder": "ctl-1"}],
         "audit": [{"tbl": "seats", "epoch": 3, "seat": 3, "what": None},
                   {"tbl": "plan_steps", "epoch": 3, "seat": 3, "what": "node-1 done"},
                   {"tbl": "seats", "epoch": 4, "seat": 4, "what": None},
                   {"tbl": "plans", "epoch": None, "seat": 4, "what": "done"}],
         "plans": {"1": "done", "2": "done"}, "secrets": {"tok": 2},
         "assignments": [["nem", "node-1"], ["extra", "node-2"]],
         "versions": [["nem", "v1"], ["extra", "x1"]]},
        {"t": 21.0, "type": "exit", "piece": "ctl-0", "seconds": 0.4},
        {"t": 21.0, "type": "exit", "piece": "node-1", "seconds": 1.1},
    ]  # fmt: skip


def line(history: list[dict], **match) -> dict:
    return next(x for x in history if all(x.get(k) == v for k, v in match.items()))


def final(history: list[dict]) -> dict:
    return line(history, type="final")


def kinds(history: list[dict], **kw) -> list[str]:
    return [v.kind for v in check(history, **kw).violations]


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.violations == [], report.violations
    assert report.answered == 2
    assert report.late == 1  # the one across the holder's kill
    assert report.slowest == pytest.approx(1.5)


def test_two_holders_of_one_epoch() -> None:
    h = clean()
    line(h, source="bus", revision=5)["epoch"] = 3  # ctl-1 named on the bus with ctl-0's epoch
    assert "one-holder" in kinds(h)


def test_a_plan_write_under_an_older_epoch() -> None:
    h = clean()
    final(h)["audit"][3] = {"tbl": "plan_steps", "epoch": 3, "seat": 4, "what": "node-2 done"}
    assert kinds(h) == ["one-holder"]


def test_an_epoch_going_back_on_the_bus() -> None:
    h = clean()
    h.insert(14, {"t": 7.5, "type": "epoch", "source": "bus", "holder": "ctl-1", "epoch": 2,
                  "revision": 6})  # fmt: skip
    assert "epochs-rise" in kinds(h)


def test_an_epoch_going_back_in_the_store() -> None:
    h = clean()
    final(h)["seats"].append({"epoch": 4, "holder": "ctl-1"})  # taken twice under 4
    assert "epochs-rise" in kinds(h)


def test_a_host_reporting_an_older_epoch_after_a_newer() -> None:
    h = clean()
    h.insert(19, {"t": 9.8, "type": "epoch", "source": "applied", "machine": "node-1",
                  "epoch": 3, "digest": "d1", "ok": False})  # fmt: skip
    assert kinds(h) == ["epochs-rise"]  # a failed apply: no declaration applied


def test_a_host_refusing_an_older_epoch_by_its_fence_keeps_the_promise() -> None:
    h = clean()
    h.insert(19, {"t": 9.8, "type": "epoch", "source": "applied", "machine": "node-1",
                  "epoch": 3, "digest": "d1", "ok": False, "step": "fence"})  # fmt: skip
    assert kinds(h) == []  # it names the stale epoch it refused, not one it took


def test_a_machine_applying_an_older_declaration_after_a_newer() -> None:
    h = clean()
    h.insert(19, {"t": 9.8, "type": "epoch", "source": "applied", "machine": "node-1",
                  "epoch": 3, "digest": "d1", "ok": True})  # fmt: skip
    assert sorted(kinds(h)) == ["epochs-rise", "stale-apply"]


@pytest.mark.parametrize("lose", ["push", "assign", "secret", "plan"])
def test_an_acknowledged_change_missing_at_the_end(lose: str) -> None:
    h = clean()
    f = final(h)
    if lose == "push":
        f["versions"].remove(["nem", "v1"])
    elif lose == "assign":
        f["assignments"].remove(["extra", "node-2"])
    elif lose == "secret":
        f["secrets"]["tok"] = 1
    else:
        del f["plans"]["2"]
    assert kinds(h) == ["lost-write"]


def test_a_plan_not_final_at_the_end() -> None:
    h = clean()
    final(h)["plans"]["2"] = "rolling"
    assert kinds(h) == ["plan-not-final"]


def test_a_status_unanswered_outside_documented_faults() -> None:
    h = clean()
    line(h, id=4, phase="ok").update(phase="fail", t=10.0, error="no controller answered")
    report = check(h)
    assert [v.kind for v in report.violations] == ["status"]
    assert report.unanswered == {"kill/holder": 1}
    # The lead may count a fault as under repair: then it is counted apart.
    repaired = check(h, under_repair=["kill/holder"])
    assert repaired.violations == [] and repaired.under_repair == {"kill/holder": 1}


def test_a_status_lost_during_a_planned_handover_says_so() -> None:
    h = clean()
    line(h, id=4, phase="ok").update(phase="fail", t=10.0)
    h.insert(10, {"t": 4.5, "type": "op", "phase": "invoke", "id": 9, "op": "handover"})
    h.insert(12, {"t": 5.5, "type": "op", "phase": "ok", "id": 9, "op": "handover"})
    assert check(h).unanswered == {"handover (planned), kill/holder": 1}


def test_a_status_answered_too_late() -> None:
    h = clean()
    line(h, id=4, phase="ok")["t"] = 5.0 + STATUS_TIMEOUT + 1
    assert kinds(h) == ["status"]


@pytest.mark.parametrize("kind", sorted(DOCUMENTED))
def test_a_status_unanswered_during_a_documented_fault_is_counted_apart(kind: str) -> None:
    h = clean()
    line(h, type="fault", phase="start")["kind"] = kind
    line(h, type="fault", phase="end")["kind"] = kind
    line(h, id=4, phase="ok").update(phase="fail", t=10.0)
    report = check(h)
    assert report.violations == []
    assert report.excused == {f"{kind}/holder": 1}


def test_a_piece_slow_to_stop() -> None:
    h = clean()
    h.append({"t": 22.0, "type": "exit", "piece": "node-2", "seconds": EXIT_WITHIN + 1})
    h.append({"t": 22.0, "type": "exit", "piece": "n1", "seconds": None})
    assert kinds(h) == ["exit", "exit"]


def test_a_command_the_harness_had_to_kill() -> None:
    h = clean()
    line(h, id=7, phase="fail").update(phase="timeout", error="ran 180.0s")
    assert kinds(h) == ["hung"]


def test_no_final_state_is_a_violation() -> None:
    h = [x for x in clean() if x["type"] != "final"]
    assert "lost-write" in kinds(h)


def test_the_checker_does_not_change_the_history() -> None:
    h = clean()
    before = copy.deepcopy(h)
    check(h)
    assert h == before


def test_a_seed_gives_one_schedule_and_every_kind_comes_first() -> None:
    one, again, other = schedule(7, 300), schedule(7, 300), schedule(8, 300)
    assert one == again and one != other
    assert {f.kind for f in one[: len(KINDS)]} == set(KINDS)
    assert all(b.at >= a.at + a.lasts for a, b in itertools.pairwise(one))


# --- runs on the cluster (root, network namespaces) ---------------------------------------------

SEEDS = [3, 14]  # between them: kill, pause-free holder faults, a failover, both NATS kinds
MINUTES = 0.75  # with the set-up and the end, about a minute each: two minutes in all


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_seeded_fault_schedule_keeps_every_promise(seed: int, tmp_path) -> None:
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    outcome = await run(seed, MINUTES, tmp_path / "run", say=print)
    text = "\n".join(describe(outcome))
    print(text)
    assert outcome.report.ok, text
