"""`mesh dev up` end to end, as a user runs it: ready, nodes listed, a second one on the same
folder refused, SIGTERM leaves nothing running, and a restart on the same folder keeps the data
and the credentials. Every connection authenticates: the env file's admin credentials work, no
credentials are refused; its console asks for the token its line prints."""

import os
import re
import shlex
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from helpers import MESH, DevUp, env_file, mesh_cli, ok_json


def _running_under(folder: Path) -> list[str]:
    """Processes whose command line or working folder mentions `folder` (ours, left behind)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if str(folder) in cmdline or cwd.startswith(str(folder)):
            found.append(f"{pid}: {cmdline}")
    return found


def _pids(lines: list[str]) -> list[int]:
    """Every piece's pid, from `mesh dev up`'s own lines ("… (pid 123)")."""
    pieces = [line for line in lines if not line.startswith("mesh dev up is pid ")]  # itself
    pids = [int(m) for line in pieces for m in re.findall(r"pid (\d+)", line)]
    # nats, postgres and its TLS front, two controllers, three hosts, the console
    assert len(pids) == 9, lines
    return pids


def _http_status(url: str, headers: dict[str, str] | None = None) -> int:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy's
    try:
        with direct.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def test_dev_up_end_to_end(tmp_path: Path) -> None:
    folder = tmp_path / "dev"
    dev = DevUp(folder)
    try:
        url = dev.wait_for("ready ", within=90).split()[1]
        assert url.startswith("tls://127.0.0.1:")  # TLS by default
        said = dev.wait_for("mesh dev up is pid ", within=30)  # what to stop it with
        assert said.split()[5].rstrip(":") == str(dev.proc.pid), said
        env = env_file(folder)
        assert env["MESH_NATS_URL"] == url
        assert env["MESH_CA"] == str(folder.resolve() / "tls" / "ca.pem")
        assert env["MESH_DIR"] == str(folder.resolve())
        assert os.stat(folder / "tls" / "ca.key").st_mode & 0o777 == 0o600
        creds = env["MESH_CREDS"]
        assert creds == str(folder / "creds" / "admin.creds")
        assert os.stat(creds).st_mode & 0o777 == 0o600
        seed = Path(creds).read_text()

        # Without the CA, no TLS connection; with it but without credentials, none either.
        unknown = mesh_cli("status", nats_url=url)
        assert unknown.returncode == 1
        assert "the mesh's CA is not known" in unknown.stderr
        refused = mesh_cli("--ca", env["MESH_CA"], "status", nats_url=url)
        assert refused.returncode == 1
        assert "refused a connection without credentials" in refused.stderr
        # A shell without the mesh's settings, on its port: told what is missing, not to start one.
        untrusted = mesh_cli("status", nats_url=url.replace("tls://", "nats://"))
        assert untrusted.returncode == 1
        assert untrusted.stderr.strip().endswith(
            "cannot check (certificate verify failed: self-signed certificate in certificate "
            "chain): it needs the mesh's CA "
            "(MESH_CA or --ca) and credentials (MESH_CREDS); with `mesh dev up`, `source "
            "DIR/env` sets both (default DIR: .mesh/dev)"
        ), untrusted.stderr
        for answer in (unknown, refused, untrusted):
            assert "Traceback" not in answer.stderr and len(answer.stderr.splitlines()) == 1

        # Its console asks who you are: the token its line prints, nothing without it.
        line = next(line for line in dev.seen if line.startswith("console "))
        shape = r"console http://127\.0\.0\.1:(\d+)/\?token=([\w-]{43}) \(read-only: .*, pid \d+\)"
        console = re.fullmatch(shape, line)
        assert console, line
        page = f"http://127.0.0.1:{console.group(1)}/"
        assert _http_status(page) == 401
        assert _http_status(page, {"Authorization": f"Bearer {console.group(2)}"}) == 200

        nodes = ok_json(mesh_cli("--json", "nodes", nats_url=url, creds=creds))["nodes"]
        assert [(n["name"], n["tier"], n["up"]) for n in nodes] == [
            ("node-1", 0, True),
            ("node-2", 1, True),
            ("node-3", 2, True),
        ]
        # As a user does: `source DIR/env`, then `mesh machine add` from any folder (MESH_DIR
        # names the mesh: without it, the command looks in ./.mesh/dev).
        script = (
            f"source {shlex.quote(str(folder / 'env'))} && {shlex.join(MESH)} machine add node-9"
        )
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        added = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd="/",
                               env=clean, timeout=60)  # fmt: skip
        assert added.returncode == 0, added.stderr
        assert (folder / "creds" / "hosts" / "node-9.creds").exists()
        assert "the mesh's nats-server admits it now" in added.stdout  # reloaded: it found it

        status = ok_json(mesh_cli("--json", "status", nats_url=url, creds=creds))
        assert status["seat"]["holder"] in ("ctl-1", "ctl-2")
        assert status["seat"]["epoch"] >= 1
        assert len(status["standbys"]) == 1
        first_epoch = status["seat"]["epoch"]

        second = subprocess.run(
            [*MESH, "dev", "up", "--dir", str(folder), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 1
        assert "in use" in second.stderr and str(folder) in second.stderr
        assert "Traceback" not in second.stderr

        dev.proc.send_signal(signal.SIGTERM)
        assert dev.proc.wait(timeout=60) == 0
        assert _running_under(folder) == []
        assert _alive(_pids(dev.seen)) == []
    finally:
        dev.kill()

    again = DevUp(folder)
    try:
        url = again.wait_for("ready ", within=90).split()[1]
        assert Path(creds).read_text() == seed  # the same credentials, still valid
        status = ok_json(mesh_cli("--json", "status", nats_url=url, creds=creds))
        assert status["seat"]["epoch"] > first_epoch  # the store survived the restart
        assert status["nodes"]["total"] == 3
        again.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert again.proc.wait(timeout=60) == 0
        assert _running_under(folder) == []
        assert _alive(_pids(again.seen)) == []
    finally:
        again.kill()
