"""Following a plan (`--wait`) (issue 42, small ones): Ctrl-C stops the command, not the plan,
and the command says so and how to follow or cancel it; the line a plan ends with counts the
machines it changed apart from those it skipped."""

import os
import signal
import subprocess
from datetime import UTC, datetime, timedelta

from helpers import MESH, ask, await_until, ok_json
from module_folders import svc_module

from mesh.embedded import ports
from mesh.model import PlanReply, PlanSettings, PlanStep
from programs.cli.plans import render_end


async def test_ctrl_c_during_wait_says_the_plan_goes_on(host, nc, nats_url, cli, tmp_path):
    # "deaf" never listens: the step waits for its deadline (150 s) while the command follows.
    folder = svc_module(tmp_path / "svc", version="1", port=ports.free_port(), mode="deaf")
    env = {**os.environ, "MESH_NATS_URL": nats_url}
    waiting = subprocess.Popen([*MESH, "push", str(folder), "--wait"], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:

        async def rolling():
            s = await ask(nc, "mesh.ctl.status")
            return s["plan"] if s and s["plan"] and s["plan"]["state"] == "rolling" else None

        plan = await await_until(rolling, within=60, what="the push's plan to roll")
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        f"plan {plan['id']} goes on without this command: `mesh plan {plan['id']} --follow` "
        f"follows it again, `mesh plan cancel {plan['id']}` cancels it"
    ), err
    assert "Traceback" not in err
    still = ok_json(cli("plan", str(plan["id"]), "--json"))
    assert still["state"] == "rolling", still  # the plan went on
    ok_json(cli("plan", "cancel", str(plan["id"]), "--json"))


def test_a_plans_end_counts_the_machines_it_changed_apart_from_those_it_skipped(capsys) -> None:
    at = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    steps = [
        PlanStep(machine=m, tier=t, state=state, started=at, finished=at, error=None,
                 before=None, after="sha256:x")
        for m, t, state in (("node-1", 0, "skipped"), ("node-2", 1, "done"), ("node-3", 2, "done"))
    ]  # fmt: skip
    plan = PlanReply(
        id=5, state="done", trigger="push", subject="hello", by="admin", epoch=1, created=at,
        started=at, finished=at + timedelta(seconds=24), phase="forward", failure=None,
        settings=PlanSettings(), builds=[], tiers=[], steps=steps,
    )  # fmt: skip
    render_end(plan)
    assert capsys.readouterr().out.strip() == (
        "plan 5 done: 2 machine(s) in 24.0s, 1 skipped (node-1)"
    )
