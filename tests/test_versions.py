"""Which mesh each process runs: a host agent's in `mesh nodes`, the holder's and each standby's
in `mesh status` (mesh/version.py: `sha256:<hex>` from a mesh bundle, `installed` otherwise)."""

import io
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from helpers import ask, await_until, mesh_cli
from rich.console import Console

from mesh import version
from mesh.model import Node, NodeCounts, NodesReply, SeatInfo, Standby, StatusReply
from programs.cli import render

DIGEST = "1a2b3c4d5e6f" + "0" * 52
FACTS = {"os": "linux", "arch": "x86_64", "cpus": 1, "memory": 1, "mesh_version": "0"}


# --- mesh/version.py ---------------------------------------------------------------------------


def test_a_package_in_a_mesh_bundle_folder_is_that_bundle(tmp_path: Path) -> None:
    package = tmp_path / "bundles" / f"mesh-sha256-{DIGEST}" / "mesh" / "__init__.py"
    package.parent.mkdir(parents=True)
    package.touch()
    assert version.of(package) == f"sha256:{DIGEST}"


@pytest.mark.parametrize(
    "folder",
    [
        "checkout",
        f"mesh-sha256-{DIGEST[:-1]}",  # a digest too short
        f"mesh-sha256-{DIGEST.upper()}",  # not how a host names a bundle
        f"app-sha256-{DIGEST}",  # another kind's bundle
    ],
)
def test_a_package_anywhere_else_is_installed(tmp_path: Path, folder: str) -> None:
    package = tmp_path / folder / "mesh" / "__init__.py"
    package.parent.mkdir(parents=True)
    package.touch()
    assert version.of(package) == version.INSTALLED == "installed"


def test_the_tests_run_the_installed_mesh() -> None:
    assert version.running() == "installed"


def test_short_keeps_tables_readable() -> None:
    assert version.short(f"sha256:{DIGEST}") == "sha256:1a2b3c4d5e6f"
    assert version.short("installed") == "installed"


# --- the tables --------------------------------------------------------------------------------


def _printed(show, reply) -> str:
    out = io.StringIO()
    show(Console(file=out, width=250, color_system=None), reply)
    return out.getvalue()


def test_nodes_table_has_a_version_column() -> None:
    def node(name: str, v: str | None) -> Node:
        return Node(name=name, tier=0, labels={}, up=True, last_seen=None, facts=None,
                    processes=[], version=v)  # fmt: skip

    nodes = [node("node-1", f"sha256:{DIGEST}"), node("node-2", "installed"), node("old", None)]
    text = _printed(render.nodes, NodesReply(nodes=nodes))
    header, *rows = text.splitlines()
    assert "VERSION" in header.split()
    assert "sha256:1a2b3c4d5e6f" in rows[0] and DIGEST not in rows[0]
    assert "installed" in rows[1]
    assert "?" in rows[2].split()  # an agent that did not say


def test_status_names_the_holders_and_standbys_versions() -> None:
    now = datetime.now(UTC)
    text = _printed(
        render.status,
        StatusReply(
            seat=SeatInfo(holder="ctl-a", pid=1, host="vm", epoch=2, since=now,
                          version=f"sha256:{DIGEST}"),
            standbys=[Standby(instance="ctl-b", pid=2, host="vm", since=now, version="installed"),
                      Standby(instance="ctl-c", pid=3, host="vm", since=now)],
            nodes=NodeCounts(total=0, up=0, down=0),
        ),
    )  # fmt: skip
    assert "mesh sha256:1a2b3c4d5e6f" in text
    assert "ctl-b (pid 2, mesh installed)" in text
    assert "ctl-c (pid 3, mesh ?)" in text


# --- a real mesh -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_nodes_and_status_say_which_mesh_runs(
    nc, nats_url, start_controller, start_host
) -> None:
    start_controller("ctl-a")
    start_controller("ctl-b")
    start_host("node-1", "--tier", "0")

    async def ready():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["standbys"] and s["nodes"]["up"] == 1 else None

    await await_until(ready, within=30, what="two controllers and a host")

    done = mesh_cli("nodes", "--json", nats_url=nats_url)
    assert done.returncode == 0, done.stderr
    [node] = json.loads(done.stdout)["nodes"]
    assert node["name"] == "node-1"
    assert node["version"] == "installed"

    done = mesh_cli("status", "--json", nats_url=nats_url)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["seat"]["version"] == "installed"
    assert [s["version"] for s in status["standbys"]] == ["installed"]

    host = await ask(nc, "mesh.host.node-1.status")
    assert host["version"] == "installed"

    table = mesh_cli("nodes", nats_url=nats_url)
    assert table.returncode == 0, table.stderr
    assert "VERSION" in table.stdout and "installed" in table.stdout
    human = mesh_cli("status", nats_url=nats_url)
    assert human.returncode == 0, human.stderr
    assert human.stdout.count("mesh installed") == 2  # the holder and its standby

    # An agent of a mesh from before versions says none: unknown, not a guess.
    body = {"name": "old-1", "tier": 1, "labels": {}, "facts": FACTS, "beat_interval": 1, "pid": 1}
    reply = await ask(nc, "mesh.ctl.host.old-1.register", body)
    assert reply and "error" not in reply, reply
    nodes = (await ask(nc, "mesh.ctl.nodes"))["nodes"]
    assert {n["name"]: n["version"] for n in nodes} == {"node-1": "installed", "old-1": None}

    # What an agent says of itself is bounded like its other words.
    long = await ask(nc, "mesh.ctl.host.old-1.register", {**body, "version": "x" * 81})
    assert long["error"]["code"] == "bad_request"
    assert "$.version" in long["error"]["message"]
