"""Run a command as on a machine with no container engine, on a machine that has one.

    unshare --mount --propagation private -- python3 tests/no_engine.py ARGV...

In the private mount namespace `unshare` made (root only), /dev/null is bound over every path
where a Docker client looks for the engine's socket (/run/docker.sock, /var/run/docker.sock,
~/.docker/run/docker.sock), and DOCKER_HOST and DOCKER_CONTEXT are dropped: the client then finds
nothing at all, which is what most users' first machine looks like. (DOCKER_HOST naming a missing
socket is not the same: the client is built and fails only at its first call.) Then ARGV is
executed in place of this program, so its pid is the caller's child's.

Used by tests/test_no_engine.py for one host, and by .ci/run for a whole pass of the tests that
apply declarations.
"""

import os
import subprocess
import sys
from pathlib import Path

SOCKETS = ("/run/docker.sock", "/var/run/docker.sock", "~/.docker/run/docker.sock")


def hide_engine() -> None:
    for place in sorted({Path(p).expanduser().resolve() for p in SOCKETS}):
        if place.exists() and not place.is_dir():
            subprocess.run(["mount", "--bind", "/dev/null", str(place)], check=True)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: no_engine.py ARGV... (inside `unshare --mount --propagation private`)")
    hide_engine()
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_HOST", "DOCKER_CONTEXT")}
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])
