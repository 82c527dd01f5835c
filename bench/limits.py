"""Benchmark: process limits as the host enforces them (services/host/limits.py), on this
machine's cgroups.

1. **cpu_max**: CPU-bound Python processes (`while True: pass`, one more than the cores, in one
   cgroup: a process and its children) started with the host's own
   exec driver (services/host/processes.py `spawn`, its cgroup made by `limits.create`) under
   each `cpu_max` in turn, and without one, for `--seconds` of wall time each: the cores it got
   (its cgroup's CPU time over the wall time), the periods it was throttled in and for how long.
2. **memory_max**: a process that allocates 8 MiB at a time under `memory_max = "64M"`: how long
   from its start until the kernel kills it, and whether the host names the kill (the OOM kill
   counter of its cgroup).
3. **what a cgroup costs a start**: `--starts` starts of `/bin/true`, each waited for, with its
   own cgroup made, joined before exec and removed after it exits, against the same without.

It prints figures and never fails on a timing. It needs root and a writable cgroup hierarchy
(v1 or v2); it makes its cgroups under `mesh-bench.<hash>` in this process's own and removes
them all in a `finally`.

    .venv/bin/python bench/limits.py [--seconds 5] [--starts 200]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine_line, say

from mesh.modules.compose import DLimits
from services.host import limits, processes

# As many spinning processes as cores, and one: together they would take the whole machine.
SPIN = f"""\
import os
for _ in range({os.cpu_count() or 1}):
    if os.fork() == 0:
        break
while True:
    pass
"""
HOG = "held = []\nwhile True:\n    held.append(b'\\x01' * (8 * 2**20))\n"


async def _run(cgroups: limits.Cgroups, folder: Path, name: str, code: str, lim: DLimits | None,
               *, seconds: float | None) -> dict:  # fmt: skip
    """One process in a cgroup of its own, for `seconds` (None: until it exits)."""
    dirs = limits.create(cgroups, name=name, lim=lim)
    try:
        started = time.monotonic()
        instance, _ = processes.spawn(
            [sys.executable, "-c", code], cwd=folder, env={}, log_file=folder / f"{name}.log",
            spec=name, uid=None, gid=None, cgroups=dirs,
        )  # fmt: skip
        if seconds is None:
            code_ = await processes.wait(instance)
        else:
            with anyio.move_on_after(seconds):
                await processes.wait(instance)
            code_ = None
        wall = time.monotonic() - started
        figures = {
            "wall": wall, "cpu": limits.cpu_seconds(dirs) or 0.0, "code": code_,
            "throttled": limits.throttled(dirs), "oom": limits.oom_kills(dirs),
            "throttled_s": _throttled_seconds(dirs),
        }  # fmt: skip
        await processes.stop(instance, timeout=1)
        return figures
    finally:
        await limits.remove(dirs)


def _throttled_seconds(dirs: dict[str, str]) -> float:
    folder = dirs.get(limits.UNIFIED) or dirs.get("cpu")
    if not folder:
        return 0.0
    stat = limits._stat(Path(folder) / "cpu.stat")
    if limits.UNIFIED in dirs:
        return stat.get("throttled_usec", 0) / 1e6
    return stat.get("throttled_time", 0) / 1e9


async def _starts(cgroups: limits.Cgroups, folder: Path, n: int, *, with_cgroup: bool) -> float:
    started = time.monotonic()
    for i in range(n):
        dirs = limits.create(cgroups, name=f"start.{i}", lim=None) if with_cgroup else {}
        instance, _ = processes.spawn(
            ["/bin/true"], cwd=folder, env={}, log_file=folder / "starts.log", spec="s",
            uid=None, gid=None, cgroups=dirs,
        )  # fmt: skip
        await processes.wait(instance)
        await limits.remove(dirs)
    return (time.monotonic() - started) / n


async def main(seconds: float, starts: int) -> None:
    with tempfile.TemporaryDirectory(
        prefix="mesh-bench-limits-",
        ignore_cleanup_errors=True,  # log writers may write on
    ) as tmp:
        folder = Path(tmp)
        cgroups = limits.probe(machine="bench", state=folder)
        if cgroups.cannot:
            say(f"this machine cannot enforce every limit: {cgroups.cannot}")
            return
        try:
            say(machine_line())
            say(f"cgroup {cgroups.version}; each run {seconds:g} s of wall time")
            say("| cpu_max | cores used | periods throttled | throttled for |")
            say("|---|---|---|---|")
            for cpu in (0.2, 0.5, 1.0, None):
                f = await _run(cgroups, folder, f"spin.{cpu}", SPIN, DLimits(cpu=cpu),
                               seconds=seconds)  # fmt: skip
                say(f"| {cpu if cpu is not None else 'none'} | {f['cpu'] / f['wall']:.3f} | "
                    f"{f['throttled']} | {f['throttled_s']:.2f} s |")  # fmt: skip
            f = await _run(cgroups, folder, "hog", HOG, DLimits(memory=64 * 2**20), seconds=None)
            say(f"memory_max 64M: killed after {f['wall'] * 1000:.0f} ms (exit {f['code']}, "
                f"OOM kills counted {f['oom']})")  # fmt: skip
            bare = await _starts(cgroups, folder, starts, with_cgroup=False)
            grouped = await _starts(cgroups, folder, starts, with_cgroup=True)
            say(f"a start of /bin/true, waited for: {bare * 1000:.2f} ms without a cgroup, "
                f"{grouped * 1000:.2f} ms with one made, joined and removed "
                f"({starts} starts each)")  # fmt: skip
        finally:
            limits.release(cgroups)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--starts", type=int, default=200)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if os.geteuid() != 0:
        sys.exit("bench/limits.py: needs root (it makes cgroups)")
    anyio.run(main, args.seconds, args.starts)
