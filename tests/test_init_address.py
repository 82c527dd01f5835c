"""`mesh init --address`: what it refuses, before anything is made, and what a given address
makes the servers listen on and name (programs/addresses.py). No server is started here: the
meshes made with an address are tests/test_init.py's."""

import os
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import MESH

from programs.addresses import LOOPBACK_ONLY, AddressError, served

# its hosts deploy services/controller (helpers.seeds_container)
pytestmark = pytest.mark.deploys_controller

NOT_OURS = "203.0.113.7"  # TEST-NET-3 (RFC 5737): no machine's own address


def _bindable(ip: str) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.bind((ip, 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("999.1.1.1", "--address '999.1.1.1': neither an IP address nor a DNS name"),
        ("bad_name!", "--address 'bad_name!': neither an IP address nor a DNS name"),
        (NOT_OURS, f"--address {NOT_OURS}: not an address of this machine (nats-server could "
                   "not listen on it: "),
        ("0.0.0.0", "--address 0.0.0.0: not an address other machines can reach"),
    ],
)  # fmt: skip
def test_a_bad_address_is_refused_in_one_line_and_nothing_is_made(
    tmp_path: Path, address: str, said: str
) -> None:
    if address == NOT_OURS and _bindable(NOT_OURS):
        pytest.skip(f"{NOT_OURS} is an address of this machine")
    folder = tmp_path / "mesh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    done = subprocess.run(
        [*MESH, "init", "--dir", str(folder), "--port", "0", "--address", "127.0.0.1",
         "--address", address],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"mesh: error: {said}"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""
    assert not folder.exists()  # refused before anything was made


def test_without_an_address_the_servers_stay_on_loopback() -> None:
    assert served([]) == LOOPBACK_ONLY
    assert LOOPBACK_ONLY.listen == "127.0.0.1" and LOOPBACK_ONLY.fronts == ["127.0.0.1"]
    assert LOOPBACK_ONLY.certified == ["127.0.0.1", "localhost"]
    assert served(["127.0.0.1"]).listen == "127.0.0.1"  # loopback given: nothing wider


def test_an_address_is_served_beside_loopback() -> None:
    # nats-server takes one listen: the wildcard serves loopback and the address; the store's
    # front takes several: loopback and the address alone. URLs name the address.
    if not _bindable("127.0.0.2"):
        pytest.skip("127.0.0.2 cannot be bound here")
    where = served(["127.0.0.2", "localhost", "127.0.0.2"])
    assert where.given == ["127.0.0.2", "localhost"]
    assert where.listen == "0.0.0.0"
    assert where.fronts == ["127.0.0.1", "127.0.0.2"]
    assert where.url_host == "127.0.0.2"
    assert where.certified == ["127.0.0.1", "localhost", "127.0.0.2"]


def test_an_ipv6_address_is_listened_on_dual_stack() -> None:
    if not _bindable("::1"):
        pytest.skip("no IPv6 loopback here")
    where = served(["::1"])
    assert where.listen == "[::]" and where.url_host == "[::1]"
    assert where.fronts == ["127.0.0.1", "::1"]


def test_a_name_must_resolve_here() -> None:
    with pytest.raises(AddressError, match=r"--address nowhere\.invalid: does not resolve"):
        served(["nowhere.invalid"])  # .invalid never resolves (RFC 2606)
