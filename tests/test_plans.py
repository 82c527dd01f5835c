"""Plans end to end: tiers in order, the first failure stops and reverts, a down machine fails at
the deadline, a killed controller's plan is finished by the next holder, plans queue, `--wait`
shows the progress the holder tells and asks `plan` only a few times, across a handover too.

Real controllers, hosts, NATS and PostgreSQL. A module's health check here is a small script
that looks for a marker file in its host's root (module_folders.gated_module), so a test
decides when (and on which machine) a version becomes healthy or never does, without sleeping.
"""

import json
import os
import re
import signal
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from helpers import MESH, ask, assert_tier_order, await_until, hosts_up, js, ok_json, when
from module_folders import gated_module
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client.parser import text_string_to_metric_families

from mesh.embedded import ports


@pytest.fixture
def scraped() -> dict[str, int]:
    """Each controller's metrics port (`three` starts them with --metrics)."""
    return {name: ports.free_port() for name in ("ctl-a", "ctl-b")}


async def plan_asks(scraped: dict[str, int]) -> int:
    """`plan` requests both controllers answered, from their metrics: a count that, unlike
    $SRV.STATS (a standby lists no endpoints), outlives a handover."""

    async def scrape() -> list[float] | None:
        texts = []
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                for port in scraped.values():
                    texts.append((await client.get(f"http://127.0.0.1:{port}/metrics")).text)
        except httpx.HTTPError:  # a controller's endpoint comes a moment after it starts
            return None
        families = [f for text in texts for f in text_string_to_metric_families(text)]
        samples = [s for f in families for s in f.samples if s.name == "mesh_verb_requests_total"]
        return [sum(s.value for s in samples if s.labels["verb"] == "plan")]

    [asked] = await await_until(scrape, within=30, what="the controllers' metrics")
    return int(asked)


@pytest.fixture
async def three(start_fleet, start_controller, tmp_path, scraped):
    """Two controllers (ctl-a holds the seat) and node-1..3 in tiers 0, 1, 2; the hosts' roots."""
    await start_fleet(
        hosts=3, controllers=("ctl-a", "ctl-b"),
        start_controller=lambda name: start_controller(name, "--metrics", str(scraped[name])),
    )  # fmt: skip
    return tmp_path / "hosts"


async def test_tiers_in_order_then_a_broken_version_stops_and_reverts(
    three, nc, cli, tmp_path
) -> None:
    first = ok_json(cli("push", str(gated_module(tmp_path / "v1")), "--wait", "--json"))
    plan = first["outcome"]
    assert plan["state"] == "done"
    assert [(s["machine"], s["tier"], s["state"]) for s in plan["steps"]] == [
        ("node-1", 0, "done"), ("node-2", 1, "done"), ("node-3", 2, "done"),
    ]  # fmt: skip
    assert_tier_order(plan)
    kv = await js(nc).key_value("mesh-declarations")
    good = {
        m: json.loads((await kv.get(m)).value)["digest"] for m in ("node-1", "node-2", "node-3")
    }

    # Every apply report from here on, in the order the hosts sent them: the revert's order.
    reports = await nc.subscribe("mesh.event.*.applied")
    await nc.flush()  # subscribed at the server before the push below

    # Version 2 never gets healthy on node-2 (tier 1): its marker is there and only there.
    (three / "node-2" / "broken").write_text("")
    v2 = gated_module(tmp_path / "v2", mode="fails-if", marker="broken", deadline="4s", version="2")
    failed = cli("push", str(v2), "--wait")
    assert failed.returncode == 1, failed.stdout
    line = failed.stderr.strip().splitlines()[-1]
    assert "reverted" in line and "node-2" in line and "not healthy" in line, failed.stderr
    assert "Traceback" not in failed.stderr

    plans = ok_json(cli("plan", "--json"))["plans"]
    plan = ok_json(cli("plan", str(plans[0]["id"]), "--json"))
    assert plan["state"] == "reverted" and "node-2" in plan["failure"]
    steps = {s["machine"]: s for s in plan["steps"]}
    assert steps["node-1"]["state"] == "reverted"
    assert steps["node-2"]["state"] == "failed" and steps["node-2"]["reverted"] is True
    assert steps["node-3"]["state"] == "pending" and steps["node-3"]["started"] is None
    assert_tier_order(plan)
    for machine in ("node-1", "node-2", "node-3"):  # node-3 never left version 1
        assert json.loads((await kv.get(machine)).value)["digest"] == good[machine]

    async def reverted_and_healthy():
        nodes = (await ask(nc, "mesh.ctl.nodes"))["nodes"]
        return all(
            n["digest_applied"] == good[n["name"]]
            and [(p["name"], p["healthy"]) for p in n["processes"]] == [("gated", True)]
            for n in nodes
        )

    await await_until(reverted_and_healthy, within=30, what="version 1 back and healthy")

    # The revert ran tier by tier in reverse: node-2 (tier 1) had version 1 back, applied,
    # before node-1 (tier 0) was even sent it.
    applied: list[tuple[str, str]] = []

    async def both_back() -> bool:
        try:
            while True:
                report = json.loads((await reports.next_msg(timeout=0.05)).data)
                if report["ok"]:
                    applied.append((report["name"], report["digest"]))
        except NatsTimeout:
            pass
        return all((m, good[m]) in applied for m in ("node-1", "node-2"))

    await await_until(both_back, within=30, what="the revert's apply reports")
    assert applied.index(("node-2", good["node-2"])) < applied.index(("node-1", good["node-1"]))
    assert applied[0][0] == "node-1" and applied[0][1] != good["node-1"], applied  # v2 first
    modules = ok_json(cli("modules", "--json"))["modules"]
    assert modules[0]["version"] == first["version"]  # the catalog went back too


async def test_a_down_machine_fails_its_step_at_the_deadline(
    nc, cli, start_controller, start_host, tmp_path
) -> None:
    start_controller("ctl-a")
    start_host("node-1", "--tier", "0")
    node2 = start_host("node-2", "--tier", "1", beat=0.3)
    await hosts_up(nc, 2)
    os.killpg(node2.pid, signal.SIGSTOP)
    try:
        await hosts_up(nc, 1)  # node-2 down
        failed = cli("push", str(gated_module(tmp_path / "m", deadline="3s")), "--wait")
    finally:
        os.killpg(node2.pid, signal.SIGCONT)
    assert failed.returncode == 1, failed.stdout
    assert "machine node-2: machine node-2 is down" in failed.stderr, failed.stderr


async def test_a_plan_outlives_the_controller_that_started_it(three, nc, cli, tmp_path):
    """SIGKILL the holder while tier 1 waits; the standby takes the seat and finishes it."""
    pushed = ok_json(cli("push", str(gated_module(tmp_path / "m", marker="ready")), "--json"))
    (three / "node-1" / "ready").write_text("")

    async def rolling_tier_1():
        p = await ask(nc, "mesh.ctl.plan", {"id": pushed["plan"]})
        steps = {s["machine"]: s["state"] for s in p["steps"]}
        return p if steps["node-1"] == "done" and steps["node-2"] == "applying" else None

    await await_until(rolling_tier_1, within=30, what="tier 1 applying")
    holder = (await ask(nc, "mesh.ctl.status"))["seat"]
    os.kill(holder["pid"], signal.SIGKILL)

    async def new_holder():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["seat"]["epoch"] > holder["epoch"] else None

    await await_until(new_holder, within=15, what="the standby to take the seat")
    (three / "node-2" / "ready").write_text("")
    (three / "node-3" / "ready").write_text("")
    plan = ok_json(cli("plan", str(pushed["plan"]), "--follow", "--json"))
    assert plan["state"] == "done"
    assert [s["state"] for s in plan["steps"]] == ["done", "done", "done"]
    assert_tier_order(plan)


async def test_a_later_plan_waits_for_the_one_rolling(three, nc, cli, tmp_path) -> None:
    first = ok_json(cli("push", str(gated_module(tmp_path / "a", marker="go")), "--json"))
    second = ok_json(
        cli("push", str(gated_module(tmp_path / "b", name="other", tiers="[2]")), "--json")
    )
    assert second["plan"] > first["plan"]

    async def both():
        return [await ask(nc, "mesh.ctl.plan", {"id": p["plan"]}) for p in (first, second)]

    async def first_rolling():
        a, b = await both()
        return (a, b) if a["state"] == "rolling" else None

    a, b = await await_until(first_rolling, within=15, what="the first plan rolling")
    assert b["state"] == "pending"
    for name in ("node-1", "node-2", "node-3"):
        (three / name / "go").write_text("")
    done = ok_json(cli("plan", str(second["plan"]), "--follow", "--json"))
    assert done["state"] == "done"
    a, b = await both()
    assert a["state"] == "done"
    assert when(a["finished"]) <= when(b["started"])


# --- following a plan: what the holder tells, `plan` asked a few times -------------------------


def waiting(nats_url: str, folder: Path, out: Path) -> subprocess.Popen:
    """`mesh push FOLDER --wait` as a pipe sees it (a line per change), writing to `out`."""
    with out.open("w") as sink:
        return subprocess.Popen(
            [*MESH, "push", str(folder), "--wait", "--nats-url", nats_url, "--timeout", "60"],
            stdout=sink, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip


async def said(out: Path, line: str) -> bool:
    return line in out.read_text().splitlines()


async def ended(proc: subprocess.Popen) -> bool:
    return proc.poll() is not None


async def followed(
    three: Path, nats_url: str, scraped: dict[str, int], folder: Path,
    hold: Callable[[], Awaitable[None]],
) -> tuple[list[str], int]:  # fmt: skip
    """`push --wait` of a plan whose tier 1 waits while `hold()` runs (tier 0 told done
    first): what it printed, and how many times it asked `plan`. It ends 0, the plan done."""
    (three / "node-1" / "go").write_text("")
    before = await plan_asks(scraped)
    out = folder / "wait.out"
    follower = waiting(nats_url, gated_module(folder / "m", marker="go"), out)
    try:
        await await_until(lambda: said(out, "  tier 0 done: 1 of 1 machine(s) done"), within=60,
                          what="tier 0 told done")  # fmt: skip
        await hold()
        (three / "node-2" / "go").write_text("")
        (three / "node-3" / "go").write_text("")
        await await_until(lambda: ended(follower), within=60, what="push --wait to end")
    finally:
        follower.kill()
        _, err = follower.communicate(timeout=10)
    assert follower.returncode == 0, err
    shown = out.read_text().splitlines()
    assert re.fullmatch(r"plan \d+ done: 3 machine\(s\) in [\d.]+s", shown[-1]), shown
    return shown, await plan_asks(scraped) - before


async def test_wait_shows_the_told_progress_and_asks_plan_a_few_times(
    three, nc, nats_url, scraped, tmp_path
) -> None:
    """Tier 1 is held for six of node-2's beats (about six seconds, with nothing to tell): the
    follower asks `plan` at the start, once per quiet while and at the end, and shows every
    tier as the holder tells it. Asking twice a second, as it did, cost a dozen asks or more."""

    async def six_beats() -> None:
        beats = await nc.subscribe("mesh.host.node-2.beat")
        for _ in range(6):
            await beats.next_msg(timeout=10)
        await beats.unsubscribe()

    shown, asks = await followed(three, nats_url, scraped, tmp_path, six_beats)
    assert 2 <= asks <= 5, asks
    for tier in (1, 2):
        assert f"  tier {tier} done: 1 of 1 machine(s) done" in shown, shown


async def test_wait_follows_a_plan_across_a_handover(three, nc, nats_url, cli, scraped, tmp_path):
    """`mesh handover` while tier 1 waits: the follower hears the new holder's `held`, asks it,
    and shows the rest as ctl-b tells it; `--wait` ends 0 with the plan done, having asked
    `plan` a few times."""

    async def handed_over() -> None:
        ok_json(cli("handover", "--json"))

        async def ctl_b_holds():
            s = await ask(nc, "mesh.ctl.status")
            return s if s and s["seat"] and s["seat"]["holder"] == "ctl-b" else None

        await await_until(ctl_b_holds, within=30, what="ctl-b to hold the seat")

    shown, asks = await followed(three, nats_url, scraped, tmp_path, handed_over)
    assert "  tier 2 done: 1 of 1 machine(s) done" in shown, shown  # told by ctl-b
    assert 2 <= asks <= 5, asks
