"""`mesh dev creds`: the credentials `mesh dev up` issues, issued without starting anything, and
copied one identity per folder (compose.dev.yaml's `creds` service); then a real nats-server
with compose.dev.yaml's own configuration admits those files and nobody else."""

import json
import os
import re
import socket
import stat
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import MESH, ok, ok_json, one_line_error, wait_until

from mesh import bus
from mesh.auth import creds
from mesh.auth.keys import new_user
from mesh.embedded import natsd, ports

ROOT = Path(__file__).parent.parent
IDENTITIES = ["admin", "viewer", "tools", "controller", "node-1", "node-2", "node-3"]


def dev_creds(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MESH, "dev", "creds", *args], capture_output=True, text=True)


def test_issues_what_dev_up_issues_and_keeps_it(tmp_path: Path) -> None:
    folder, out = tmp_path / "mesh", tmp_path / "out"
    first = ok_json(dev_creds("--dir", str(folder), "--export", str(out), "--json"))
    assert list(first["creds"]) == list(first["exported"]) == IDENTITIES
    users = json.loads((folder / "creds" / "users.json").read_text())["users"]
    assert {(u["kind"], u["name"], u.get("role"), u.get("builder", False)) for u in users} == {
        ("operator", "admin", "admin", False),
        ("operator", "viewer", "viewer", False),
        ("operator", "tools", "tools", False),
        ("controller", "controller", None, False),
        ("host", "node-1", None, True),
        ("host", "node-2", None, False),
        ("host", "node-3", None, False),
    }
    auth = Path(first["auth"]).read_text()
    assert auth == (folder / "nats" / "auth.conf").read_text()
    for user in users:
        assert f'nkey: "{user["public"]}"' in auth
    seeds = {}
    for name in IDENTITIES:
        held, copy = Path(first["creds"][name]), Path(first["exported"][name])
        assert copy == out / name / "nats.creds"
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        original, exported = creds.read(held), creds.read(copy)
        assert (exported.seed, exported.inbox) == (original.seed, original.inbox)
        seeds[name] = original.seed
        assert original.seed not in auth  # nats-server gets public keys only
    assert creds.read(out / "node-1" / "nats.creds").inbox == "_INBOX_node-1"

    # Again on the same folder: nothing new is issued (a restarted compose keeps its keys).
    again = ok_json(dev_creds("--dir", str(folder), "--export", str(out), "--json"))
    assert again["creds"] == first["creds"]
    for name in IDENTITIES:
        assert creds.read(out / name / "nats.creds").seed == seeds[name]
    # More hosts: the existing keep theirs, the new one is added.
    more = ok_json(dev_creds("--dir", str(folder), "--hosts", "4", "--json"))
    assert list(more["creds"]) == [*IDENTITIES, "node-4"]
    assert more["exported"] == {}
    assert creds.read(more["creds"]["node-2"]).seed == seeds["node-2"]


def test_text_output_and_bad_input(tmp_path: Path) -> None:
    text = ok(dev_creds("--dir", str(tmp_path / "m")))
    assert "admin, viewer, tools, controller, node-1, node-2, node-3" in text
    assert str(tmp_path / "m" / "nats" / "auth.conf") in text
    done = dev_creds("--dir", str(tmp_path / "m"), "--hosts", "0")
    assert done.returncode == 2 and "out of range" in done.stderr
    (tmp_path / "file").write_text("")
    assert "file" in one_line_error(dev_creds("--dir", str(tmp_path / "file" / "m")))


def _compose_nats(tmp_path: Path) -> tuple[Path, int, int]:
    """compose.dev.yaml's NATS configuration laid out as its container sees it, under tmp_path:
    the config at etc/nats/nats.conf, the nats-auth volume at etc/nats/auth; only the store's
    folder and the ports differ."""
    doc = yaml.safe_load((ROOT / "compose.dev.yaml").read_text())
    nats = doc["services"]["nats"]
    target = Path(nats["configs"][0]["target"])
    auth_mount = next(v.split(":")[1] for v in nats["volumes"] if v.startswith("nats-auth:"))
    conf = tmp_path / target.relative_to("/")
    (tmp_path / Path(auth_mount).relative_to("/")).mkdir(parents=True)
    command = doc["services"]["creds"]["command"]
    hosts = [command[i + 1] for i, a in enumerate(command) if a == "--nats-host"]
    assert hosts == ["nats"], "the server's certificate must name the service clients reach"
    ok(dev_creds("--dir", str(tmp_path / "mesh"), "--export", str(tmp_path / "out"),
                 *(a for h in hosts for a in ("--nats-host", h))))  # fmt: skip
    mounted = tmp_path / Path(auth_mount).relative_to("/")
    for made in ("auth.conf", "server.pem", "server.key"):
        (tmp_path / "mesh" / "nats" / made).rename(mounted / made)
    port, monitor = ports.free_port(), ports.free_port()
    text = doc["configs"]["nats_conf"]["content"]
    text = text.replace("/data", str(tmp_path / "data")).replace(":4222", f":{port}")
    text = text.replace(f'"{auth_mount}/', f'"{mounted}/')
    text = re.sub(r"^http: 127\.0\.0\.1:\d+$", f"http: 127.0.0.1:{monitor}", text, flags=re.M)
    conf.write_text(text)
    return conf, port, monitor


def test_compose_nats_config_is_valid(tmp_path: Path) -> None:
    conf, _, _ = _compose_nats(tmp_path)
    done = subprocess.run([natsd.binary(), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


async def test_compose_nats_admits_the_exported_credentials_only(tmp_path: Path, procs) -> None:
    conf, port, monitor = _compose_nats(tmp_path)
    server = procs.start("nats-server", natsd.argv(conf))
    url = f"tls://127.0.0.1:{port}"
    wait_until(lambda: server.poll() is not None or _open(port), within=10, what="nats-server")
    assert server.poll() is None, server.log_path.read_text()
    ca = str(tmp_path / "mesh" / "tls" / "ca.pem")
    # what the nats service's health check asks (its wget)
    async with httpx.AsyncClient(trust_env=False) as http:
        answer = await http.get(f"http://127.0.0.1:{monitor}/healthz", timeout=5)
    assert answer.status_code == 200, answer.text
    with pytest.raises(bus.Unreachable, match="CA is not known"):
        await bus.connect(url, name="no CA", reconnect=False)
    with pytest.raises(bus.Unauthorized):
        await bus.connect(url, name="nobody", reconnect=False, ca=ca)
    for name in IDENTITIES:
        path = tmp_path / "out" / name / "nats.creds"
        nc = await bus.connect(url, name=name, creds=str(path), reconnect=False)
        await nc.close()
    stranger = tmp_path / "stranger.creds"  # a well-formed key the server does not list
    key = new_user()
    creds.write(stranger, who="a stranger", seed=key.seed, inbox="_INBOX")
    with pytest.raises(bus.Unauthorized):
        await bus.connect(url, name="stranger", creds=str(stranger), reconnect=False, ca=ca)


def _open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_compose_rehearsed_without_docker(tmp_path: Path, procs, database_url: str) -> None:
    """compose.dev.yaml's controller and first host, run as processes with the file's own
    commands and environment (paths mapped to tmp_path): each connects with its exported
    credentials, the controllers' health check passes, the admin's file reads the fleet."""
    doc = yaml.safe_load((ROOT / "compose.dev.yaml").read_text())
    conf, port, _ = _compose_nats(tmp_path)
    server = procs.start("nats-server", natsd.argv(conf))
    wait_until(lambda: server.poll() is not None or _open(port), within=10, what="nats-server")
    url = f"tls://127.0.0.1:{port}"

    def env_of(service: str, identity: str) -> dict[str, str]:
        env = dict(doc["services"][service]["environment"])
        env["MESH_NATS_URL"] = url
        env["MESH_CREDS"] = str(tmp_path / "out" / identity / "nats.creds")
        if "MESH_DATABASE_URL" in env:
            env["MESH_DATABASE_URL"] = database_url
        if "MESH_SECRETS_KEY_FILE" in env:  # the controllers' alone, exported beside their creds
            env["MESH_SECRETS_KEY_FILE"] = str(tmp_path / "out" / identity / "secrets.key")
            assert os.stat(env["MESH_SECRETS_KEY_FILE"]).st_mode & 0o777 == 0o600
        if "MESH_FILES" in env:
            env["MESH_FILES"] = str(tmp_path / f"{service}-files")
            Path(env["MESH_FILES"]).mkdir()
        return env

    def argv(command: list[str]) -> list[str]:
        assert command[0] == "mesh"
        return [*MESH, *(str(tmp_path / "root") if a == "/var/lib/mesh" else a
                         for a in command[1:])]  # fmt: skip

    ctl_env = env_of("controller-1", "controller")
    procs.start("controller-1", argv(doc["services"]["controller-1"]["command"]), env=ctl_env)
    health = doc["services"]["controller-1"]["healthcheck"]["test"]
    assert health[0] == "CMD"

    def healthy() -> bool:
        done = subprocess.run(argv(health[1:]), env={**_base_env(), **ctl_env},
                              capture_output=True, text=True)  # fmt: skip
        return done.returncode == 0

    wait_until(healthy, within=60, what="controller-1's health check")
    procs.start("node-1", argv(doc["services"]["node-1"]["command"]),
                env=env_of("node-1", "node-1"))  # fmt: skip
    admin = {**_base_env(), **env_of("cli", "admin")}

    def node_1_up() -> bool:
        done = subprocess.run([*MESH, "nodes", "--json"], env=admin, capture_output=True,
                              text=True)  # fmt: skip
        return done.returncode == 0 and any(
            n["name"] == "node-1" and n["up"] for n in json.loads(done.stdout)["nodes"]
        )

    wait_until(node_1_up, within=60, what="node-1 up, seen with the admin's credentials")


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
