"""compose.dev.yaml must parse, every command it runs must be a real `mesh` command, and it must
be the file a person can run: credentials issued by a one-shot service, NATS that admits only
them, health checks the start order waits on, init as PID 1, the controller never a container
of its own (a control machine's host runs it, installed by `mesh dev init`), and images that
carry no virtualenv and no credentials (.dockerignore). tests/test_compose_up.py runs it.

Where `docker compose` or docker-compose exists, its `config` checks the file as Compose reads
it."""

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
NATS_CONF = ROOT / "images" / "nats" / "nats.conf"
SERVERS = {"nats", "postgres"}  # their own images (images/); every other service is the mesh's
HOSTS = ["node-1", "node-2", "node-3"]


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


def _args(service: dict[str, Any]) -> Any:
    command = service["command"]
    assert isinstance(command, list) and command[0] == "mesh", command
    return parser().parse_args(command[1:])  # exits (fails the test) if not a real command


def test_compose_runs_machines_and_never_a_controller_container() -> None:
    """The seed's rule: the mesh's own code is not a container of its own. The machines run
    `mesh host run`; no service runs `mesh controller run`; init installs the controller on
    node-1 and node-2 (role=control), where it runs as a process of their hosts."""
    doc = _doc()
    services = doc["services"]
    assert set(services) == {"creds", "nats", "postgres", "init", *HOSTS, "cli"}
    for name in HOSTS:
        args = _args(services[name])
        assert (args.command, args.host_command, args.name) == ("host", "run", name), name
        assert services[name]["hostname"] == name
    for name, service in _mesh_services(doc).items():
        assert _args(service).command != "controller", f"{name} runs a controller container"
    init = _args(services["init"])
    assert (init.command, init.dev_command, init.hosts, init.control) == ("dev", "init", 3, 2)
    for name in SERVERS:
        assert "command" not in services[name] or services[name]["command"][0] != "mesh", name
        assert services[name]["image"].startswith(f"mesh-{name}:"), name


def test_every_mesh_command_in_the_file_is_real() -> None:
    """The creds, init and cli services too; init's health check is the file it writes."""
    doc = _doc()
    mesh = _mesh_services(doc)
    for service in mesh.values():
        _args(service)
    creds = _args(mesh["creds"])
    assert (creds.command, creds.dev_command) == ("dev", "creds")
    assert creds.hosts == len(HOSTS) == _args(mesh["init"]).hosts
    test = mesh["init"]["healthcheck"]["test"]
    assert test == ["CMD", "test", "-e", str(_args(mesh["init"]).placed)]


def test_mesh_services_run_under_init_and_wait_for_what_they_need() -> None:
    doc = _doc()
    mesh = _mesh_services(doc)
    for name, service in mesh.items():
        assert service.get("init") is True, f"{name}: PID 1 must be an init, not mesh"
        if name in ("creds", "init", "cli"):
            assert service.get("restart") == "no", f"{name} runs once"
        if name == "creds":
            continue
        deps = _depends(service)
        if name == "cli":
            assert deps == {"init": "service_completed_successfully"}
            continue
        assert deps.get("creds") == "service_completed_successfully", name
        assert deps.get("nats") == "service_healthy", name
    assert _depends(mesh["init"])["postgres"] == "service_healthy"
    # the hosts start once init has placed their machines (a host never chooses its tier)
    for name in HOSTS:
        assert _depends(mesh[name])["init"] == "service_healthy", name
    assert _depends(doc["services"]["nats"]) == {"creds": "service_completed_successfully"}
    # every service something waits on as healthy has a health check
    for service in doc["services"].values():
        for dep, condition in _depends(service).items():
            if condition == "service_healthy":
                assert doc["services"][dep]["healthcheck"]["test"][0] == "CMD", dep
    assert doc["services"]["postgres"]["healthcheck"]["test"][1] == "pg_isready"
    nats_check = " ".join(doc["services"]["nats"]["healthcheck"]["test"])
    assert "/healthz" in nats_check and "8222" in nats_check


def test_the_nats_image_reads_the_config_beside_its_dockerfile() -> None:
    dockerfile = (ROOT / "images" / "nats" / "Dockerfile").read_text()
    assert "COPY nats.conf /etc/nats/nats.conf" in dockerfile
    assert 'CMD ["-c", "/etc/nats/nats.conf"]' in dockerfile
    assert "sync_interval: always" in NATS_CONF.read_text()


def test_nats_admits_only_the_issued_credentials_and_only_locally() -> None:
    doc = _doc()
    nats = doc["services"]["nats"]
    conf = NATS_CONF.read_text()
    include = re.search(r'^include "([^"]+)"$', conf, re.MULTILINE)
    assert include, "the NATS config must include the authorization block"
    # the include is relative to the config's folder; the creds service writes it there
    auth_file = Path("/etc/nats") / include.group(1)
    volume = _mounts(nats)[str(auth_file.parent)]
    creds_dir = _args(doc["services"]["creds"]).dir
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
    exported = _args(mesh["creds"]).export
    creds_mounts = _mounts(mesh["creds"])
    expected = {"cli": "admin", "init": "admin", **{name: name for name in HOSTS}}
    for name, identity in expected.items():
        service = mesh[name]
        assert service["environment"]["MESH_CREDS"] == "/run/mesh/nats.creds", name
        source, mode = next(
            (v.split(":")[0], v.split(":")[2]) for v in service["volumes"] if ":/run/mesh:" in v
        )
        assert mode == "ro", name
        assert creds_mounts[str(exported / identity)] == source, f"{name} mounts {source}"
    # init alone also holds the controllers' file: the secret it sets and its mesh-init's
    controller = _args(mesh["init"]).controller_creds
    assert (
        _mounts(mesh["init"])[str(controller.parent)] == creds_mounts[str(exported / "controller")]
    )
    assert len(mesh["init"]["volumes"]) == 2
    for name in ("cli", *HOSTS):
        assert len(mesh[name]["volumes"]) == 1, f"{name} mounts more than its own credentials"


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
    compose: list[str] | None = None
    if (
        shutil.which("docker")
        and subprocess.run(
            ["docker", "compose", "version"], capture_output=True, timeout=30
        ).returncode
        == 0
    ):
        compose = ["docker", "compose"]
    elif shutil.which("docker-compose"):
        compose = ["docker-compose"]
    if compose is None:
        pytest.skip("neither `docker compose` nor docker-compose here: nothing can check the file")
    done = subprocess.run(
        [*compose, "-f", str(COMPOSE), "--profile", "cli", "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
