"""The harness of real machines (tests/machines.py) on real containers: two machines boot with
systemd as PID 1 to `running`; a unit enabled on one really starts at boot again after a reboot
(a new invocation, /run fresh, the disk kept); the other reaches it by name and by address over
TCP on the test's network; a machine powered off hard boots again; the mesh runs inside.
Skips, saying why, without root or a Docker Engine."""

import time

import pytest
from machines import Machines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # images/build's first run included

PORT = 8080
# A TCP server from the image (python3's), started by systemd at every boot
PROBE = f"""[Unit]
Description=tests/test_machines.py's probe: a TCP server started at boot
After=network.target

[Service]
ExecStart=/usr/bin/python3 -m http.server --bind 0.0.0.0 --directory /srv/probe {PORT}

[Install]
WantedBy=multi-user.target
"""
# An HTTP GET of argv[1], its body printed: run on the other machine
FETCH = "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=10).read().decode())"


def _fetch(machines: Machines, machine: str, url: str) -> str:
    return machines.run(machine, "python3", "-c", FETCH, url).stdout.strip()


def _state(machines: Machines, machine: str) -> str:
    argv = ["systemctl", "is-active", "mesh-probe.service"]
    return machines.run(machine, *argv, check=False).stdout.strip()


def _invocation(machines: Machines, machine: str) -> str:
    """The probe's invocation: a new one each time systemd starts it."""
    argv = ["systemctl", "show", "--property=InvocationID", "--value", "mesh-probe.service"]
    return machines.run(machine, *argv).stdout.strip()


def test_machines_boot_systemd_keep_enabled_units_across_reboots_and_reach_each_other(
    machines: Machines,
) -> None:
    began = time.monotonic()
    machines.add("a", "b")
    print(f"two machines booted to running in {time.monotonic() - began:.1f}s")
    for m in ("a", "b"):
        assert machines.run(m, "cat", "/proc/1/comm").stdout.strip() == "systemd"
        assert machines.run(m, "systemctl", "is-system-running").stdout.strip() == "running"
        assert machines.run(m, "hostname").stdout.strip() == m
    ids = {m: machines.run(m, "cat", "/etc/machine-id").stdout.strip() for m in ("a", "b")}
    assert len(set(ids.values())) == 2, "each machine has an id of its own"

    # The mesh is installed, for `docker exec` and for systemd's PATH alike
    assert "usage" in machines.run("a", "mesh", "--help").stdout.lower()
    assert "usage" in machines.mesh("b", "--help").stdout.lower()  # no mesh made there: no env
    assert machines.run("a", "ls", "-l", "/usr/local/bin/mesh").returncode == 0

    # A unit enabled (not started by hand): it must come from the boot
    machines.run("a", "mkdir", "-p", "/srv/probe")
    machines.write("a", "/srv/probe/hello", "kept on disk\n")
    machines.write("a", "/etc/systemd/system/mesh-probe.service", PROBE)
    machines.run("a", "systemctl", "daemon-reload")
    machines.run("a", "systemctl", "enable", "mesh-probe.service")
    assert _state(machines, "a") == "inactive"
    machines.run("a", "touch", "/run/gone-at-reboot")

    began = time.monotonic()
    assert machines.reboot("a"), "systemd shut down by itself, not killed"
    print(f"a rebooted to running in {time.monotonic() - began:.1f}s")
    assert machines.run("a", "cat", "/etc/machine-id").stdout.strip() == ids["a"], "kept"
    assert _state(machines, "a") == "active"
    first = _invocation(machines, "a")
    assert first
    assert machines.run("a", "test", "-e", "/run/gone-at-reboot", check=False).returncode == 1

    # b reaches a by name and by address over TCP; what a had on disk before the reboot is there
    assert _fetch(machines, "b", f"http://a:{PORT}/hello") == "kept on disk"
    assert _fetch(machines, "b", f"http://{machines.address('a')}:{PORT}/hello") == "kept on disk"

    # A power cut, then power on: the unit starts at this boot too, a new invocation
    assert not machines.stop("a", hard=True)
    assert not machines.is_running("a")
    machines.start("a")
    assert _state(machines, "a") == "active"
    assert _invocation(machines, "a") not in ("", first)
    assert _fetch(machines, "b", f"http://a:{PORT}/hello") == "kept on disk"

    copied = machines.copy_out("a", "/etc/systemd/system/mesh-probe.service")
    assert copied.read_text() == PROBE
