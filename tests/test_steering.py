"""Steering a change end to end (docs/operations.md, Steering a change): a plan held until it is
approved, paused and resumed, cancelled (its changed machines given their previous declarations
back, tier by tier in reverse), superseded by a newer change of its module; canaries that fail
during their soak; `pause_after`; refusals naming a plan's state; each state held across a
SIGKILL of the holder; the holder's metrics counting plans by state.

Real controllers, hosts, NATS and PostgreSQL, the command line as a user runs it. A module's
health here is a marker file in its host's root (module_folders.gated_module), so a test decides
when, and on which machine, a version becomes healthy, never by sleeping; which declaration a
machine has is read from the declarations bucket and from the hosts' apply reports.
"""

import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import anyio
import httpx
import pytest
from faults import finished, holder_above, plan_of, steps
from helpers import (
    MESH,
    ask,
    assert_tier_order,
    await_until,
    held_status,
    js,
    ok,
    ok_json,
    one_line_error,
    standing_by,
    when,
)
from module_folders import built_module, gated_module
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client.parser import text_string_to_metric_families

from mesh.embedded import ports

# Real meshes, several plans each: a minute or so here, several on a machine loaded by others.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

NODES = ("node-1", "node-2", "node-3")


def gated(folder: Path, **kw: str) -> Path:
    """module_folders.gated_module as these tests push it: its check given ten seconds to
    answer (python3 starting on a loaded machine may take more than the default second, and a
    soak, or a step waiting, judges every answer) and its steps two minutes."""
    return gated_module(folder, **{"deadline": "120s", "check_timeout": "10s", **kw})


@pytest.fixture
def mesh(cli):
    """`await mesh(*args)`: the command line as conftest's `cli` runs it, in a worker thread,
    so that this test's own NATS connection answers the server's pings meanwhile (a loaded
    machine's commands take seconds each, and the server drops a client silent for 20 s)."""

    async def run(*args: str, **kw: object) -> subprocess.CompletedProcess:
        return await anyio.to_thread.run_sync(functools.partial(cli, *args, **kw))

    return run


@pytest.fixture
def metrics_port() -> int:
    return ports.free_port()


async def two_controllers(start_fleet, start_controller, *, hosts: int, metrics_port: int) -> None:
    """ctl-a holding the seat, its metrics on `metrics_port`, and ctl-b standing by, with
    node-1..N up."""
    extra = {"ctl-a": ("--metrics", str(metrics_port))}
    await start_fleet(
        hosts=hosts, controllers=("ctl-a", "ctl-b"),
        start_controller=lambda name: start_controller(name, *extra.get(name, ())),
    )  # fmt: skip


@pytest.fixture
async def three(start_fleet, start_controller, metrics_port, tmp_path):
    """ctl-a holding the seat (its metrics on `metrics_port`), ctl-b standing by, node-1..3 in
    tiers 0, 1, 2, and version 1 of module `gated` on all three (healthy wherever marker `v1`
    is, which every host has). The hosts' roots."""
    await two_controllers(start_fleet, start_controller, hosts=3, metrics_port=metrics_port)
    roots = tmp_path / "hosts"
    for name in NODES:
        (roots / name / "v1").write_text("")
    return roots


async def declared_of(nc, machines: tuple[str, ...]) -> dict[str, str]:
    """Each machine's declaration digest in the declarations bucket."""
    kv = await js(nc).key_value("mesh-declarations")
    return {m: json.loads((await kv.get(m)).value)["digest"] for m in machines}


async def declared(nc) -> dict[str, str]:
    return await declared_of(nc, NODES)


async def version_1(mesh, tmp_path: Path) -> dict:
    v1 = gated(tmp_path / "v1", marker="v1")
    pushed = ok_json(await mesh("push", str(v1), "--wait", "--json"))
    assert pushed["outcome"]["state"] == "done"
    return pushed


def version_2(tmp_path: Path, *, marker: str = "go", extra: str = "", **kw: str) -> Path:
    """Version 2 of `gated`: healthy where `marker` is. Its steps wait for two minutes (a
    loaded machine's commands take seconds): a step in flight fails at its deadline, and
    these tests decide when it ends."""
    return gated(tmp_path / "v2", marker=marker, version="2", extra=extra, **kw)


async def plan_state(nc, plan_id: int, state: str, **when_steps: str) -> dict:
    """The plan once it is in `state` with these steps' states (machine=state)."""

    seen: list[dict] = []

    async def there():
        p = await plan_of(nc, plan_id)
        seen[:] = [p] if p is not None else []
        if p is None or p["state"] != state:
            return None
        return p if all(steps(p)[m.replace("_", "-")] == s for m, s in when_steps.items()) else None

    # three tiers of python3 checks on a machine the suite loads: a minute was once too short
    try:
        return await await_until(there, within=120, what=f"plan {plan_id} {state} {when_steps}")
    except BaseException:
        last = seen[0] if seen else None  # what it was instead, for whoever reads the failure
        print(
            "last seen:",
            last and {k: last[k] for k in ("state", "phase", "failure")},
            last and [(s["machine"], s["state"], s["error"]) for s in last["steps"]],
        )
        raise


async def beats(nc, machine: str, count: int) -> None:
    """`count` beats of `machine` (about a second each): time for a planner to act, had it
    wanted to, measured by the mesh's own clock rather than a sleep."""
    sub = await nc.subscribe(f"mesh.host.{machine}.beat")
    try:
        for _ in range(count):
            await sub.next_msg(timeout=10)
    finally:
        await sub.unsubscribe()


async def scraped(port: int) -> dict[str, float]:
    """The holder's mesh_plans gauge by state, and mesh_plans_soaking as `soaking`."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return {}
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    found = {s.labels["state"]: s.value for s in samples if s.name == "mesh_plans"}
    for s in samples:
        if s.name == "mesh_plans_soaking":
            found["soaking"] = s.value
    return found


async def counted(port: int, **states: int) -> dict[str, float]:
    """The holder's metrics once they count plans in these states so (counted every 5 s)."""

    async def there():
        found = await scraped(port)
        return found if all(found.get(k) == v for k, v in states.items()) else None

    return await await_until(there, within=30, what=f"mesh_plans {states}")


# --- held, approved ----------------------------------------------------------------------------


async def test_a_held_push_changes_nothing_until_approved(
    three, nc, mesh, nats_url, metrics_port, tmp_path
) -> None:
    """`push --hold --wait` says it waits for approval; meanwhile `plan diff` shows what it
    would change, `status`, `secret set`, reading and another module's plan go on, and no
    machine's declaration moves; `plan approve` rolls it out and the follower ends 0."""
    first = await version_1(mesh, tmp_path)
    good = await declared(nc)
    for name in NODES:
        (three / name / "go").write_text("")
    out = tmp_path / "wait.out"
    with out.open("w") as sink:
        follower = subprocess.Popen(
            [*MESH, "push", str(version_2(tmp_path)), "--hold", "--wait", "--nats-url", nats_url,
             "--timeout", "60"], stdout=sink, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    try:

        async def waits_for_approval():
            lines = [x for x in out.read_text().splitlines() if "waiting for approval" in x]
            return lines[0] if lines else None

        line = await await_until(waits_for_approval, within=60, what="--wait to say it waits")
        plan_id = int(line.split()[1])
        assert line.startswith(f"plan {plan_id} push gated: held, waiting for approval "
                               f"(mesh plan approve {plan_id})"), line  # fmt: skip
        held = ok_json(await mesh("plan", str(plan_id), "--json"))
        assert held["state"] == "held"
        assert sorted(s["machine"] for s in held["steps"]) == list(NODES)
        assert all(s["state"] == "pending" and s["started"] is None for s in held["steps"])

        diff = ok_json(await mesh("plan", "diff", str(tmp_path / "v2"), "--json"))
        assert sorted(m["machine"] for m in diff["machines"]) == list(NODES)
        assert ok_json(await mesh("status", "--json"))["seat"]["holder"] == "ctl-a"
        modules = ok_json(await mesh("modules", "--json"))["modules"]
        assert [m["version"] for m in modules if m["name"] == "gated"] == [first["version"]]
        ok(await mesh("secret", "set", "steering-token", stdin="x"))
        other = gated(tmp_path / "other", name="other", tiers="[2]")
        pushed = ok_json(await mesh("push", str(other), "--wait", "--json"))
        assert pushed["outcome"]["state"] == "done"
        assert (await declared(nc))["node-1"] == good["node-1"]  # not gated's version 2
        assert (await declared(nc))["node-2"] == good["node-2"]
        assert ok_json(await mesh("plan", str(plan_id), "--json"))["state"] == "held"
        await counted(metrics_port, held=1)

        said = ok(await mesh("plan", "approve", str(plan_id)))
        # the digest it approved, and who (on this bus nobody is verified: anonymous)
        assert f"plan {plan_id} approved by anonymous (sha256:" in said, said
        assert "): it changes 3 machine(s)" in said, said
        await anyio.to_thread.run_sync(lambda: follower.wait(timeout=120))
    finally:
        follower.kill()
        _, err = follower.communicate(timeout=10)
    assert follower.returncode == 0, err + out.read_text()
    assert out.read_text().splitlines()[-1].startswith(f"plan {plan_id} done: 3 machine(s)")
    now = await declared(nc)
    assert all(now[m] != good[m] for m in NODES)
    await counted(metrics_port, held=0)

    # Approving, pausing, resuming, cancelling a plan that ended: one line naming its state.
    for word in ("approve", "pause", "resume", "cancel"):
        line = one_line_error(await mesh("plan", word, str(plan_id)))
        assert line == f"mesh: error: plan-{word}: plan {plan_id} is done: nothing to {word}", line
    line = one_line_error(await mesh("plan", "approve", "9999"))
    assert line == "mesh: error: plan-approve: plan 9999 does not exist", line
    line = one_line_error(await mesh("plan", "pause", "x"))
    assert "usage: mesh plan pause ID" in line, line


# --- paused, resumed; cancelled --------------------------------------------------------------


async def test_a_paused_plan_finishes_its_steps_in_flight_and_starts_no_machine_until_resumed(
    three, nc, mesh, metrics_port, tmp_path
) -> None:
    await version_1(mesh, tmp_path)
    (three / "node-1" / "go").write_text("")
    plan_id = ok_json(await mesh("push", str(version_2(tmp_path)), "--json"))["plan"]
    await plan_state(nc, plan_id, "rolling", node_1="done", node_2="applying")

    paused = ok_json(await mesh("plan", "pause", str(plan_id), "--json"))
    assert (paused["plan"], paused["state"]) == (plan_id, "paused")
    assert "already paused" in ok(await mesh("plan", "pause", str(plan_id)))
    assert "paused (mesh plan resume" in ok(await mesh("plan", str(plan_id)))
    (three / "node-2" / "go").write_text("")  # the step in flight finishes
    (three / "node-3" / "go").write_text("")
    await plan_state(nc, plan_id, "paused", node_2="done", node_3="pending")
    await beats(nc, "node-3", 3)  # the planner had three seconds to start node-3: it did not
    p = await plan_state(nc, plan_id, "paused", node_3="pending")
    assert steps(p)["node-3"] == "pending" and p["steps"][2]["started"] is None
    await counted(metrics_port, paused=1)
    assert ok_json(await mesh("status", "--json"))["plan"]["state"] == "paused"

    resumed = ok_json(await mesh("plan", "resume", str(plan_id), "--wait", "--json"))
    assert resumed["state"] == "done" and resumed["outcome"]["state"] == "done"
    assert_tier_order(resumed["outcome"])
    line = one_line_error(await mesh("plan", "resume", str(plan_id)))
    assert line.endswith(f"plan {plan_id} is done: nothing to resume"), line


class Applied:
    """Every apply report the hosts send from now on, in order: (machine, digest)."""

    def __init__(self, sub) -> None:
        self._sub = sub
        self.seen: list[tuple[str, str]] = []

    @classmethod
    async def start(cls, nc) -> "Applied":
        sub = await nc.subscribe("mesh.event.*.applied")
        await nc.flush()  # subscribed at the server before what follows
        return cls(sub)

    async def until(self, wanted: dict[str, str]) -> list[tuple[str, str]]:
        async def all_there() -> bool:
            try:
                while True:
                    report = json.loads((await self._sub.next_msg(timeout=0.05)).data)
                    if report["ok"]:
                        self.seen.append((report["name"], report["digest"]))
            except NatsTimeout:
                pass
            return all(pair in self.seen for pair in wanted.items())

        await await_until(all_there, within=60, what=f"apply reports of {wanted}")
        return self.seen


def reverse_tier_order(applied: list[tuple[str, str]], good: dict[str, str]) -> None:
    """Each machine got its previous declaration back only after the next tier's had (node-3
    before node-2 before node-1), as a revert after a failure does."""
    back = [applied.index((m, good[m])) for m in ("node-3", "node-2", "node-1")]
    assert back == sorted(back), applied


async def test_cancel_gives_the_changed_machines_their_previous_declarations_in_reverse(
    three, nc, mesh, metrics_port, tmp_path
) -> None:
    first = await version_1(mesh, tmp_path)
    good = await declared(nc)
    applied = await Applied.start(nc)
    for name in ("node-1", "node-2"):
        (three / name / "go").write_text("")
    plan_id = ok_json(await mesh("push", str(version_2(tmp_path)), "--json"))["plan"]
    await plan_state(nc, plan_id, "rolling", node_2="done", node_3="applying")

    cancelled = ok_json(await mesh("plan", "cancel", str(plan_id), "--wait", "--json"))
    assert cancelled["state"] == "cancelled" and cancelled["outcome"]["state"] == "cancelled"
    plan = cancelled["outcome"]
    assert plan["cancelled"].startswith("cancelled by "), plan
    assert all(s["reverted"] for s in plan["steps"]), plan["steps"]
    reverse_tier_order(await applied.until(good), good)
    assert await declared(nc) == good
    modules = ok_json(await mesh("modules", "--json"))["modules"]
    assert [m["version"] for m in modules if m["name"] == "gated"] == [first["version"]]
    await counted(metrics_port, cancelled=1)
    for word in ("pause", "cancel"):
        line = one_line_error(await mesh("plan", word, str(plan_id)))
        assert line.endswith(f"plan {plan_id} is cancelled: nothing to {word}"), line


async def test_a_newer_change_of_the_module_supersedes_its_held_and_paused_plans(
    three, nc, mesh, tmp_path
) -> None:
    """The decision (docs/operations.md, Steering a change): a push, assign or unassign of a
    module cancels the module's held and paused plans, naming the plan that supersedes them; a
    paused one's changed machines get their previous declarations back before the new plan
    rolls."""
    await version_1(mesh, tmp_path)
    held = ok_json(await mesh("push", str(version_2(tmp_path)), "--hold", "--json"))
    assert held["state"] == "held"
    (three / "node-1" / "go").write_text("")
    v3 = gated(tmp_path / "v3", marker="go", version="3")
    paused = ok_json(await mesh("push", str(v3), "--json"))["plan"]
    first = ok_json(await mesh("plan", str(held["plan"]), "--json"))
    assert first["state"] == "cancelled", first
    assert first["cancelled"] == f"superseded by plan {paused}", first
    await plan_state(nc, paused, "rolling", node_1="done", node_2="applying")
    ok(await mesh("plan", "pause", str(paused)))

    v4 = gated(tmp_path / "v4", marker="v1", version="4")
    newest = ok_json(await mesh("push", str(v4), "--wait", "--json"))
    assert newest["outcome"]["state"] == "done"
    second = ok_json(await mesh("plan", str(paused), "--json"))
    assert second["state"] == "cancelled", second
    assert second["cancelled"] == f"superseded by plan {newest['plan']}", second
    assert steps(second) == {"node-1": "reverted", "node-2": "reverted", "node-3": "pending"}
    assert when(second["finished"]) <= when(newest["outcome"]["started"])
    after = {s["machine"]: s["after"] for s in newest["outcome"]["steps"]}
    assert await declared(nc) == after
    modules = ok_json(await mesh("modules", "--json"))["modules"]
    assert [m["version"] for m in modules if m["name"] == "gated"] == [newest["version"]]


async def test_pause_after_pauses_the_plan_after_that_tier_once(three, nc, mesh, tmp_path):
    await version_1(mesh, tmp_path)
    v2 = version_2(tmp_path, marker="v1", extra="pause_after = [0]\n")
    plan_id = ok_json(await mesh("push", str(v2), "--json"))["plan"]
    await plan_state(nc, plan_id, "paused", node_1="done", node_2="pending")
    shown = ok(await mesh("plan", str(plan_id)))
    assert "paused (mesh plan resume" in shown and "pause after tier 0" in shown, shown
    await beats(nc, "node-2", 2)
    await plan_state(nc, plan_id, "paused", node_2="pending")
    done = ok_json(await mesh("plan", "resume", str(plan_id), "--wait", "--json"))["outcome"]
    assert done["state"] == "done"  # not paused again after tier 0
    assert_tier_order(done)


# --- canaries and soaks -------------------------------------------------------------------------


@pytest.fixture
async def four(start_fleet, start_controller, mesh, tmp_path, metrics_port):
    """ctl-a holding the seat (its metrics on `metrics_port`), ctl-b standing by, node-1..4
    (node-3 and node-4 in tier 2), version 1 of `gated` on tier 2 (node-3, node-4). The hosts'
    roots."""
    await two_controllers(start_fleet, start_controller, hosts=4, metrics_port=metrics_port)
    roots = tmp_path / "hosts"
    for name in ("node-3", "node-4"):
        (roots / name / "v1").write_text("")
    v1 = gated(tmp_path / "v1", marker="v1", tiers="[2]")
    assert ok_json(await mesh("push", str(v1), "--wait", "--json"))["outcome"]["state"] == "done"
    return roots


async def soaking(nc, plan_id: int) -> dict:
    """The plan once its canary (node-3) is done and soaking, node-4 not started."""

    async def there():
        p = await plan_of(nc, plan_id)
        if p is None or p.get("soak") is None:
            return None
        return p if steps(p) == {"node-3": "done", "node-4": "pending"} else None

    return await await_until(there, within=60, what=f"plan {plan_id}'s canary soaking")


async def test_a_canary_failing_during_its_soak_stops_the_plan_before_the_rest_of_its_tier(
    four, nc, mesh, metrics_port, tmp_path
) -> None:
    good = await declared_of(nc, ("node-3", "node-4"))
    v2 = version_2(tmp_path, mode="fails-if", marker="broken", tiers="[2]",
                   extra='canary = 1\nsoak = "120s"\n')  # fmt: skip
    plan_id = ok_json(await mesh("push", str(v2), "--json"))["plan"]
    p = await soaking(nc, plan_id)
    assert p["soak"]["tier"] == 2 and p["soak"]["left"] > 0
    assert [t["state"] for t in p["tiers"]] == ["soaking"], p["tiers"]
    shown = ok(await mesh("plan", str(plan_id)))
    assert "tier 2 soaking (" in shown and "canary 1, soak 120s" in shown, shown
    assert "soaking" in ok(await mesh("status"))
    await counted(metrics_port, rolling=1, soaking=1)

    (four / "node-3" / "broken").write_text("")  # the canary fails during its soak
    plan = await finished(nc, plan_id, within=60)
    assert plan["state"] == "reverted", plan
    s = {x["machine"]: x for x in plan["steps"]}
    assert s["node-3"]["state"] == "failed" and "during the soak" in s["node-3"]["error"]
    assert s["node-3"]["reverted"] is True
    assert s["node-4"]["state"] == "pending" and s["node-4"]["started"] is None
    assert "node-3" in plan["failure"] and "during the soak" in plan["failure"]
    assert await declared_of(nc, ("node-3", "node-4")) == good
    await counted(metrics_port, rolling=0, soaking=0, reverted=1)
    line = one_line_error(await mesh("plan", "cancel", str(plan_id)))
    assert line.endswith(f"plan {plan_id} is reverted: nothing to cancel"), line


async def test_a_soak_outlives_the_holder_and_the_rest_go_when_it_ends(
    four, nc, mesh, tmp_path
) -> None:
    v2 = version_2(tmp_path, marker="v1", tiers="[2]", extra='canary = "50%"\nsoak = "8s"\n')
    plan_id = ok_json(await mesh("push", str(v2), "--json"))["plan"]
    p = await soaking(nc, plan_id)
    until = when(p["soak"]["until"])
    epoch = await kill_the_holder(nc)
    await holder_above(nc, epoch)
    again = await plan_of(nc, plan_id)
    assert again is not None and again["state"] == "rolling"
    if again["soak"] is not None:  # still soaking: until the same moment
        assert when(again["soak"]["until"]) == until
    plan = await finished(nc, plan_id, within=90)
    assert plan["state"] == "done", plan
    s = {x["machine"]: x for x in plan["steps"]}
    assert when(s["node-4"]["started"]) >= until  # the rest of the tier after the soak
    assert when(s["node-3"]["finished"]) <= until


# --- takeovers: held, paused (pause_after), half-cancelled -------------------------------------


async def kill_the_holder(nc) -> int:
    """SIGKILL the seat's holder; its epoch."""
    seat = (await held_status(nc))["seat"]
    os.kill(seat["pid"], signal.SIGKILL)
    return seat["epoch"]


async def test_held_and_paused_plans_stay_so_across_takeovers(
    three, nc, mesh, start_controller, tmp_path
) -> None:
    """SIGKILL the holder while the plan is held: the next keeps it held; approved, it pauses
    itself after tier 0 (pause_after); SIGKILL that holder: the next keeps it paused, starts no
    machine, and once resumed finishes it without pausing again."""
    await version_1(mesh, tmp_path)
    good = await declared(nc)
    v2 = version_2(tmp_path, marker="v1", extra="pause_after = [0]\n")
    plan_id = ok_json(await mesh("push", str(v2), "--hold", "--json"))["plan"]
    epoch = await kill_the_holder(nc)
    start_controller("ctl-c")
    await holder_above(nc, epoch)
    await await_until(lambda: standing_by(nc, "ctl-c"), within=60, what="ctl-c standing by")
    assert (await plan_of(nc, plan_id))["state"] == "held"
    assert await declared(nc) == good
    ok(await mesh("plan", "approve", str(plan_id)))
    await plan_state(nc, plan_id, "paused", node_1="done", node_2="pending")

    epoch = await kill_the_holder(nc)
    await holder_above(nc, epoch)
    await beats(nc, "node-2", 3)
    p = await plan_state(nc, plan_id, "paused", node_1="done", node_2="pending")
    assert (await declared(nc))["node-2"] == good["node-2"]
    assert p["steps"][1]["started"] is None
    done = ok_json(await mesh("plan", "resume", str(plan_id), "--wait", "--json"))["outcome"]
    assert done["state"] == "done"
    assert_tier_order(done)


async def test_a_half_cancelled_plan_is_cancelled_to_the_end_by_the_next_holder(
    three, nc, mesh, tmp_path
) -> None:
    """Cancel a plan whose three machines changed; version 1 is not healthy on node-3 until a
    marker comes back, so the revert waits in tier 2; SIGKILL the holder there: the next one
    reverts tier 2, then 1, then 0, and ends it cancelled."""
    await version_1(mesh, tmp_path)
    good = await declared(nc)
    applied = await Applied.start(nc)
    for name in ("node-1", "node-2"):  # node-3 waits in its step: no marker there
        (three / name / "go").write_text("")
    plan_id = ok_json(await mesh("push", str(version_2(tmp_path)), "--json"))["plan"]
    await plan_state(nc, plan_id, "rolling", node_2="done", node_3="applying")
    (three / "node-3" / "v1").unlink()  # and version 1 will not settle there
    ok(await mesh("plan", "cancel", str(plan_id)))

    async def reverting_tier_2():
        return (await declared(nc))["node-3"] == good["node-3"]

    await await_until(reverting_tier_2, within=60, what="node-3 sent version 1 back")
    p = await plan_of(nc, plan_id)
    assert p["state"] == "rolling" and p["phase"] == "revert", p
    assert not any(s["reverted"] for s in p["steps"] if s["machine"] != "node-3"), p["steps"]
    epoch = await kill_the_holder(nc)
    await holder_above(nc, epoch)
    assert (await declared(nc))["node-2"] != good["node-2"]  # still version 2 there
    (three / "node-3" / "v1").write_text("")
    plan = await finished(nc, plan_id, within=90)
    assert plan["state"] == "cancelled", plan
    assert all(s["reverted"] for s in plan["steps"]), plan["steps"]
    reverse_tier_order(await applied.until(good), good)
    assert await declared(nc) == good


async def test_a_plan_cancelled_while_its_bundles_build_is_not_pushed_again(
    start_fleet, nc, mesh, tmp_path
) -> None:
    """Its push ends with one line naming the cancel (`conflict`, which the command line does
    not ask again, as it would `unavailable`), and nothing is registered."""
    await start_fleet(hosts=1, builder=True)
    # Where the build's account can see it (the test's own folder is its account's alone).
    shared = Path(tempfile.mkdtemp(prefix="mesh-steering-"))
    shared.chmod(0o755)
    go = shared / "build-may-end"
    script = f"while [ ! -e {go} ]; do sleep 0.1; done\nmkdir -p out && cp build.sh out/app\n"
    pushing = anyio.Event()
    result: list[subprocess.CompletedProcess] = []

    async def push() -> None:
        result.append(await mesh("push", str(built_module(tmp_path / "m", script))))
        pushing.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(push)

        async def building():
            plans = (await ask(nc, "mesh.ctl.plans", {}) or {}).get("plans", [])
            return plans[0]["id"] if plans and plans[0]["state"] == "building" else None

        plan_id = await await_until(building, within=120, what="the push's plan building")
        said = ok(await mesh("plan", "cancel", str(plan_id)))
        assert f"plan {plan_id} cancelled: no machine had changed" in said, said
        go.write_text("")
        await pushing.wait()
    shutil.rmtree(shared)
    line = one_line_error(result[0])
    assert line.startswith(f"mesh: error: push: plan {plan_id} was cancelled by "), line
    assert line.endswith(" while its bundles built: nothing was registered"), line
    assert ok_json(await mesh("modules", "--json"))["modules"] == []
    plans = ok_json(await mesh("plan", "--json"))["plans"]
    assert [(p["id"], p["state"]) for p in plans] == [(plan_id, "cancelled")]


async def test_an_approval_binds_to_what_the_plan_does_when_it_was_reviewed(
    start_fleet, cli, tmp_path
) -> None:
    """`plan approve --digest D`: a held plan whose change the catalog moved since it was
    reviewed (another push onto its machine) is refused, its steps recorded as they are now,
    with their new digest; approved with that one, it runs."""
    await start_fleet(hosts=1)
    ok(cli("push", str(gated_module(tmp_path / "a", name="alpha", tiers="[]"))))
    held = ok_json(cli("assign", "alpha", "node-1", "--hold", "--json"))
    plan_id = held["plan"]
    reviewed = ok_json(cli("plan", str(plan_id), "--json"))["digest"]
    assert reviewed.startswith("sha256:") and f"digest: {reviewed}" in ok(cli("plan", str(plan_id)))
    # Meanwhile, another module comes to node-1: what the held plan would give it is not what
    # was reviewed any more.
    ok(cli("push", str(gated_module(tmp_path / "b", name="beta", tiers="[0]")), "--wait"))
    line = one_line_error(cli("plan", "approve", str(plan_id), "--digest", reviewed))
    now = ok_json(cli("plan", str(plan_id), "--json"))
    assert now["state"] == "held" and now["digest"] not in ("", reviewed), now
    assert f"plan {plan_id} now does {now['digest']}, not {reviewed}" in line, line
    assert f"approve with --digest {now['digest']}" in line, line
    done = ok_json(cli("plan", "approve", str(plan_id), "--digest", now["digest"], "--wait",
                       "--json"))  # fmt: skip
    assert done["state"] == "done" and now["digest"] in done["message"], done
    for args, why in ((("approve", str(plan_id), "--digest", "sha256:12"), "is not a digest"),):
        usage = cli("plan", *args)
        assert usage.returncode == 2 and why in usage.stderr, usage.stderr
    line = one_line_error(cli("plan", "pause", str(plan_id), "--digest", now["digest"]))
    assert "--digest: only `mesh plan approve ID` takes it" in line, line
