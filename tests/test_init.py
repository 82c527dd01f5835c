"""`mesh init` on this machine, as a user runs it: a new mesh whose controller is a process from
the start (never a container), answering `mesh status` with the printed environment."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import MESH, account_of

from mesh.embedded.children import stop_supervised


@pytest.fixture
def made():
    # Outside pytest's folder, which a pytest session starting elsewhere makes 0700: the
    # controller runs as its own account and must reach its bundle here.
    base = Path(tempfile.mkdtemp(prefix="mesh-test-init-"))
    base.chmod(0o755)
    folder = base / "mesh"
    yield folder
    record = folder / "mesh.json"
    if record.exists():
        for pid in json.loads(record.read_text())["pids"].values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    stop_supervised(folder)  # the controller the host ran
    for proc in Path("/proc").glob("[0-9]*"):  # anything else started there, even if init failed
        try:
            if str(base).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    shutil.rmtree(base, ignore_errors=True)


def test_init_makes_a_mesh_whose_controller_is_a_process(made) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    done = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0", "--name", "ctl-machine"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"source {made.resolve()}/env" in done.stdout
    assert "mesh machine add NAME" in done.stdout

    # As the user is told: source the env file, then `mesh status`.
    for line in (made / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    status = subprocess.run(
        [*MESH, "--json", "status"], capture_output=True, text=True, timeout=60, env=env
    )
    assert status.returncode == 0, status.stderr
    seat = json.loads(status.stdout)["seat"]
    assert seat["holder"].startswith("ctl-machine-")  # the process, not mesh-init
    if os.geteuid() == 0:
        assert account_of(seat["pid"]) == "mesh-controller"
    handover = json.loads(status.stdout)["handover"]
    assert handover["from"] == "mesh-init" and handover["planned"] is True

    # A second init on the same folder is refused, in one line.
    again = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert again.returncode == 1 and "already holds a mesh" in again.stderr
    assert "Traceback" not in again.stderr
