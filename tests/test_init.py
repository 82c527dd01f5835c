"""`mesh init` on this machine, as a user runs it: a new mesh whose controller is a process from
the start (never a container), answering `mesh status` with the printed environment."""

import json
import os
import subprocess
from pathlib import Path

from helpers import MESH, account_of


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
    # The controller process has the system account's kicker as a file, so a new holder can
    # close a cut-off holder's connection (services/controller/module.toml).
    environ = (Path("/proc") / str(seat["pid"]) / "environ").read_bytes().split(b"\0")
    files = dict(e.decode().split("=", 1) for e in environ if b"=" in e)["MESH_FILES"]
    assert "BEGIN USER NKEY SEED" in (Path(files) / "system.creds").read_text()
    handover = json.loads(status.stdout)["handover"]
    assert handover["from"] == "mesh-init" and handover["planned"] is True

    # A second init on the same folder is refused, in one line.
    again = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert again.returncode == 1 and "already holds a mesh" in again.stderr
    assert "Traceback" not in again.stderr
