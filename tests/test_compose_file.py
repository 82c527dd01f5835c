"""compose.dev.yaml cannot run here (no registry), but it must parse and every command it runs
must be a real `mesh` command."""

from pathlib import Path

import yaml

from mesh.cli.main import parser

COMPOSE = Path(__file__).parent.parent / "compose.dev.yaml"


def test_compose_parses_and_runs_real_mesh_commands() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert {"nats", "postgres"} <= set(services)
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
