"""compose.dev.yaml cannot run here (no registry), but it must parse, every command it runs must
be a real `mesh` command, and it must be the file a person can run: credentials issued by a
one-shot service, NATS that admits only them, health checks the start order waits on, init as
PID 1, and an image that carries no virtualenv and no credentials (.dockerignore).

Where `docker compose` exists, `docker compose config` checks the file as Compose reads it."""

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from programs.cli.main import parser

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "compose.dev.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"
SERVERS = {"nats", "postgres"}  # third-party images; every other service is the mesh image


def _doc() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _mesh_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in doc["services"].items() if name not in SERVERS}


def _depends(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    assert isinstance(deps, dict), "depends_on must be a mapping with conditions, not a list"
    return {name: dep["condition"] for name, dep in deps.items()}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount point -> volume, from short-form `volume:/target[:ro]` entries."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def test_compose_parses_and_runs_real_mesh_commands() -> None:
    doc = _doc()
    services = doc["services"]
    assert {"nats", "postgres", "creds"} <= set(services)
    assert "sync_interval: always" in doc["configs"]["nats_conf"]["content"]
    controllers = [s for s in services if s.startswith("controller")]
    hosts = [s for s in services if s.startswith("node-")]
    assert len(controllers) == 2
    assert len(hosts) == 3
    for name in controllers + hosts:
        command = services[name]["command"]
        assert isinstance(command, list), f"{name}: command must be argv, not a shell string"
        assert command[0] == "mesh", name
        args = parser().parse_args(command[1:])  # exits (fails the test) if not a real command
        assert args.command in ("controller", "host")
    tiers = sorted(
        services[h]["command"][services[h]["command"].index("--tier") + 1] for h in hosts
    )
    assert tiers == ["0", "1", "2"]


def test_every_mesh_command_in_the_file_is_real() -> None:
    """The creds service, the cli service and the controllers' health check too."""
    doc = _doc()
    commands: list[tuple[str, list[str]]] = []
    for name, service in _mesh_services(doc).items():
        commands.append((name, service["command"]))
        test = service.get("healthcheck", {}).get("test")
        if test is not None:
            assert test[0] == "CMD", f"{name}: health check in CMD form, not a shell string"
            commands.append((f"{name} healthcheck", test[1:]))
    assert {"creds", "cli"} <= {name for name, _ in commands}
    for name, command in commands:
        assert isinstance(command, list), f"{name}: command must be argv, not a shell string"
        assert command[0] == "mesh", name
        parser().parse_args(command[1:])  # exits (fails the test) if not a real command
    creds = parser().parse_args(doc["services"]["creds"]["command"][1:])
    assert (creds.command, creds.dev_command) == ("dev", "creds")
    assert creds.hosts == len([s for s in doc["services"] if s.startswith("node-")])


def test_mesh_services_run_under_init_and_wait_for_what_they_need() -> None:
    doc = _doc()
    mesh = _mesh_services(doc)
    assert set(mesh) >= {"creds", "controller-1", "controller-2", "node-1", "node-2", "node-3"}
    for name, service in mesh.items():
        assert service.get("init") is True, f"{name}: PID 1 must be an init, not mesh"
        if name == "creds":
            assert service.get("restart") == "no", "creds runs once"
            continue
        deps = _depends(service)
        assert deps.get("creds") == "service_completed_successfully", name
        assert deps.get("nats") == "service_healthy", name
    for name in ("controller-1", "controller-2"):
        assert _depends(mesh[name])["postgres"] == "service_healthy"
        assert mesh[name]["healthcheck"]["test"] == ["CMD", "mesh", "controller", "ready"]
        # the readiness file `mesh controller run` writes and `mesh controller ready` reads
        assert mesh[name]["environment"]["MESH_FILES"]
    for name in ("node-1", "node-2", "node-3", "cli"):
        deps = _depends(mesh[name])
        assert deps["controller-1"] == deps["controller-2"] == "service_healthy", name
    assert _depends(doc["services"]["nats"]) == {"creds": "service_completed_successfully"}
    # every service something waits on as healthy has a health check
    for service in doc["services"].values():
        for dep, condition in _depends(service).items():
            if condition == "service_healthy":
                assert doc["services"][dep]["healthcheck"]["test"][0] == "CMD", dep
    assert doc["services"]["postgres"]["healthcheck"]["test"][1] == "pg_isready"
    nats_check = doc["services"]["nats"]["healthcheck"]["test"]
    assert any(word.endswith("/healthz") for word in nats_check)


def test_the_hosts_start_once_the_admin_has_placed_their_machines() -> None:
    """On an authenticated mesh a host's --tier/--label are not taken: `place` sets them."""
    doc = _doc()
    mesh = _mesh_services(doc)
    place = parser().parse_args(mesh["place"]["command"][1:])
    assert (place.command, place.dev_command, place.hosts) == ("dev", "place", 3)
    assert mesh["place"]["restart"] == "no"
    assert mesh["place"]["volumes"] == ["creds-admin:/run/mesh:ro"]
    assert _depends(mesh["place"])["controller-1"] == "service_healthy"
    for name in ("node-1", "node-2", "node-3"):
        assert _depends(mesh[name])["place"] == "service_completed_successfully", name


def test_nats_admits_only_the_issued_credentials_and_only_locally() -> None:
    doc = _doc()
    nats = doc["services"]["nats"]
    conf = doc["configs"]["nats_conf"]["content"]
    include = re.search(r'^include "([^"]+)"$', conf, re.MULTILINE)
    assert include, "the NATS config must include the authorization block"
    # the include is relative to the config's folder; the creds service writes it there
    conf_dir = Path(nats["configs"][0]["target"]).parent
    auth_file = conf_dir / include.group(1)
    volume = _mounts(nats)[str(auth_file.parent)]
    creds_dir = parser().parse_args(doc["services"]["creds"]["command"][1:]).dir
    assert _mounts(doc["services"]["creds"])[str(creds_dir / "nats")] == volume, (
        "the authorization block must be the one the creds service writes"
    )
    assert f"{volume}:{auth_file.parent}:ro" in nats["volumes"]
    # the monitoring endpoint for /healthz: inside the container only
    http = re.search(r"^http: (\S+)$", conf, re.MULTILINE)
    assert http and http.group(1).startswith("127.0.0.1:")
    for port in nats.get("ports", []):
        published = str(port)
        assert published.startswith("127.0.0.1:"), f"NATS published beyond this machine: {port}"
        assert "0.0.0.0" not in published
    for name, service in doc["services"].items():
        if name not in SERVERS:
            assert not service.get("ports"), f"{name} publishes a port"


def test_each_piece_mounts_its_own_credentials_only() -> None:
    doc = _doc()
    mesh = _mesh_services(doc)
    exported = parser().parse_args(mesh["creds"]["command"][1:]).export
    creds_mounts = _mounts(mesh["creds"])
    expected = {"controller-1": "controller", "controller-2": "controller", "cli": "admin",
                **{f"node-{i}": f"node-{i}" for i in (1, 2, 3)}}  # fmt: skip
    for name, identity in expected.items():
        service = mesh[name]
        env = service["environment"]
        assert env["MESH_CREDS"] == "/run/mesh/nats.creds", name
        (volume,) = [v for v in service["volumes"] if ":/run/mesh" in v]
        source, target, mode = volume.split(":")
        assert (target, mode) == ("/run/mesh", "ro"), name
        assert creds_mounts[str(exported / identity)] == source, f"{name} mounts {source}"
        assert len(service["volumes"]) == 1, f"{name} mounts more than its own credentials"


def _excluded(path: str, patterns: list[str]) -> bool:
    """Whether the Docker build context leaves `path` out (its patterns, in order, the last
    match deciding; a path is left out with any of its folders)."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        for part in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
            if part.startswith("**"):
                out += "(?:.*/)?" if part.endswith("/") else ".*"
            elif part == "*":
                out += "[^/]*"
            elif part == "?":
                out += "[^/]"
            else:
                out += re.escape(part)
        return re.compile(out + r"\Z")

    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for line in patterns:
        negate = line.startswith("!")
        pattern = regex(line.removeprefix("!"))
        if any(pattern.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_the_venv_and_credentials_out_of_the_image() -> None:
    lines = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".mesh", ".git"} <= set(lines)
    for leaked in (
        ".venv/bin/python",
        ".mesh/dev/creds/admin.creds",
        ".mesh/dev/creds/hosts/node-1.creds",
        "docs/.mesh/dev/creds/admin.creds",
        ".git/config",
        "mesh/__pycache__/main.cpython-312.pyc",
        "services/host/__pycache__/apply.cpython-312.pyc",
        "mesh.egg-info/PKG-INFO",
        ".pytest_cache/v/cache/lastfailed",
        ".hypothesis/examples/x",
        "tests/.test_build_logs.py.626cc6ae.tmp",
    ):
        assert _excluded(leaked, lines), f"{leaked} would be in the image"
    for needed in (
        "pyproject.toml",
        "README.md",
        "programs/cli/main.py",
        "mesh/store/migrations/001_machines_seat_events.sql",
        "services/host/main.py",
        "services/controller/module.toml",
    ):
        assert not _excluded(needed, lines), f"{needed} would be missing from the build"


def test_dockerfile_copies_only_what_the_build_context_has() -> None:
    """The image is built from the package's sources; each COPY source is in the context."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [
        line.split()[1:-1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    ]
    assert copies, "the Dockerfile copies nothing"
    for sources in copies:
        for source in sources:
            assert source != ".", "COPY . would bring whatever the context holds"
            assert (ROOT / source).exists(), source
            assert not _excluded(source, patterns), f"{source} is left out by .dockerignore"


def test_docker_compose_config_accepts_the_file() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker command here: `docker compose config` cannot check the file")
    version = subprocess.run(
        [docker, "compose", "version"], capture_output=True, text=True, timeout=30
    )
    if version.returncode != 0:
        pytest.skip(f"`docker compose` is not available here: {version.stderr.strip()[:200]}")
    done = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "--profile", "cli", "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
