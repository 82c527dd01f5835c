"""A mesh on one machine and a machine that joins it from another, each in a network namespace
of its own (tests/netns.py: its own address on a switch, nothing of the host's network): `mesh
init --address` on `a`, `mesh token create` there, `mesh join` on `b` with nothing of `a` but the
token. `b` reaches `a` only through the switch, checks the CA it presents against the token,
and its host comes up in `a`'s `mesh nodes`; cut off at the switch, it goes down, and comes back
up once its link is back (the credentials it was given are all it needs to reconnect)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import MESH, env_file, wait_until
from netns import Network, network, unavailable

pytestmark = [
    pytest.mark.skipif(bool(unavailable()), reason=unavailable() or ""),
    pytest.mark.deploys_controller,  # hosts deploy services/controller (helpers.seeds_container)
]


def _run(net: Network, member: str, argv: list[str], *, env: dict[str, str],
         timeout: float = 180) -> subprocess.CompletedProcess:  # fmt: skip
    return subprocess.run(net.argv(member, argv), capture_output=True, text=True, env=env,
                          timeout=timeout)  # fmt: skip


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"{done.args[-8:]}: {done.stderr}{done.stdout}"
    return done.stdout


def test_a_machine_joins_a_mesh_on_another_machine(made: Path, open_dir: Path) -> None:
    bare = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    with network(["a", "b"]) as net:
        a, b = net.address("a"), net.address("b")
        _ok(_run(net, "a", [*MESH, "init", "--dir", str(made), "--address", a, "--port", "0",
                            "--print-units"], env=bare))  # fmt: skip
        env = {**bare, **env_file(made)}
        assert f"tls://{a}:" in env["MESH_NATS_URL"]
        token = _ok(_run(net, "a", [*MESH, "token", "create", "--label", "site=b"],
                         env=env)).strip()  # fmt: skip

        folder = open_dir / "b"
        done = _run(net, "b", [*MESH, "join", token, "--name", "b-1", "--dir", str(folder),
                               "--root", str(folder / "host"), "--json"], env=bare)  # fmt: skip
        joined = json.loads(_ok(done))
        assert (joined["name"], joined["labels"]) == ("b-1", {"site": "b"}), joined
        assert "the servers present the CA the token names" in done.stderr
        peers = net.peers("b", int(env["MESH_NATS_URL"].rsplit(":", 1)[1]))
        assert peers == {a}, peers  # b's host reaches a's server, across the switch

        def node(up: bool) -> dict | None:
            listed = _run(net, "a", [*MESH, "nodes", "--json"], env=env, timeout=30)
            if listed.returncode != 0:
                return None
            found = [n for n in json.loads(listed.stdout)["nodes"] if n["name"] == "b-1"]
            return found[0] if found and found[0]["up"] is up else None

        seen = wait_until(lambda: node(True), within=60, what="b-1 up in a's nodes")
        assert isinstance(seen, dict) and seen["labels"] == {"site": "b"}
        assert b != a
        net.cut("b")  # a pulled cable: b's beats stop reaching a
        wait_until(lambda: node(False), within=60, what="b-1 down while cut off")
        net.restore("b")
        wait_until(lambda: node(True), within=90, what="b-1 up again once its link is back")
