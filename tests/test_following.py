"""Following a plan (`--wait`) (issue 42, small ones): Ctrl-C stops the command, not the plan,
and the command says so and how to follow or cancel it; the line a plan ends with counts the
machines it changed apart from those it skipped; a step an ended plan never reached says so."""

import io
import os
import signal
import subprocess
from datetime import UTC, datetime, timedelta

from helpers import MESH, ask, await_until, ok_json
from module_folders import svc_module
from rich.console import Console

from mesh.embedded import ports
from mesh.model import PlanReply, PlanSettings, PlanStep
from programs.cli.plans import render, render_end


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


AT = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def _plan(state: str, steps: tuple[tuple[str, int, str], ...]) -> PlanReply:
    return PlanReply(
        id=5, state=state, trigger="push", subject="hello", by="admin", epoch=1, created=AT,
        started=AT, finished=AT + timedelta(seconds=24), phase="forward", failure=None,
        settings=PlanSettings(), builds=[], tiers=[],
        steps=[PlanStep(machine=m, tier=t, state=s, started=None if s == "pending" else AT,
                        finished=None if s == "pending" else AT, error=None, before=None,
                        after="sha256:x") for m, t, s in steps],
    )  # fmt: skip


def test_a_plans_end_counts_the_machines_it_changed_apart_from_those_it_skipped(capsys) -> None:
    render_end(_plan("done", (("node-1", 0, "skipped"), ("node-2", 1, "done"),
                              ("node-3", 2, "done"))))  # fmt: skip
    assert capsys.readouterr().out.strip() == (
        "plan 5 done: 2 machine(s) in 24.0s, 1 skipped (node-1)"
    )


def test_a_step_an_ended_plan_never_reached_is_said_so() -> None:
    out = io.StringIO()
    plan = _plan("reverted", (("node-1", 0, "reverted"), ("node-2", 1, "failed"),
                              ("node-3", 2, "pending")))  # fmt: skip
    render(Console(file=out, width=200, color_system=None), plan)
    row = next(line for line in out.getvalue().splitlines() if "node-3" in line)
    assert row.split()[:4] == ["2", "node-3", "not", "reached"], row
