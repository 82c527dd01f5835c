"""`mesh dev creds`: the credentials `mesh dev up` issues, issued without starting anything, and
copied one identity per folder (compose.dev.yaml's `creds` service); then a real nats-server
with compose.dev.yaml's own configuration (images/nats/nats.conf) admits those files and nobody
else. tests/test_compose_up.py runs the whole file under Docker Compose."""

import json
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
from mesh.auth import claims, creds, registry
from mesh.auth.keys import new_user
from mesh.embedded import natsd, ports
from mesh.meshdir import MeshDir

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
    signer = registry.Registry.load(MeshDir(folder)).trust.signer.public
    for user in users:  # the servers know no user: each file's JWT is the mesh signer's
        assert user["public"] not in auth
        signed = claims.decode(creds.read(Path(first["creds"][user["name"]])).user_jwt or "")
        assert (signed["sub"], signed["iss"]) == (user["public"], signer)
    seeds = {}
    for name in IDENTITIES:
        held, copy = Path(first["creds"][name]), Path(first["exported"][name])
        assert copy == out / name / "nats.creds"
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        original, exported = creds.read(held), creds.read(copy)
        assert (exported.seed, exported.inbox) == (original.seed, original.inbox)
        assert exported.controller == original.controller  # a host checks what is signed
        assert exported.operator == original.operator  # where the operator's changes go
        seeds[name] = original.seed
        assert original.seed not in auth  # nats-server gets public keys only
    assert creds.read(out / "node-1" / "nats.creds").inbox == "_INBOX_node-1"
    assert creds.read(out / "node-1" / "nats.creds").controller is not None
    assert creds.read(out / "admin" / "nats.creds").operator == "admin"

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
    target = Path("/etc/nats/nats.conf")  # images/nats/Dockerfile copies it there
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
    text = (ROOT / "images" / "nats" / "nats.conf").read_text()
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
