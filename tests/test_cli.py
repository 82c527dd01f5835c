"""The command line as a user runs it: JSON shapes (docs/design.md), tables, and failures that are
one line on stderr with what to do, never a traceback."""

import json
import os
import subprocess

import pytest
from helpers import MESH, ask, await_until, mesh_cli

from mesh.embedded import ports


@pytest.fixture
async def small_mesh(nc, start_controller, start_host):
    start_controller("ctl-a")
    start_controller("ctl-b")
    start_host("node-1", "--tier", "0", "--label", "builder=true")
    start_host("node-2", "--tier", "1")

    async def ready():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["standbys"] and s["nodes"]["up"] == 2 else None

    await await_until(ready, within=30, what="two controllers and two hosts")


@pytest.mark.parametrize("where", ["before", "after"])
async def test_status_json_shape(small_mesh, nats_url, where) -> None:
    args = ["--json", "status"] if where == "before" else ["status", "--json"]
    done = mesh_cli(*args, nats_url=nats_url)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert set(status) >= {"seat", "standbys", "nodes", "plan"}
    assert set(status["seat"]) >= {"holder", "pid", "epoch", "since"}
    assert status["seat"]["holder"] in ("ctl-a", "ctl-b")
    assert status["seat"]["epoch"] >= 1
    assert len(status["standbys"]) == 1
    assert status["nodes"] == {"total": 2, "up": 2, "down": 0}
    assert status["plan"] is None


async def test_nodes_json_shape(small_mesh, nats_url) -> None:
    done = mesh_cli("nodes", "--json", nats_url=nats_url)
    assert done.returncode == 0, done.stderr
    nodes = json.loads(done.stdout)["nodes"]
    assert [(n["name"], n["tier"], n["up"]) for n in nodes] == [
        ("node-1", 0, True),
        ("node-2", 1, True),
    ]
    for n in nodes:
        assert set(n) >= {"name", "tier", "labels", "up", "last_seen", "facts", "processes"}
        assert set(n["facts"]) >= {"os", "arch", "cpus", "memory", "mesh_version"}
    assert nodes[0]["labels"] == {"builder": "true"}


async def test_human_output_names_the_holder_and_nodes(small_mesh, nats_url) -> None:
    status = mesh_cli("status", nats_url=nats_url)
    assert status.returncode == 0, status.stderr
    assert "held by ctl-" in status.stdout
    assert "2 total, 2 up, 0 down" in status.stdout
    nodes = mesh_cli("nodes", nats_url=nats_url)
    assert "node-1" in nodes.stdout and "node-2" in nodes.stdout
    assert "builder=true" in nodes.stdout


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_no_nats_at_all_says_which_url_and_what_to_run() -> None:
    url = f"nats://127.0.0.1:{ports.free_port()}"
    line = _one_line_error(mesh_cli("status", nats_url=url))
    assert url in line
    assert "mesh dev up" in line


def test_no_controller_says_which_url_after_retrying(nats_url) -> None:
    line = _one_line_error(mesh_cli("--json", "nodes", "--timeout", "1.5", nats_url=nats_url))
    assert nats_url in line
    assert "no controller answered" in line
    assert "mesh dev up" in line


async def test_client_retries_until_a_controller_appears(nats_url, start_controller) -> None:
    # The command starts first; the controller comes up while it retries "no responders".
    client = subprocess.Popen(
        [*MESH, "--json", "status", "--timeout", "30", "--nats-url", nats_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        start_controller("ctl-a")
        out, err = client.communicate(timeout=60)
    finally:
        client.kill()
    assert client.returncode == 0, err
    assert json.loads(out)["seat"]["holder"] == "ctl-a"


def test_usage_errors_are_one_line() -> None:
    done = subprocess.run([*MESH, "host", "run"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--name" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("output", [[], ["--json"]], ids=["table", "json"])
async def test_a_reader_gone_is_no_error(small_mesh, nats_url, output) -> None:
    """`mesh nodes | head -1`: the reader closes the pipe early; the command says nothing on
    stderr (no "internal error: BrokenPipeError", no "Exception ignored" at exit) and exits 1,
    tables and JSON alike. The pipe's read end is closed before the command starts, so its
    first write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([*MESH, "nodes", *output, "--nats-url", nats_url], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (1, "")
