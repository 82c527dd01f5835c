"""A tool server written with the `mcp` package (the Python MCP SDK): the SDK makes the tools'
input schemas from the type hints and speaks MCP over stdio, exactly what the mesh host speaks.

The SDK is not on the machine: the bundle's build installs it into ./site beside this file
(module.toml), and this file puts ./site first on its path, so the machine needs nothing but a
python3 of the builder's version.
"""

import os
import socket
import sys
import time
from datetime import UTC, datetime

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "site"))

from mcp.server.mcpserver import MCPServer

server = MCPServer("clock", instructions="the time, and arithmetic, on one machine")


@server.tool()
def now(zone_offset_hours: float = 0.0) -> str:
    """The time on this machine, in ISO 8601, at an offset from UTC in hours."""
    at = datetime.now(UTC).timestamp() + zone_offset_hours * 3600
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


@server.tool()
def add(a: float, b: float) -> float:
    """a + b"""
    return a + b


@server.tool()
def uptime() -> dict:
    """This machine's hostname, and how long it has been up and this server running."""
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return {
        "hostname": socket.gethostname(),
        "machine_up_s": up,
        "server_up_s": time.monotonic() - STARTED,
    }


STARTED = time.monotonic()

if __name__ == "__main__":
    server.run()  # stdio
