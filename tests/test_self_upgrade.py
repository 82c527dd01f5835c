"""The mesh deploys itself: its own code as a bundle, host agents and controllers upgraded
through plans (docs/operations.md, "Upgrading the mesh").

Versions of the mesh are copies of this checkout's packages with a marker that differs, so each
is a new bundle, built by the builder host from the pushed source. Real hosts, a real NATS and
PostgreSQL, real processes; as root, real accounts.
"""

import anyio
import pytest
from helpers import (
    StatusEvery10ms,
    ask,
    assert_tier_order,
    await_until,
    hosts_up,
    mesh_copy,
    ok,
    ok_json,
)
from module_folders import write_module

# its hosts deploy services/controller (helpers.seeds_container)
pytestmark = pytest.mark.deploys_controller

NODES = ("node-1", "node-2", "node-3")
UPGRADE = 600  # seconds a command may take while the mesh upgrades itself

SLEEPER = """\
[module]
name = "sleeper"
[bundle.bin]
kind = "system"
path = "/usr/bin"
[account.mesh-test-sleeper]
[process.sleeper]
bundle = "bin"
command = ["sleep", "100000"]
account = "mesh-test-sleeper"
[assign]
tiers = [0, 1, 2]
"""


async def processes(nc) -> dict[str, dict[str, int]]:
    """Machine -> process -> pid."""
    nodes = (await ask(nc, "mesh.ctl.nodes"))["nodes"]
    return {n["name"]: {p["name"]: p["pid"] for p in n["processes"]} for n in nodes}


async def versions(nc) -> dict[str, str | None]:
    nodes = (await ask(nc, "mesh.ctl.nodes"))["nodes"]
    return {n["name"]: n.get("version") for n in nodes}


@pytest.fixture
async def sleeping(start_fleet, cli, tmp_path):
    """Two controllers, node-1..3 in tiers 0, 1, 2 (node-1 builds), each running `sleeper`;
    a folder for the mesh's versions."""
    await start_fleet(hosts=3, builder=True, controllers=("ctl-a", "ctl-b"), within=60)
    module = write_module(tmp_path / "sleeper", SLEEPER)
    pushed = ok_json(cli("push", str(module), "--wait", "--json", timeout=UPGRADE))
    assert pushed["outcome"]["state"] == "done"
    return tmp_path


async def test_host_agents_upgrade_through_tiers_keeping_every_process(sleeping, nc, cli) -> None:
    before = await processes(nc)
    sleepers = {m: before[m]["sleeper"] for m in NODES}
    assert all(sleepers.values())

    client = StatusEvery10ms()
    stop = anyio.Event()
    plans = []
    last_agents: dict[str, int | None] = {}
    last_versions: dict[str, str | None] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.run, nc, stop)
        for marker in ("v1", "v2"):
            source = mesh_copy(sleeping / marker, marker)
            host_module = str(source / "services" / "host")
            pushed = await anyio.to_thread.run_sync(
                lambda m=host_module: cli("push", m, "--wait", "--json", timeout=UPGRADE)
            )
            plans.append(ok_json(pushed)["outcome"])
            after = await processes(nc)
            agents = {m: after[m].get("mesh-host") for m in NODES}
            now = await versions(nc)
            # Every agent is the new one: a new pid, running the new bundle's digest.
            assert all(agents.values()), after
            assert len(set(now.values())) == 1 and next(iter(now.values())).startswith("sha256:")
            if last_agents:  # v2: new agents again, another version
                assert all(agents[m] != last_agents[m] for m in NODES), (agents, last_agents)
                assert now != last_versions
            last_agents, last_versions = agents, now
            # Every supervised process kept its pid.
            assert {m: after[m]["sleeper"] for m in NODES} == sleepers
        stop.set()

    for plan in plans:
        assert plan["state"] == "done", plan
        assert [(s["machine"], s["tier"], s["state"]) for s in plan["steps"]] == [
            ("node-1", 0, "done"), ("node-2", 1, "done"), ("node-3", 2, "done"),
        ]  # fmt: skip
        assert_tier_order(plan)
    assert client.sent > 100
    assert client.unanswered == [], client.unanswered[:5]

    # v3's agent exits at start; v4's once the old agent has let go (the old one then runs
    # itself again, the same pid, and takes the machine back). Either way tier 0 fails, the v2
    # agent runs on, the plan reverts, tiers 1 and 2 are never touched.
    broken_versions = [
        ("v3", "at start", "exited with code 3"),
        ("v4", "after go", "exited with code 4 after it was handed"),
    ]
    for marker, how, says in broken_versions:
        broken = mesh_copy(sleeping / marker, marker, broken_agent=how)
        failed = await anyio.to_thread.run_sync(
            lambda b=broken: cli("push", str(b / "services" / "host"), "--wait", timeout=UPGRADE)
        )
        assert failed.returncode == 1, failed.stdout
        assert "Traceback" not in failed.stderr
        assert says in failed.stderr, failed.stderr
        plan = ok_json(cli("plan", "--json", timeout=UPGRADE))["plans"][0]
        plan = ok_json(cli("plan", str(plan["id"]), "--json", timeout=UPGRADE))
        assert plan["state"] == "reverted", plan
        steps = {s["machine"]: s for s in plan["steps"]}
        assert steps["node-1"]["state"] == "failed" and "agent" in steps["node-1"]["error"]
        assert steps["node-2"]["state"] == steps["node-3"]["state"] == "pending"
        assert steps["node-2"]["started"] is None and steps["node-3"]["started"] is None

        async def v2_back():
            found = await processes(nc)
            healthy = (await ask(nc, "mesh.ctl.nodes"))["nodes"]
            return (
                {m: found[m].get("mesh-host") for m in NODES} == last_agents
                and await versions(nc) == last_versions
                and all(p["healthy"] for n in healthy for p in n["processes"])
            )

        await await_until(v2_back, within=60, what=f"the v2 agents back after {marker}")
        assert {m: (await processes(nc))[m]["sleeper"] for m in NODES} == sleepers


async def test_the_controller_upgrades_through_a_plan_with_nothing_unanswered(
    nc, cli, database_url, start_controller, start_host, tmp_path
) -> None:
    first = start_controller("ctl-a")
    start_host("node-1", "--tier", "0", "--label", "builder=true", "--label", "role=control")
    start_host("node-2", "--tier", "1", "--label", "role=control")
    await hosts_up(nc, 2, within=60)
    # The store here is the test harness's, without TLS: its URL names no CA file.
    for name, value in (("mesh-database-url", database_url), ("mesh-controller-creds", ""),
                        ("mesh-store-ca", ""), ("mesh-system-creds", ""),
                        ("mesh-nats-signer", "")):  # fmt: skip
        ok(cli("secret", "set", name, stdin=value, timeout=60))

    v1 = mesh_copy(tmp_path / "v1", "v1")
    plan = ok_json(
        cli("push", str(v1 / "services" / "controller"), "--wait", "--json", timeout=UPGRADE)
    )
    assert plan["outcome"]["state"] == "done", plan
    first.terminate()  # the installed controller hands the seat to a v1 process and leaves

    async def v1_holds():
        s = await ask(nc, "mesh.ctl.status")
        ok_ = s and s["seat"] and s["seat"]["holder"] != "ctl-a" and s["standbys"]
        return s if ok_ and s["seat"].get("version", "").startswith("sha256:") else None

    held = await await_until(v1_holds, within=60, what="a v1 controller process holding")
    v1_version = held["seat"]["version"]

    client = StatusEvery10ms()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(client.run, nc, stop)
        v2 = mesh_copy(tmp_path / "v2", "v2")
        pushed = await anyio.to_thread.run_sync(
            lambda: cli(
                "push", str(v2 / "services" / "controller"), "--wait", "--json", timeout=UPGRADE
            )
        )
        stop.set()
    plan = ok_json(pushed)["outcome"]
    assert plan["state"] == "done", plan
    assert [(s["machine"], s["tier"], s["state"]) for s in plan["steps"]] == [
        ("node-1", 0, "done"), ("node-2", 1, "done"),
    ]  # fmt: skip
    assert client.sent > 100
    assert client.unanswered == [], client.unanswered[:5]

    s = await ask(nc, "mesh.ctl.status")
    assert s["seat"]["version"].startswith("sha256:") and s["seat"]["version"] != v1_version
    assert all(b["version"] == s["seat"]["version"] for b in s["standbys"]), s
