"""compose.dev.yaml run for real by Docker Compose (the plugin, or Debian's docker-compose 1.29):
the images made by images/build with no registry, the cluster brought up, used from this
machine through the published port (TLS with the mesh's CA, as the admin), and `down -v`
leaving nothing of the project behind. Skips, saying why, with no engine or no compose."""

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_tier_order, engine_answers, mesh_cli, ok, ok_json
from module_folders import HELLO, HELLO_TOKEN

from mesh.embedded import ports

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "compose.dev.yaml"
PREFIX = "mesh-compose-test-"  # a project left behind by a killed run is recognisably ours
UP = 600  # the images' build when the checkout changed, the cluster's start with its init

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _compose() -> list[str] | None:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    found = shutil.which("docker-compose")
    return [found] if found else None


class Cluster:
    def __init__(self, compose: list[str], project: str, port: int, folder: Path) -> None:
        self.argv = [*compose, "-p", project, "-f", str(COMPOSE)]
        self.project = project
        self.url = f"tls://127.0.0.1:{port}"
        self.env = {**os.environ, "MESH_NATS_PORT": str(port)}
        self.admin = folder / "admin.creds"

    def run(self, *args: str, timeout: float = UP) -> subprocess.CompletedProcess:
        return subprocess.run([*self.argv, *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env, cwd=ROOT)  # fmt: skip

    def mesh(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return mesh_cli(*args, nats_url=self.url, creds=str(self.admin), timeout=timeout)

    def left(self) -> dict[str, list[str]]:
        """The project's containers, volumes and networks that exist."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind in ("container", "volume", "network"):
            every = ["-a"] if kind == "container" else []
            argv = ["docker", kind, "ls", "-q", *every, "--filter", label]
            found[kind] = ok(
                subprocess.run(argv, capture_output=True, text=True, timeout=60)
            ).split()
        return found


def _down(argv: list[str], env: dict[str, str]) -> None:
    subprocess.run([*argv, "down", "-v", "--remove-orphans", "--timeout", "5"],
                   capture_output=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    if not engine_answers():
        pytest.skip("no Docker Engine answers (.ci/run starts dockerd where it can)")
    compose = _compose()
    if compose is None:
        pytest.skip("neither `docker compose` nor docker-compose here (.ci/run installs Debian's)")
    # Projects of earlier runs that were killed before their own clean-up
    projects = '{{.Label "com.docker.compose.project"}}'
    listed = subprocess.run(["docker", "ps", "-a", "--format", projects],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    for old in {p for p in listed.stdout.split() if p.startswith(PREFIX)}:
        _down([*compose, "-p", old, "-f", str(COMPOSE)], dict(os.environ))
    built = subprocess.run([str(ROOT / "images" / "build")], capture_output=True, text=True,
                           timeout=3000, cwd=ROOT)  # fmt: skip
    assert built.returncode == 0, f"images/build failed:\n{built.stderr[-3000:]}"
    cluster = Cluster(compose, PREFIX + uuid.uuid4().hex[:8], ports.free_port(), tmp_path)
    try:
        yield cluster
    finally:
        logs = cluster.run("logs", "--no-color", "--tail", "40", timeout=120)
        print(logs.stdout[-20000:])  # shown when the test failed
        _down(cluster.argv, cluster.env)


def test_the_dev_cluster_runs_under_compose(cluster: Cluster) -> None:
    up = cluster.run("up", "-d")
    assert up.returncode == 0, f"up failed:\n{up.stderr[-3000:]}"
    # `run` waits for init to complete (the controller installed, the seat handed to it)
    creds = cluster.run("run", "--rm", "-T", "cli", "cat", "/run/mesh/nats.creds")
    assert creds.returncode == 0, f"init did not complete:\n{creds.stderr[-3000:]}"
    cluster.admin.write_text(creds.stdout)
    cluster.admin.chmod(0o600)

    status = ok_json(cluster.mesh("--json", "status"))
    seat = status["seat"]
    assert seat is not None and seat["holder"] != "mesh-init", status
    # the controller is a process on the control machines' hosts, one holding, one standing by
    assert {seat["host"], *(s["host"] for s in status["standbys"])} == {"node-1", "node-2"}
    assert status["nodes"] == {"total": 3, "up": 3, "down": 0}
    nodes = ok_json(cluster.mesh("--json", "nodes"))["nodes"]
    assert {(n["name"], n["tier"], n["up"]) for n in nodes} == {
        ("node-1", 0, True),
        ("node-2", 1, True),
        ("node-3", 2, True),
    }
    running = ok(cluster.run("ps", "--services", "--filter", "status=running")).split()
    assert sorted(running) == ["nats", "node-1", "node-2", "node-3", "postgres"]

    # the hello example through the tiers: node-1 (tier 0), node-2 (1), node-3 (2)
    ok(mesh_cli("secret", "set", "hello-token", nats_url=cluster.url, creds=str(cluster.admin),
                stdin=HELLO_TOKEN))  # fmt: skip
    ok(cluster.mesh("push", str(HELLO), timeout=300))
    ok(cluster.mesh("assign", "hello", "node-1", "node-2", "node-3", "--wait", timeout=300))
    (last,) = ok_json(cluster.mesh("--json", "plan", "--limit", "1"))["plans"]
    plan = ok_json(cluster.mesh("--json", "plan", str(last["id"])))
    assert (plan["subject"], plan["trigger"], plan["state"]) == ("hello", "assign", "done"), plan
    assert [(s["machine"], s["tier"], s["state"]) for s in plan["steps"]] == [
        ("node-1", 0, "done"), ("node-2", 1, "done"), ("node-3", 2, "done"),
    ]  # fmt: skip
    assert_tier_order(plan)

    _down(cluster.argv, cluster.env)
    assert cluster.left() == {"container": [], "volume": [], "network": []}
