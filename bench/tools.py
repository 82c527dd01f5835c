"""Benchmark: a tool call through the bus, as a share of a direct stdio call to the same server.

The pieces are real: `mesh dev up --hosts 2 --dir DIR --port 0` (one TLS nats-server,
PostgreSQL, two controllers, node-1 and node-2) started in a temporary folder, the example tool
module docs/examples/files pushed and assigned to node-2 with the `mesh` command line, and its
trivial tool `echo` (`{"text": "x"}` back as one text block) called:

1. through the bus: `mesh.host.node-2.tool` from one client connection with the admin's
   credentials (mesh/client/tools.py `call_tool`, what `mesh tool call` and `mesh mcp` use):
   the client, nats-server, node-2's host (decode, bound, its MCP session) and the server;
2. directly: the same files_server.py started here with the host's own exec driver and MCP
   client (services/host/processes.py `spawn(piped=True)`, services/host/mcpstdio.py), its stdio
   pipes to this process: the server and the MCP client alone.

and, for where the time goes, node-2's `status` host verb (the bus and the host's serving of a
verb that does no work: the floor under a call through the bus).

Each is run sequentially (one call in flight: latency) and concurrently (`--concurrency` in
flight: throughput), in `--rounds` rounds that alternate which goes first, so drift in the
machine's speed falls on both. It prints calls/s and p50/p99 latency in ms for each, and the
bus's rate as a share of the direct one. It never fails on a timing.

    .venv/bin/python bench/tools.py [--calls 2000] [--concurrency 16] [--rounds 3]

Everything lives in a temporary folder; `mesh dev up` runs in its own session and is stopped
(SIGTERM, then SIGKILL of its group) in a `finally`, with the server started here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mesh import bus  # noqa: E402
from mesh.client.tools import call_tool  # noqa: E402
from mesh.entry import command  # noqa: E402
from services.host import processes  # noqa: E402
from services.host.mcpstdio import Session  # noqa: E402

MESH = command()
EXAMPLE = ROOT / "docs" / "examples" / "files"

Call = Callable[[], Awaitable[None]]


def mesh(folder: Path, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "MESH_NATS_URL": (folder / "nats" / "url").read_text().strip(),
           "MESH_CA": str(folder / "tls" / "ca.pem"),
           "MESH_CREDS": str(folder / "creds" / "admin.creds")}  # fmt: skip
    done = subprocess.run([*MESH, *args], capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"mesh {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def start_mesh(folder: Path) -> subprocess.Popen:
    log = open(folder.parent / "dev-up.log", "wb")
    child = subprocess.Popen(
        [*MESH, "dev", "up", "--hosts", "2", "--dir", str(folder), "--port", "0"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while b"ready " not in (folder.parent / "dev-up.log").read_bytes():
        if child.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"mesh dev up did not get ready: see {folder.parent}/dev-up.log")
        time.sleep(0.2)  # ok: polling a log for a line, with a deadline
    return child


def stop(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def timed(call: Call, *, calls: int, concurrency: int) -> tuple[float, list[float]]:
    """(calls/s, latencies in ms) of `calls` calls, `concurrency` in flight."""
    latencies: list[float] = []
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            began = time.perf_counter()
            await call()
            latencies.append((time.perf_counter() - began) * 1000)

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return calls / (time.perf_counter() - began), latencies


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def run(args: argparse.Namespace, folder: Path) -> None:
    mesh(folder, "push", str(EXAMPLE))
    mesh(folder, "assign", "files", "node-2", "--wait")
    deadline = time.monotonic() + 60
    while True:
        tools = json.loads(mesh(folder, "tools", "node-2", "--json"))["tools"]
        if any(t["state"] == "ready" for t in tools):
            break
        if time.monotonic() > deadline:
            raise SystemExit("node-2's files server did not get ready")
        await anyio.sleep(0.2)  # ok: polling a condition with a deadline
    url = (folder / "nats" / "url").read_text().strip()
    os.environ["MESH_CA"] = str(folder / "tls" / "ca.pem")
    nc = await bus.connect(url, name="bench tools", creds=str(folder / "creds" / "admin.creds"),
                           reconnect=False)  # fmt: skip

    async def host_status() -> None:  # the floor: a host verb that does no work
        msg = await nc.request("mesh.host.node-2.status", b"{}", timeout=10)
        assert b'"name":"node-2"' in msg.data

    async def through_bus() -> None:
        reply = await call_tool(nc, machine="node-2", server="files", tool="echo",
                                arguments={"text": "x"}, timeout=10)  # fmt: skip
        assert reply.content[0]["text"] == "x"

    log = folder.parent / "direct.log"
    instance, pipes = processes.spawn(
        ["python3", "files_server.py"], cwd=EXAMPLE / "src", env={"PATH": os.environ["PATH"]},
        log_file=log, spec="bench", uid=None, gid=None, piped=True,
    )  # fmt: skip
    assert pipes is not None
    session = Session(stdin=pipes.stdin, stdout=pipes.stdout)

    async def direct() -> None:
        result = await session.call_tool("echo", {"text": "x"}, timeout=10)
        assert result["content"][0]["text"] == "x"

    figures: dict[tuple[str, str], list[tuple[float, list[float]]]] = {}
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(session.run)
            await session.initialize(timeout=10)
            for warm in (through_bus, direct, host_status):
                await timed(warm, calls=200, concurrency=4)
            for r in range(args.rounds):
                order = [("bus", through_bus), ("direct", direct), ("status", host_status)]
                for name, call in order if r % 2 == 0 else order[::-1]:
                    for mode, c in (("sequential", 1), ("concurrent", args.concurrency)):
                        got = await timed(call, calls=args.calls, concurrency=c)
                        figures.setdefault((name, mode), []).append(got)
            tg.cancel_scope.cancel()
    finally:
        await session.end_input()
        await processes.stop(instance, timeout=5)
        os.close(pipes.stdout)
        await nc.close()

    print(f"python {platform.python_version()}, {os.cpu_count()} cpus; {args.rounds} rounds of "
          f"{args.calls} calls each way; concurrent: {args.concurrency} in flight")  # fmt: skip
    for mode in ("sequential", "concurrent"):
        rates = {}
        for name in ("direct", "bus", "status"):
            runs = figures[(name, mode)]
            rate = statistics.median(r for r, _ in runs)
            lat = [x for _, ls in runs for x in ls]
            rates[name] = rate
            print(f"  {mode:10} {name:6}: {rate:8.0f} calls/s  p50 {p(lat, 50):6.2f} ms  "
                  f"p99 {p(lat, 99):6.2f} ms")  # fmt: skip
        pairs = zip(figures[("bus", mode)], figures[("direct", mode)], strict=True)
        per_round = [b[0] / d[0] for b, d in pairs]
        print(f"  {mode:10} bus/direct: {rates['bus'] / rates['direct']:.0%} (per round: "
              f"{', '.join(f'{x:.0%}' for x in per_round)})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mesh-bench-tools-") as tmp:
        folder = Path(tmp) / "mesh"
        child = start_mesh(folder)
        try:
            anyio.run(run, args, folder)
        finally:
            stop(child)


if __name__ == "__main__":
    main()
