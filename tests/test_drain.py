"""Draining a machine out of every plan (docs/operations.md, Steering a change): it keeps its
processes (the same pids) through a plan that skips it, naming the drain; `mesh nodes` shows it
drained and wanting what the catalog composes for it; undrained, a plan of its own brings it up
to date. A drain holds across a takeover, counts from the moment a step would start (a machine
drained while its plan rolls is skipped from then on), and keeps the machine out of a revert too.

Real controllers, hosts, NATS and PostgreSQL, the command line as a user runs it; which version
a machine runs is read from its process's own environment (module_folders.versioned_module).
"""

import json
import os
import signal

from helpers import (
    ask,
    await_until,
    held_status,
    js,
    node_named,
    ok,
    ok_json,
    one_line_error,
    running,
)
from module_folders import versioned_module


async def processes(nc) -> dict[str, tuple[int, str | None]]:
    """machine -> (pid, version) of its healthy `versioned` process."""
    return await running(nc, "versioned", "MODULE_VERSION")


async def settled(nc, expected: dict[str, str]) -> dict[str, tuple[int, str | None]]:
    """Once every machine named runs the version given, the processes."""

    async def there():
        found = await processes(nc)
        return found if {m: v for m, (_, v) in found.items()} == expected else None

    return await await_until(there, within=30, what=f"versions {expected}")


def steps_of(plan: dict) -> dict[str, dict]:
    return {s["machine"]: s for s in plan["steps"]}


async def test_a_drained_machine_keeps_its_processes_through_a_plan_until_undrained(
    start_fleet, nc, cli, tmp_path
) -> None:
    await start_fleet(hosts=3)
    ok(cli("push", str(versioned_module(tmp_path / "v1", version="v1")), "--wait"))
    before = await settled(nc, {"node-1": "v1", "node-2": "v1", "node-3": "v1"})

    said = ok_json(cli("drain", "node-2", "--json"))
    assert [said[k] for k in ("machine", "drained", "was", "plan")] == ["node-2", True, False, None]
    assert "every plan skips it" in ok(cli("drain", "node-2"))  # again: it already is
    line = one_line_error(cli("drain", "node-9"))
    assert line == "mesh: error: drain: machine node-9 is not registered"
    assert (await node_named(nc, "node-2"))["drained"] is True
    told: list[dict] = []  # what the console hears: the step skipped changes what node-2 wants

    async def heard(msg) -> None:
        told.append(json.loads(msg.data))

    sub = await nc.subscribe("mesh.machine.node-2", cb=heard)
    await nc.flush()  # subscribed at the server before the push (cli blocks this loop)

    pushed = ok_json(cli("push", str(versioned_module(tmp_path / "v2", version="v2")), "--wait",
                         "--json"))  # fmt: skip
    plan = pushed["outcome"]
    assert plan["state"] == "done"
    steps = steps_of(plan)
    assert steps["node-2"]["state"] == "skipped" and steps["node-2"]["started"] is None
    assert "machine node-2 is drained" in steps["node-2"]["error"]
    assert steps["node-1"]["state"] == steps["node-3"]["state"] == "done"

    async def told_yet() -> list[dict]:
        return told

    await await_until(told_yet, within=10, what="node-2's skip told on mesh.machine.node-2")
    assert told == [{"machine": "node-2", "drained": True}]
    await sub.unsubscribe()
    during = await settled(nc, {"node-1": "v2", "node-2": "v1", "node-3": "v2"})
    assert during["node-2"] == before["node-2"]  # the same process: same pid, still v1
    node = await node_named(nc, "node-2")
    assert node["drained"] is True
    assert node["digest_wanted"] == steps["node-2"]["after"] != node["digest_applied"]
    assert node["digest_applied"] == steps["node-2"]["before"]
    kv = await js(nc).key_value("mesh-declarations")
    published = ok_json(cli("declaration", "node-2", "--json"))
    assert published["digest"] == node["digest_applied"]  # nothing stored nor sent for it
    assert json.loads((await kv.get("node-2")).value)["digest"] == node["digest_applied"]
    table = ok(cli("nodes"))
    assert "up, drained" in table and "drained: wants" in table, table

    back = ok_json(cli("undrain", "node-2", "--wait", "--json"))
    assert back["drained"] is False and back["was"] is True and back["plan"] is not None
    assert "brings it up to date" in back["message"]
    up_to_date = back["outcome"]
    assert (up_to_date["trigger"], up_to_date["subject"], up_to_date["state"]) == (
        "undrain", "node-2", "done",
    )  # fmt: skip
    assert [s["machine"] for s in up_to_date["steps"]] == ["node-2"]
    after = await settled(nc, {"node-1": "v2", "node-2": "v2", "node-3": "v2"})
    assert after["node-2"][0] != before["node-2"][0]  # v2 now: a process of the new version
    node = await node_named(nc, "node-2")
    assert node["drained"] is False and node["digest_wanted"] == node["digest_applied"]
    again = ok_json(cli("undrain", "node-2", "--json"))
    assert again["plan"] is None and "it is up to date" in again["message"]


async def test_a_drain_holds_across_a_takeover_and_counts_when_a_step_would_start(
    start_fleet, nc, cli, tmp_path
) -> None:
    fleet = await start_fleet(hosts=3, controllers=("ctl-a", "ctl-b"))
    hosts = tmp_path / "hosts"
    ok(cli("push", str(versioned_module(tmp_path / "v1", version="v1")), "--wait"))
    before = await settled(nc, {"node-1": "v1", "node-2": "v1", "node-3": "v1"})

    # Version 2 waits in tier 0 for node-1's marker; meanwhile node-3 (tier 2) is drained and
    # the holder killed: the next holder finishes the plan and skips node-3 when its turn comes.
    v2 = versioned_module(tmp_path / "v2", version="v2", marker="go", deadline="120s")
    plan_id = ok_json(cli("push", str(v2), "--json"))["plan"]

    async def tier_0_applying():
        p = await ask(nc, "mesh.ctl.plan", {"id": plan_id})
        return p if p and steps_of(p)["node-1"]["state"] == "applying" else None

    await await_until(tier_0_applying, within=30, what="tier 0 applying")
    ok(cli("drain", "node-3"))
    holder = (await held_status(nc))["seat"]
    os.kill(holder["pid"], signal.SIGKILL)

    async def taken_over():
        s = await held_status(nc)
        return s if s and s["seat"]["epoch"] > holder["epoch"] else None

    await await_until(taken_over, within=15, what="the standby taking the seat")
    assert (await node_named(nc, "node-3"))["drained"] is True  # from the store
    for name in ("node-1", "node-2", "node-3"):
        (hosts / name / "go").write_text("")  # healthy anywhere: only the drain holds node-3
    plan = ok_json(cli("plan", str(plan_id), "--follow", "--json"))
    assert plan["state"] == "done"
    steps = steps_of(plan)
    assert [steps[m]["state"] for m in ("node-1", "node-2", "node-3")] == [
        "done", "done", "skipped",
    ]  # fmt: skip
    assert "machine node-3 is drained" in steps["node-3"]["error"]
    now = await settled(nc, {"node-1": "v2", "node-2": "v2", "node-3": "v1"})
    assert now["node-3"] == before["node-3"]
    node = await node_named(nc, "node-3")  # the new holder shows what node-3 waits for
    assert node["digest_wanted"] == steps["node-3"]["after"] != node["digest_applied"]
    assert fleet.controllers["ctl-a"].poll() is not None  # the one killed


async def test_a_revert_leaves_a_machine_drained_since_it_changed(
    start_fleet, nc, cli, tmp_path
) -> None:
    """A drained machine keeps what it runs, a revert included: node-1 got version 2, was
    drained, and keeps version 2 when node-2 fails and the plan reverts."""
    await start_fleet(hosts=2)
    hosts = tmp_path / "hosts"
    ok(cli("push", str(versioned_module(tmp_path / "v1", version="v1", tiers="[0, 1]")), "--wait"))
    v2 = versioned_module(tmp_path / "v2", version="v2", tiers="[0, 1]", marker="go",
                          deadline="6s")  # fmt: skip
    (hosts / "node-1" / "go").write_text("")  # node-1 gets healthy; node-2 never does
    plan_id = ok_json(cli("push", str(v2), "--json"))["plan"]

    async def tier_1_applying():
        p = await ask(nc, "mesh.ctl.plan", {"id": plan_id})
        return p if p and steps_of(p)["node-2"]["state"] == "applying" else None

    await await_until(tier_1_applying, within=30, what="tier 1 applying")
    ok(cli("drain", "node-1"))
    follow = cli("plan", str(plan_id), "--follow", "--json")
    assert follow.returncode == 1  # reverted
    plan = ok_json(cli("plan", str(plan_id), "--json"))
    assert plan["state"] == "reverted"
    steps = steps_of(plan)
    assert steps["node-2"]["reverted"] is True
    assert steps["node-1"]["state"] == "done" and steps["node-1"]["reverted"] is False
    assert "machine node-1 is drained: not reverted" in steps["node-1"]["error"]
    await settled(nc, {"node-1": "v2", "node-2": "v1"})
    # Undrained, it gets what the catalog has now (version 1: the push was taken back).
    assert ok_json(cli("undrain", "node-1", "--wait", "--json"))["outcome"]["state"] == "done"
    await settled(nc, {"node-1": "v1", "node-2": "v1"})
