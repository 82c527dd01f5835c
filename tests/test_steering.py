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

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from faults import finished, holder_above, plan_of, steps
from helpers import MESH, ask, assert_tier_order, await_until, held_status, ok, ok_json
from helpers import one_line_error, when
from module_folders import gated_module
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client.parser import text_string_to_metric_families

from mesh.embedded import ports

NODES = ("node-1", "node-2", "node-3")


@pytest.fixture
def metrics_port() -> int:
    return ports.free_port()


@pytest.fixture
async def three(start_fleet, start_controller, tmp_path, metrics_port):
    """ctl-a holding the seat (its metrics on `metrics_port`), ctl-b standing by, node-1..3 in
    tiers 0, 1, 2, and version 1 of module `gated` on all three (healthy wherever marker `v1`
    is, which every host has). The hosts' roots."""
    extra = {"ctl-a": ("--metrics", str(metrics_port))}
    await start_fleet(
        hosts=3, controllers=("ctl-a", "ctl-b"),
        start_controller=lambda name: start_controller(name, *extra.get(name, ())),
    )  # fmt: skip
    roots = tmp_path / "hosts"
    for name in NODES:
        (roots / name / "v1").write_text("")
    return roots


async def declared(nc) -> dict[str, str]:
    """Each machine's declaration digest in the declarations bucket."""
    kv = await nc.jetstream().key_value("mesh-declarations")
    return {m: json.loads((await kv.get(m)).value)["digest"] for m in NODES}


def version_1(cli, tmp_path: Path) -> dict:
    pushed = ok_json(cli("push", str(gated_module(tmp_path / "v1", marker="v1")), "--wait",
                         "--json"))  # fmt: skip
    assert pushed["outcome"]["state"] == "done"
    return pushed


def version_2(tmp_path: Path, *, marker: str = "go", extra: str = "", **kw: str) -> Path:
    """Version 2 of `gated`: healthy where `marker` is."""
    return gated_module(tmp_path / "v2", marker=marker, version="2", extra=extra, **kw)


async def plan_state(nc, plan_id: int, state: str, **when_steps: str) -> dict:
    """The plan once it is in `state` with these steps' states (machine=state)."""

    async def there():
        p = await plan_of(nc, plan_id)
        if p is None or p["state"] != state:
            return None
        return p if all(steps(p)[m.replace("_", "-")] == s for m, s in when_steps.items()) else None

    return await await_until(there, within=60, what=f"plan {plan_id} {state} {when_steps}")


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
    """The holder's mesh_plans gauge by state."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    except httpx.HTTPError:
        return {}
    return {
        s.labels["state"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mesh_plans"
    }


async def counted(port: int, **states: int) -> dict[str, float]:
    """The holder's metrics once they count plans in these states so (counted every 5 s)."""

    async def there():
        found = await scraped(port)
        return found if all(found.get(k) == v for k, v in states.items()) else None

    return await await_until(there, within=30, what=f"mesh_plans {states}")


# --- held, approved ----------------------------------------------------------------------------


async def test_a_held_push_changes_nothing_until_approved(
    three, nc, cli, nats_url, metrics_port, tmp_path
) -> None:
    """`push --hold --wait` says it waits for approval; meanwhile `plan diff` shows what it
    would change, `status`, `secret set`, reading and another module's plan go on, and no
    machine's declaration moves; `plan approve` rolls it out and the follower ends 0."""
    first = version_1(cli, tmp_path)
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
        held = ok_json(cli("plan", str(plan_id), "--json"))
        assert held["state"] == "held"
        assert sorted(s["machine"] for s in held["steps"]) == list(NODES)
        assert all(s["state"] == "pending" and s["started"] is None for s in held["steps"])

        diff = ok_json(cli("plan", "diff", str(tmp_path / "v2"), "--json"))
        assert sorted(m["machine"] for m in diff["machines"]) == list(NODES)
        assert ok_json(cli("status", "--json"))["seat"]["holder"] == "ctl-a"
        modules = ok_json(cli("modules", "--json"))["modules"]
        assert [m["version"] for m in modules if m["name"] == "gated"] == [first["version"]]
        ok(cli("secret", "set", "steering-token", stdin="x"))
        other = gated_module(tmp_path / "other", name="other", tiers="[2]")
        assert ok_json(cli("push", str(other), "--wait", "--json"))["outcome"]["state"] == "done"
        assert (await declared(nc))["node-1"] == good["node-1"]  # not gated's version 2
        assert (await declared(nc))["node-2"] == good["node-2"]
        assert ok_json(cli("plan", str(plan_id), "--json"))["state"] == "held"
        await counted(metrics_port, held=1)

        said = ok(cli("plan", "approve", str(plan_id)))
        assert f"plan {plan_id} approved: it changes 3 machine(s)" in said, said
        follower.wait(timeout=120)
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
        line = one_line_error(cli("plan", word, str(plan_id)))
        assert line == f"mesh: error: plan-{word}: plan {plan_id} is done: nothing to {word}", line
    line = one_line_error(cli("plan", "approve", "9999"))
    assert line == "mesh: error: plan-approve: plan 9999 does not exist", line
    line = one_line_error(cli("plan", "pause", "x"))
    assert "usage: mesh plan pause ID" in line, line
