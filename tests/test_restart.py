"""`mesh restart MODULE [MACHINE...]` end to end (issue 43): a plan that changes no declaration
and restarts the module's processes tier by tier through its health gates; a failed health
check stops it, and the machines of later tiers keep their processes; it can be held, and
rejected or cancelled like any plan.

Real controller, hosts, NATS and PostgreSQL, the command line as a user runs it. A module's
health is a marker file in its host's root (module_folders.gated_module): the test breaks a
machine's check by writing it, never by sleeping.
"""

import json
from pathlib import Path

import pytest
from helpers import assert_tier_order, js, ok, ok_json, one_line_error
from module_folders import gated_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODES = ("node-1", "node-2", "node-3")


@pytest.fixture
async def gated(start_fleet, cli, tmp_path: Path) -> Path:
    """node-1..3 in tiers 0, 1, 2, each running module `gated`, healthy unless marker `broken`
    is in its host's root. The hosts' roots."""
    await start_fleet(hosts=3)
    folder = gated_module(tmp_path / "gated", mode="fails-if", marker="broken", deadline="10s",
                          check_timeout="10s")  # fmt: skip
    pushed = ok_json(cli("push", str(folder), "--wait", "--json"))
    assert pushed["outcome"]["state"] == "done", pushed
    return tmp_path / "hosts"


def _pids(cli) -> dict[str, int | None]:
    nodes = ok_json(cli("nodes", "--json"))["nodes"]
    return {
        n["name"]: next((p["pid"] for p in n["processes"] if p["name"] == "gated"), None)
        for n in nodes
    }


async def _declared(nc) -> dict[str, str]:
    kv = await js(nc).key_value("mesh-declarations")
    return {m: json.loads((await kv.get(m)).value)["digest"] for m in NODES}


async def test_a_restart_restarts_every_process_tier_by_tier_and_changes_no_declaration(
    gated, cli, nc
) -> None:
    before, declared = _pids(cli), await _declared(nc)
    assert all(before.values()), before
    restarted = ok_json(cli("restart", "gated", "--wait", "--json"))
    plan = restarted["outcome"]
    assert (plan["state"], plan["trigger"], plan["subject"]) == ("done", "restart", "gated")
    assert [s["machine"] for s in plan["steps"]] == list(NODES)
    assert all(s["state"] == "done" for s in plan["steps"]), plan["steps"]
    assert_tier_order(plan)
    after = _pids(cli)
    assert all(after[m] not in (None, before[m]) for m in NODES), (before, after)
    assert await _declared(nc) == declared  # no declaration changed

    # One machine by name: only its process restarts.
    ok(cli("restart", "gated", "node-2", "--wait"))
    again = _pids(cli)
    assert again["node-2"] != after["node-2"]
    assert (again["node-1"], again["node-3"]) == (after["node-1"], after["node-3"])
    line = one_line_error(cli("restart", "gated", "node-4"))
    assert "node-4 does not run module gated" in line, line
    line = one_line_error(cli("restart", "nothing-here"))
    assert "module nothing-here has not been pushed" in line, line


async def test_a_failed_health_check_stops_a_restart(gated, cli) -> None:
    before = _pids(cli)
    (gated / "node-2" / "broken").write_text("")  # node-2's check fails from now on
    done = cli("restart", "gated", "--wait", "--json")
    assert done.returncode == 1, done.stderr
    plan = json.loads(done.stdout)["outcome"]
    assert plan["state"] == "failed", plan  # nothing to revert: it stops
    assert "node-2" in plan["failure"] and "not healthy" in plan["failure"], plan["failure"]
    steps = {s["machine"]: s["state"] for s in plan["steps"]}
    assert steps == {"node-1": "done", "node-2": "failed", "node-3": "pending"}, steps
    after = _pids(cli)
    assert after["node-1"] != before["node-1"]  # tier 0 restarted
    assert after["node-3"] == before["node-3"]  # tier 2 never reached


async def test_a_held_restart_waits_and_a_rejected_one_restarts_nothing(gated, cli) -> None:
    before = _pids(cli)
    held = ok_json(cli("restart", "gated", "--hold", "--json"))
    assert held["state"] == "held" and held["plan"] is not None, held
    assert "restart" in held["message"], held["message"]
    shown = ok_json(cli("plan", str(held["plan"]), "--json"))
    assert (shown["state"], shown["trigger"]) == ("held", "restart"), shown
    assert shown["digest"].startswith("sha256:")
    said = ok(cli("plan", "reject", str(held["plan"]), "--reason", "not today"))
    assert "rejected" in said and "no machine changed" in " ".join(said.split()), said
    assert _pids(cli) == before
    cancelled = ok_json(cli("restart", "gated", "node-3", "--hold", "--json"))
    ok(cli("plan", "cancel", str(cancelled["plan"])))
    assert ok_json(cli("plan", str(cancelled["plan"]), "--json"))["state"] == "cancelled"
    assert _pids(cli) == before
