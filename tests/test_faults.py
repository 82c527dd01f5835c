"""Fault tests (docs/design.md, issue 6): the holder SIGKILLed again and again during a plan, the
holder SIGSTOPped past the step-down bound and woken later, PostgreSQL and the nats-server
restarted during a plan. Real controllers, hosts, nats-server and PostgreSQL, no mocks; every
wait polls a condition with a deadline.

The store's history is checked with an audit trigger the tests add to their own database
(tests/faults.py): "no two epochs do plan work at once" reads there as every plan write
carrying the epoch of the last takeover before it, never an older one.
"""

import json
import os
import signal
import subprocess
import time

import anyio
import asyncpg
import msgspec
import nats
import pytest
from faults import (
    DEADLINE,
    Verbs,
    assert_kv_epochs_rise,
    assert_one_epoch_at_a_time,
    finished,
    holder_above,
    install_audit,
    plan_of,
    query,
    steps,
    waiting_in,
)
from helpers import (
    MESH,
    ask,
    assert_tier_order,
    await_until,
    exited,
    fleet_up,
    held_status,
    js,
    mesh_cli,
    ok_json,
    standing_by,
)
from module_folders import gated_module, write_module

from mesh import wire
from mesh.model import DeclarationReply
from mesh.modules.compose import encode, merge
from mesh.store import seats

KILLS = 20
CONTROLLERS = ("ctl-0", "ctl-1")  # the holder, then the standby (more are started as kills go)


# --- SIGKILL --------------------------------------------------------------------------------------


async def test_the_holder_killed_twenty_times_during_a_plan(
    nc, cli, database_url, start_controller, start_fleet, tmp_path
) -> None:
    """Kill the holder 20 times while a three-tier plan rolls (each tier waits for a marker file,
    made after a third of the kills); a replacement starts after each kill so a standby exists.
    Every `status` is answered within its deadline, the plan finishes, and the store shows one
    epoch at a time doing plan work."""
    controllers = (await start_fleet(hosts=3, controllers=CONTROLLERS)).controllers
    roots = tmp_path / "hosts"
    await install_audit(database_url)
    source = gated_module(tmp_path / "m", marker="ready", deadline="60s")
    plan_id = ok_json(cli("push", str(source), "--json"))["plan"]
    markers = {KILLS // 3: "node-1", 2 * KILLS // 3: "node-2"}  # node-3's after the last kill

    async def wrote_plan_steps(epoch: int) -> bool:
        rows = await query(
            database_url,
            "SELECT 1 FROM fault_audit WHERE tbl = 'plan_steps' AND epoch = $1 LIMIT 1",
            epoch,
        )
        return bool(rows)

    killed: dict[str, int] = {}  # instance -> its epoch when killed
    newest = "ctl-1"
    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        for kill in range(KILLS):
            if kill in markers:
                (roots / markers[kill] / "ready").write_text("")

            async def ready_to_kill(kill=kill, newest=newest):
                """A live holder, the newest controller standing by, and (every other time)
                the holder has written plan steps under its epoch; else kill mid-takeover."""
                s = await standing_by(nc, newest)
                if s is None or s["seat"]["holder"] in killed:
                    return None
                if kill % 2 and not await wrote_plan_steps(s["seat"]["epoch"]):
                    return None
                return s

            s = await await_until(ready_to_kill, within=30, what=f"a holder to kill ({kill + 1})")
            plan = await plan_of(nc, plan_id)
            assert plan is not None and plan["state"] in ("pending", "rolling"), plan
            holder = s["seat"]["holder"]
            killed[holder] = s["seat"]["epoch"]
            os.kill(s["seat"]["pid"], signal.SIGKILL)
            assert controllers[holder].wait(timeout=10) == -signal.SIGKILL
            newest = f"ctl-{kill + 2}"
            controllers[newest] = start_controller(newest)

        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id, within=60)
        await verbs.answers_after("answers after the plan")
        stop.set()

    print(f"{verbs.answered} status answered; the slowest took {verbs.worst:.2f}s")
    assert verbs.failures == [], verbs.failures[:5]
    assert plan["state"] == "done", plan
    assert steps(plan) == {"node-1": "done", "node-2": "done", "node-3": "done"}
    assert_tier_order(plan)

    # Answers never come from an older epoch than one already answered (no two holders answer).
    for seen in verbs.answers:
        epochs = [epoch for _, _, epoch in seen]
        assert epochs == sorted(epochs), "an answer from an older holder came after a newer one"
    holders = {holder for seen in verbs.answers for _, holder, _ in seen}
    assert len(holders) > KILLS // 2, holders  # the client saw the seat move, many times

    wrote = await assert_one_epoch_at_a_time(database_url)
    assert len(wrote) > KILLS // 2, f"plan steps written by epochs {sorted(wrote)} only"
    taken = await query(
        database_url, "SELECT epoch FROM events WHERE kind = 'seat.taken' ORDER BY id"
    )
    assert len(taken) == KILLS + 1  # ctl-0's, then one per kill
    await assert_kv_epochs_rise(nc)


# --- SIGSTOP --------------------------------------------------------------------------------------


async def test_a_paused_holder_loses_the_seat_and_its_late_writes_are_refused(
    nc, cli, database_url, start_fleet, tmp_path
) -> None:
    """SIGSTOP the holder while tier 1 waits: the standby takes the seat while it is still
    paused (its lock's session is ended by the server's idle_session_timeout) and finishes the
    plan. SIGCONT: the old holder steps down without writing under its old epoch, and a host
    ignores a declaration published under that epoch."""
    fleet = await start_fleet(hosts=2, controllers=CONTROLLERS)
    controllers = fleet.controllers
    roots = tmp_path / "hosts"
    old = controllers["ctl-0"]
    await install_audit(database_url)
    source = gated_module(tmp_path / "m", marker="ready", deadline="60s")
    plan_id = ok_json(cli("push", str(source), "--json"))["plan"]
    (roots / "node-1" / "ready").write_text("")

    async def tier_1_waits():
        p = await plan_of(nc, plan_id)
        return p if p and steps(p) == {"node-1": "done", "node-2": "applying"} else None

    await await_until(tier_1_waits, within=30, what="tier 1 applying")
    before = await held_status(nc)
    assert before is not None and before["seat"]["holder"] == "ctl-0"
    epoch = before["seat"]["epoch"]

    verbs, stop = Verbs(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(verbs.run, nc, stop)
        os.kill(old.pid, signal.SIGSTOP)
        paused = time.monotonic()
        try:

            async def taken_over():
                s = await held_status(nc)
                return s if s and s["seat"]["holder"] == "ctl-1" else None

            after = await await_until(taken_over, within=30, what="ctl-1 to take the seat")
            print(f"the standby held the seat {time.monotonic() - paused:.1f}s after SIGSTOP")
            assert after["seat"]["epoch"] > epoch
            assert old.poll() is None  # still there, still paused

            # The plan goes on under the new holder while the old one sleeps.
            (roots / "node-2" / "ready").write_text("")

            seen: list[dict] = []

            async def done():
                p = await plan_of(nc, plan_id)
                seen[:] = [p] if p else seen
                return p if p and p["state"] == "done" else None

            try:
                await await_until(done, within=30, what="the plan to finish under ctl-1")
            except pytest.fail.Exception:
                new, host = controllers["ctl-1"].log_path, fleet.hosts["node-2"].log_path
                print("the plan seen last:", seen, "\nctl-1:", new.read_text()[-4000:])
                print("node-2:", host.read_text()[-4000:])
                raise
        finally:
            os.kill(old.pid, signal.SIGCONT)
        woke = time.monotonic()

        # Woken, the old holder finds its session gone and steps down.
        code = await await_until(lambda: exited(old), within=20, what="ctl-0 to step down")
        gone = time.monotonic()
        await verbs.answers_after("answers after ctl-0 stepped down")
        stop.set()

    print(f"{verbs.answered} status answered, {len(verbs.failures)} not within {DEADLINE:g}s;"
          f" the slowest took {verbs.worst:.2f}s")  # fmt: skip
    log = old.log_path.read_text()
    assert code == (1,), log[-2000:]
    assert "the seat's store session failed" in log or "this controller holds" in log, log
    assert "Traceback" not in log, log[-3000:]
    # While paused, the old holder stays in the verb queue group until the nats-server drops
    # it for not answering its pings, so a request may miss its deadline then; once it is
    # gone, every request is answered.
    late = [why for started, why in verbs.failures if started >= gone]
    assert late == [], late[:5]
    stale = [
        (round(t - woke, 2), holder, e)
        for seen in verbs.answers
        for t, holder, e in seen
        if t > woke and e == epoch
    ]
    assert stale == [], f"the paused holder answered after it woke: {stale[:5]}"

    # The store: nothing written under the old epoch after the new one took the seat. (Woken,
    # the old holder usually finds its session gone before its planner tries a write; a write
    # it tries is refused by the fence below, which every plan write goes through.)
    wrote = await assert_one_epoch_at_a_time(database_url)
    assert wrote >= {epoch, after["seat"]["epoch"]}, wrote
    conn = await asyncpg.connect(database_url)
    try:
        with pytest.raises(seats.Fenced, match=f"this controller holds {epoch}\\b"):
            async with conn.transaction():
                await seats.fence(conn, epoch=epoch)
                await conn.execute("UPDATE plan_steps SET state = 'failed', epoch = $1", epoch)
        states = await conn.fetch("SELECT state FROM plan_steps")
    finally:
        await conn.close()
    assert [r["state"] for r in states] == ["done", "done"]
    await assert_kv_epochs_rise(nc)
    kv = await js(nc).key_value("mesh-declarations")
    for machine in ("node-1", "node-2"):  # republished by the new holder, under its epoch
        assert json.loads((await kv.get(machine)).value)["epoch"] == after["seat"]["epoch"]

    # A declaration published late under the old epoch (here: the old holder taking node-1's
    # process away) is ignored by the host, which says so.
    nodes = {n["name"]: n for n in (await ask(nc, "mesh.ctl.nodes"))["nodes"]}
    applied = nodes["node-1"]["digest_applied"]
    running = {p["name"]: p["pid"] for p in (await ask(nc, "mesh.host.node-1.status"))["processes"]}
    assert list(running) == ["gated"], running
    body, digest = encode(merge("node-1", []))
    late = DeclarationReply(
        machine="node-1", digest=digest, epoch=epoch, declaration=msgspec.Raw(body)
    )
    events = await nc.subscribe("mesh.event.node-1.applied")
    await kv.put("node-1", wire.encode(late))
    report = json.loads((await events.next_msg(timeout=15)).data)
    assert (report["ok"], report["step"], report["digest"]) == (False, "fence", digest), report
    assert f"epoch {epoch} is older" in report["error"]
    host = await ask(nc, "mesh.host.node-1.status")
    assert host["applied"] == applied
    # Its process kept, the very same one (its health is its check's, which a loaded machine
    # can make miss a beat: not what this asserts).
    assert [(p["name"], p["pid"], p["state"]) for p in host["processes"]] == [
        ("gated", running["gated"], "running")
    ], host["processes"]


# --- restarts -------------------------------------------------------------------------------------


async def test_the_mesh_recovers_from_restarts_of_postgres_and_nats_during_a_plan(
    servers, procs, tmp_path
) -> None:
    """Tier 1 waits: restart PostgreSQL (every session ends: the holder steps down, the standby
    reconnects and takes the seat). Tier 2 waits: kill and restart the nats-server. Each time a
    holder answers again and the plan goes on to the end."""
    env = {"MESH_NATS_URL": servers.nats_url, "MESH_DATABASE_URL": servers.database_url}
    roots = tmp_path / "hosts"

    def controller(name: str) -> subprocess.Popen:
        return procs.start(name, [*MESH, "controller", "run", "--instance", name], env=env)

    def host(name: str, *flags: str) -> subprocess.Popen:
        argv = [*MESH, "host", "run", "--name", name, "--root", str(roots / name), *flags,
                "--beat", "0.5"]  # fmt: skip
        return procs.start(name, argv, env={"MESH_NATS_URL": servers.nats_url})

    nc = await nats.connect(servers.nats_url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    try:
        fleet = await fleet_up(nc, start_controller=controller, start_host=host, hosts=3,
                               controllers=CONTROLLERS)  # fmt: skip
        controllers = fleet.controllers
        await install_audit(servers.database_url)
        source = gated_module(tmp_path / "m", marker="ready", deadline="60s")
        pushed = mesh_cli("push", str(source), "--json", nats_url=servers.nats_url, answer=60,
                          timeout=180)  # fmt: skip
        plan_id = ok_json(pushed)["plan"]
        (roots / "node-1" / "ready").write_text("")
        await waiting_in(nc, plan_id, "node-2", within=30)
        before = await held_status(nc)
        assert before is not None

        # 1. PostgreSQL restarts.
        servers.stop_postgres()
        await servers.start_postgres()

        after_pg = await holder_above(nc, before["seat"]["epoch"], within=30)
        print(f"after PostgreSQL restarted: {after_pg['seat']['holder']} holds")
        old = controllers[before["seat"]["holder"]]
        code = await await_until(lambda: exited(old), within=15, what="the old holder to stop")
        assert code == (1,)
        log = old.log_path.read_text()
        # Its own ping finds the session gone, or the bus shows the new holder's higher epoch
        # first (services/controller/seat/epochs.py): either way it stops.
        assert "the seat's store session failed" in log or "above ours" in log, log[-2000:]
        controllers["ctl-2"] = controller("ctl-2")  # what its supervisor would do
        (roots / "node-2" / "ready").write_text("")
        await waiting_in(nc, plan_id, "node-3", within=30)

        async def applied(machine: str):
            h = await ask(nc, f"mesh.host.{machine}.status", timeout=1)
            p = await plan_of(nc, plan_id)
            step = next(s for s in p["steps"] if s["machine"] == machine) if p else None
            return h if h and step and h["applied"] == step["after"] else None

        await await_until(lambda: applied("node-3"), within=30, what="node-3 applied")

        # 2. The nats-server crashes and comes back on the same port, with its data.
        servers.kill_nats()
        await servers.start_nats()
        (roots / "node-3" / "ready").write_text("")
        plan = await finished(nc, plan_id, within=60)
        assert plan["state"] == "done", plan
        assert steps(plan) == {"node-1": "done", "node-2": "done", "node-3": "done"}
        assert_tier_order(plan)
        s = await held_status(nc)
        assert s is not None and s["nodes"]["up"] == 3
        print(f"after nats-server restarted: {s['seat']['holder']} holds, epoch "
              f"{s['seat']['epoch']}")  # fmt: skip
        await assert_one_epoch_at_a_time(servers.database_url)
        await assert_kv_epochs_rise(nc)
    finally:
        await nc.close()


async def test_a_removed_declarations_bucket_is_made_again_and_hosts_take_the_next_change(
    start_fleet, nc, nats_url, tmp_path
) -> None:
    """The declarations' bucket removed under a running mesh (`nats stream rm`, or a server
    that lost its store): the holder makes it again and puts every declaration again, and the
    host, whose last value had a higher stream sequence than any in the new bucket, still takes
    the next change (services/host/watch.py)."""

    async def push(version: int) -> dict:
        source = write_module(
            tmp_path / f"files-v{version}",
            '[module]\nname = "files"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
            "[assign]\ntiers = [0, 1, 2]\n",
            files={"src/version.txt": f"{version}\n"},
        )
        done = mesh_cli("--json", "push", str(source), nats_url=nats_url, answer=60, timeout=120)
        plan = await finished(nc, ok_json(done)["plan"], within=60)
        assert plan["state"] == "done", plan
        return plan

    async def put_again() -> int | None:
        try:
            info = await nc.jsm().stream_info("KV_mesh-declarations")
        except nats.js.errors.NotFoundError:
            return None  # not made again yet
        return info.state.last_seq if info.state.messages else None

    fleet = await start_fleet(hosts=1)
    for version in (1, 2, 3):  # the host's last value: the bucket's third put or later
        await push(version)
    before = (await nc.jsm().stream_info("KV_mesh-declarations")).state.last_seq

    await nc.jsm().delete_stream("KV_mesh-declarations")
    after = await await_until(put_again, within=30, what="node-1's declaration put again")
    assert after < before  # a bucket made again: its sequences start over
    log = fleet.controllers["ctl-a"].log_path.read_text()  # type: ignore[attr-defined]
    assert "the declarations' bucket is gone" in log or "bucket was made again" in log, log

    plan = await push(4)  # done only once node-1 applied it
    assert steps(plan) == {"node-1": "done"}
    s = await ask(nc, "mesh.host.node-1.status", timeout=2)
    assert s is not None and s["applied"] == plan["steps"][0]["after"]
