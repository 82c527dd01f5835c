"""A machine with no container engine (most users' first): a host applies declarations without
containers as anywhere else, says in its facts that it has no engine, and refuses only a
declaration that has containers, in one line, keeping its processes.

Where an engine answers, the host under test runs in a private mount namespace with the
engine's socket hidden (tests/no_engine.py), so both kinds of machine are tested on either.
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import MESH, await_until, engine_answers, node_named, ok, ok_json
from module_folders import HELLO, HELLO_TOKEN, write_module

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
async def bare(procs, nats_url, tmp_path, start_fleet):
    """A controller and node-1, a host that finds no container engine."""
    hidden = _without_engine()

    def start_host(name: str, *flags: str):
        return procs.start(
            name,
            [*hidden, *MESH, "host", "run", "--name", name, *flags,
             "--root", str(tmp_path / "hosts" / name), "--beat", "1"],
            env={"MESH_NATS_URL": nats_url},
        )  # fmt: skip

    await start_fleet(hosts=1, start_host=start_host)


async def _node_1(nc) -> dict:
    """node-1 as `nodes` lists it, which it must."""
    node = await node_named(nc, "node-1")
    assert node is not None, "no controller answered nodes, or it did not list node-1"
    return node


async def _healthy_hello(nc) -> dict | None:
    node = await _node_1(nc)
    hello = [p for p in node["processes"] if p["name"] == "hello"]
    return hello[0] if hello and hello[0]["state"] == "running" and hello[0]["healthy"] else None


async def test_a_host_without_an_engine_runs_the_example_and_says_it_has_none(bare, nc, cli):
    node = await _node_1(nc)
    assert node["facts"]["container_engine"] == ""
    shown = ok(cli("nodes"))
    assert "no containers" in shown, shown

    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "node-1", "--wait"))  # was: containers: AssertionError
    hello = await await_until(lambda: _healthy_hello(nc), within=60, what="hello healthy")
    node = await _node_1(nc)
    assert node["digest_applied"] == node["digest_wanted"]
    assert node["apply_error"] is None
    assert hello["pid"]


async def test_a_declared_container_fails_in_one_line_and_the_processes_stay(
    bare, nc, tmp_path, cli
):
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "node-1", "--wait"))
    before = await await_until(lambda: _healthy_hello(nc), within=60, what="hello healthy")

    module = write_module(
        tmp_path / "cache",
        '[module]\nname = "cache"\n[container.mesh-test-cache]\nimage = "busybox:1"\n'
        '[rollout]\ndeadline = "60s"\n',
    )
    ok(cli("push", str(module)))
    failed = cli("assign", "cache", "node-1", "--wait")
    assert failed.returncode == 1, failed.stdout
    assert (
        "machine node-1: containers: no container engine answers at unix:///var/run/docker.sock"
        in failed.stderr
    ), failed.stderr
    assert "Traceback" not in failed.stderr

    # The revert gave node-1 its old declaration back; hello ran throughout, the same process.
    plan = ok_json(cli("--json", "plan"))
    assert max(plan["plans"], key=lambda p: p["id"])["state"] == "reverted", plan
    after = await await_until(lambda: _healthy_hello(nc), within=60, what="hello healthy")
    assert after["pid"] == before["pid"]
    node = await _node_1(nc)
    assert node["digest_applied"] == node["digest_wanted"]
