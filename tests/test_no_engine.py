"""A machine with no container engine (most users' first): a host applies declarations without
containers as anywhere else, says in its facts that it has no engine, and refuses only a
declaration that has containers, in one line, keeping its processes.

Where an engine answers, the host under test runs in a private mount namespace with the
engine's socket hidden (tests/no_engine.py), so both kinds of machine are tested on either.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import MESH, ask, await_until, engine_answers, ok
from test_modules import EXAMPLE, SECRET, run

NO_ENGINE = Path(__file__).parent / "no_engine.py"
HIDDEN = [sys.executable, str(NO_ENGINE)]


def _without_engine() -> list[str]:
    """The prefix that starts a program where no engine answers ([] if none answers here)."""
    if not engine_answers():
        return []
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("an engine answers here and hiding it needs root and unshare")
    return ["unshare", "--mount", "--propagation", "private", "--", *HIDDEN]


@pytest.fixture
async def bare(nc, procs, nats_url, tmp_path, start_controller):
    """A controller and node-1, a host that finds no container engine."""
    start_controller("ctl-a")
    procs.start(
        "node-1",
        [*_without_engine(), *MESH, "host", "run", "--name", "node-1", "--tier", "0",
         "--root", str(tmp_path / "hosts" / "node-1"), "--beat", "1"],
        env={"MESH_NATS_URL": nats_url},
    )  # fmt: skip

    async def up():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["nodes"]["up"] == 1 else None

    await await_until(up, within=30, what="node-1 up")


async def _node(nc) -> dict:
    reply = await ask(nc, "mesh.ctl.nodes")
    assert reply is not None, "no controller answered nodes"
    return next(n for n in reply["nodes"] if n["name"] == "node-1")


async def _healthy_hello(nc) -> dict | None:
    node = await _node(nc)
    hello = [p for p in node["processes"] if p["name"] == "hello"]
    return hello[0] if hello and hello[0]["state"] == "running" and hello[0]["healthy"] else None


async def test_a_host_without_an_engine_runs_the_example_and_says_it_has_none(bare, nc, nats_url):
    node = await _node(nc)
    assert node["facts"]["container_engine"] == ""
    shown = ok(run(nats_url, "nodes"))
    assert "no containers" in shown, shown

    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    ok(run(nats_url, "assign", "hello", "node-1", "--wait"))  # was: containers: AssertionError
    hello = await await_until(lambda: _healthy_hello(nc), within=60, what="hello healthy")
    node = await _node(nc)
    assert node["digest_applied"] == node["digest_wanted"]
    assert node["apply_error"] is None
    assert hello["pid"]


async def test_a_declared_container_fails_in_one_line_and_the_processes_stay(
    bare, nc, nats_url, tmp_path
):
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    ok(run(nats_url, "assign", "hello", "node-1", "--wait"))
    before = await await_until(lambda: _healthy_hello(nc), within=60, what="hello healthy")

    module = tmp_path / "cache"
    module.mkdir()
    (module / "module.toml").write_text(
        '[module]\nname = "cache"\n[container.mesh-test-cache]\nimage = "busybox:1"\n'
        '[rollout]\ndeadline = "60s"\n'
    )
    ok(run(nats_url, "push", str(module)))
    failed = run(nats_url, "assign", "cache", "node-1", "--wait")
    assert failed.returncode == 1, failed.stdout
    assert (
        "machine node-1: containers: no container engine answers at unix:///var/run/docker.sock"
        in failed.stderr
    ), failed.stderr
    assert "Traceback" not in failed.stderr

    # The revert gave node-1 its old declaration back; hello ran throughout, the same process.
    plan = json.loads(ok(run(nats_url, "--json", "plan")))
    assert max(plan["plans"], key=lambda p: p["id"])["state"] == "reverted", plan
    after = await await_until(lambda: _healthy_hello(nc), within=60, what="hello healthy")
    assert after["pid"] == before["pid"]
    node = await _node(nc)
    assert node["digest_applied"] == node["digest_wanted"]
