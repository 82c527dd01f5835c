"""MESH_LOOP: the event loop every piece runs on (mesh/loop.py), asyncio by default."""

import os
import subprocess
from pathlib import Path

import pytest
from helpers import MESH, await_until, mesh_cli, ok_json


def _loaded(pid: int, library: str) -> bool:
    """Whether process `pid` has mapped a shared object whose path names `library`."""
    return library in Path(f"/proc/{pid}/maps").read_text()


def test_an_unknown_loop_is_one_line_naming_the_variable(nats_url) -> None:
    done = subprocess.run(
        [*MESH, "status"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "MESH_LOOP": "tokio", "MESH_NATS_URL": nats_url},
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip() == "mesh: error: MESH_LOOP='tokio': choose one of asyncio, uvloop"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_controller_answers_on_the_loop_chosen(procs, nats_url, database_url, loop) -> None:
    """The controller and the command line run on the loop MESH_LOOP names, and only then on
    uvloop: its library is mapped in the controller's process for uvloop alone."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    env = {"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": database_url, "MESH_LOOP": loop}
    ctl = procs.start("ctl-a", [*MESH, "controller", "run", "--instance", "ctl-a"], env=env)

    async def holds():
        done = mesh_cli("--json", "status", nats_url=nats_url, answer=2, timeout=60)
        return done.returncode == 0 and ok_json(done)["seat"] is not None

    await await_until(holds, within=60, what="the controller holds the seat")
    assert _loaded(ctl.pid, "uvloop") == (loop == "uvloop")


async def test_a_host_runs_on_asyncio_whatever_is_chosen(procs, nats_url, database_url, tmp_path):
    """A host starts processes as other accounts, which uvloop's subprocesses cannot: with one
    MESH_LOOP=uvloop for the whole machine, the controller runs on uvloop and the host on
    asyncio, saying so, and registers as ever."""
    pytest.importorskip("uvloop")
    env = {"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": database_url, "MESH_LOOP": "uvloop"}
    ctl = procs.start("ctl-a", [*MESH, "controller", "run", "--instance", "ctl-a"], env=env)
    host = procs.start(
        "node-1", [*MESH, "host", "run", "--name", "node-1", "--root", str(tmp_path / "node-1")],
        env=env,
    )  # fmt: skip

    async def registered():
        done = mesh_cli("--json", "nodes", nats_url=nats_url, answer=2, timeout=60)
        return done.returncode == 0 and [n["name"] for n in ok_json(done)["nodes"]] == ["node-1"]

    await await_until(registered, within=60, what="node-1 registered")
    assert _loaded(ctl.pid, "uvloop")
    assert not _loaded(host.pid, "uvloop")
    said = host.log_path.read_text()  # type: ignore[attr-defined]
    assert "host node-1: MESH_LOOP=uvloop set aside: this piece runs on asyncio" in said
