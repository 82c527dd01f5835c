"""How long a machine takes to join (`mesh join TOKEN`, docs/operations.md: joining a machine),
from the command to its host up: the command returns once its host agent has registered.

    .venv/bin/python bench/join.py [--joins 5] [--dir DIR]

Starts `mesh dev up --hosts 1` in DIR (a new temporary folder by default), then for each join:
a token (`mesh token create`, timed apart) and `mesh join` as a new machine would run it (none of
the mesh's settings in its environment, its own folder and host root), timed from its start to
its exit; then `mesh nodes` to check every joined machine is up. Prints each join and the
median and worst. Every process it started is stopped at the end.
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

READY = re.compile(r"^ready (\S+)$")


def _env_of(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    for line in (folder / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'\"")
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--joins", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="mesh-bench-join-"))
    root.chmod(0o755)
    mesh = [sys.executable, "-m", "programs.cli"]
    common.say(common.machine_line())
    dev = subprocess.Popen([*mesh, "dev", "up", "--hosts", "1", "--dir", str(root / "dev"),
                            "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # fmt: skip
    joined_pids: list[int] = []
    try:
        assert dev.stdout is not None
        for line in dev.stdout:
            if READY.match(line.strip()):
                break
        else:
            raise common.BenchError("mesh dev up exited before it was ready")
        env = _env_of(root / "dev")
        bare = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        tokens, joins = [], []
        for i in range(args.joins):
            t0 = time.monotonic()
            token = subprocess.run([*mesh, "token", "create"], env=env, capture_output=True,
                                   text=True, check=True).stdout.strip()  # fmt: skip
            tokens.append(time.monotonic() - t0)
            folder = root / f"j{i}"
            t0 = time.monotonic()
            done = subprocess.run(
                [*mesh, "join", token, "--name", f"bench-{i}", "--dir", str(folder), "--root",
                 str(folder / "host"), "--json"],
                env=bare, capture_output=True, text=True,
            )  # fmt: skip
            took = time.monotonic() - t0
            if done.returncode != 0:
                raise common.BenchError(f"join {i}: {done.stderr.strip()[-300:]}")
            joined_pids.append(int(re.search(r'"pid":(\d+)', done.stdout).group(1)))  # type: ignore[union-attr]
            joins.append(took)
            common.say(f"join {i}: token {tokens[-1]:.2f}s, join to up {took:.2f}s")
        nodes = subprocess.run([*mesh, "nodes", "--json"], env=env, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        up = sum(f'"name":"bench-{i}"' in nodes.replace(" ", "") for i in range(args.joins))
        common.say(f"{up} of {args.joins} joined machines in nodes")
        common.say(f"join to up: median {statistics.median(joins):.2f}s, worst {max(joins):.2f}s; "
                   f"token create: median {statistics.median(tokens):.2f}s")  # fmt: skip
    finally:
        for pid in joined_pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        dev.send_signal(signal.SIGTERM)
        try:
            dev.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(dev.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except common.BenchError as e:
        print(f"bench/join.py: {e}", file=sys.stderr)
        sys.exit(1)
