"""A mesh of two real machines with systemd as PID 1 (tests/machines.py: containers of the
`mesh-machine` image, one per machine, on a network of their own): `mesh init --address a` on
`a`, `mesh token create` there, `mesh join TOKEN` on `b`, whose host agent is installed as a
unit, enabled and started by systemd. The units really start at boot: `b` rebooted comes back up
in `a`'s `mesh nodes`, and `a` rebooted (its servers, store, host and controller all units)
answers `mesh status` and `mesh nodes` again with `b` placed as it was. Skips, saying why,
without root or a Docker Engine."""

import json

import pytest
from helpers import wait_until
from machines import Machines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # images/build's first run included


def _node(machines: Machines, name: str, *, up: bool) -> dict | None:
    done = machines.mesh("a", "nodes", "--json", check=False, timeout=60)
    if done.returncode != 0:
        return None
    found = [n for n in json.loads(done.stdout)["nodes"] if n["name"] == name]
    return found[0] if found and found[0]["up"] is up else None


def test_a_machine_joins_under_systemd_and_both_come_back_after_a_reboot(
    machines: Machines,
) -> None:
    machines.add("a", "b")
    machines.run("a", "mesh", "init", "--address", "a", timeout=600)
    token = machines.mesh("a", "token", "create", "--tier", "1", "--label", "zone=b")
    joined = machines.run("b", "mesh", "join", token.stdout.strip(), "--json", timeout=300)
    state = json.loads(joined.stdout)
    assert (state["name"], state["unit"]) == ("b", "mesh-host-b.service"), state
    enabled = machines.run("b", "systemctl", "is-enabled", "mesh-host-b.service")
    assert enabled.stdout.strip() == "enabled"
    node = wait_until(lambda: _node(machines, "b", up=True), within=60, what="b up in a's nodes")
    assert isinstance(node, dict) and (node["tier"], node["labels"]) == (1, {"zone": "b"})

    assert machines.reboot("b"), machines.report()  # its unit starts it at boot
    wait_until(lambda: _node(machines, "b", up=True), within=120, what="b up after its reboot")
    active = machines.run("b", "systemctl", "is-active", "mesh-host-b.service", check=False)
    assert active.stdout.strip() == "active"

    assert machines.reboot("a"), machines.report()  # the mesh's every piece, from its units
    status = wait_until(
        lambda: (lambda d: json.loads(d.stdout) if d.returncode == 0 else None)(
            machines.mesh("a", "status", "--json", check=False, timeout=60)
        ),
        within=180, what="a's controller holding the seat again",
    )  # fmt: skip
    assert isinstance(status, dict) and status["seat"]["holder"], status
    node = wait_until(lambda: _node(machines, "b", up=True), within=120,
                      what="b up in a's nodes after a's reboot")  # fmt: skip
    assert isinstance(node, dict) and (node["tier"], node["labels"]) == (1, {"zone": "b"})
