"""Local ports for the embedded servers.

A free port is one the kernel hands out (bound to port 0), unless `MESH_PORTS` names a range
(`LOW-HIGH`): then one of that range that binds now, and not one this process handed out
already. Several meshes started at once on one machine (the test suite's workers) each get a
range of their own below the kernel's ephemeral ports (ip_local_port_range), so a port chosen
for a server is neither taken by another's meanwhile nor by an outgoing connection's local end
before the server binds it.
"""

import os
import random
import socket

from mesh.errors import MeshError

RANGE = "MESH_PORTS"
_given: set[int] = set()


class NoFreePort(MeshError):
    pass


def _range() -> tuple[int, int] | None:
    text = os.environ.get(RANGE, "").strip()
    if not text:
        return None
    low, _, high = text.partition("-")
    try:
        first, last = int(low), int(high)
    except ValueError:
        raise NoFreePort(f"{RANGE}={text!r}: not a range of ports like 20000-20999") from None
    if not 1024 <= first <= last <= 65535:
        raise NoFreePort(f"{RANGE}={text!r}: not a range of ports like 20000-20999")
    return first, last


def free_port() -> int:
    span = _range()
    if span is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first, last = span
    candidates = [p for p in range(first, last + 1) if p not in _given]
    random.shuffle(candidates)
    for port in candidates:
        if port_free(port):
            _given.add(port)
            return port
    raise NoFreePort(f"no free port left in {RANGE}={first}-{last}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
