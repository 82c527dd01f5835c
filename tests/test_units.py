"""systemd units for the mesh's pieces (programs/units.py): `mesh init` writes one per
nats-server, PostgreSQL and its host agent, from the argv and environment it started them with;
`mesh machine add` prints one for the new machine's host. Each is checked by
`systemd-analyze verify` where it exists; ExecStart= is read back with systemd's quoting rules
and compared with the argv the piece runs with; a host agent says READY=1 to systemd once it has
registered."""

import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import MESH, already, ask, await_until

from mesh.embedded import natsd, postgres
from mesh.embedded.children import stop_supervised
from mesh.entry import command
from programs import units
from programs.units import Unit

# its hosts deploy services/controller (helpers.seeds_container)
pytestmark = pytest.mark.deploys_controller

AWKWARD = [
    "/usr/bin/printf",
    "plain",
    "two words",
    "",
    'a "quoted" word',
    "it's",
    "back\\slash\\",
    "$HOME and ${HOME}",
    "100% %n %%",
    ";",
    "\\;",
    "line\nbreak\ttab\rcr",
    "bell\a esc\x1b del\x7f",
    "ünïcødé ✓",
    "-",
    "@",
]


def test_exec_start_reads_back_as_the_argv_it_was_written_from() -> None:
    line = units.exec_line(AWKWARD)
    assert units.split(line) == AWKWARD
    assert "\n" not in line  # one line of the unit file, whatever the argv holds
    for word in AWKWARD:  # each word alone too: quoting never leans on its neighbours
        assert units.split(units.exec_line(["/bin/true", word])) == ["/bin/true", word]
    # a program not named by a path is found on systemd's search path, through env
    assert units.split(units.exec_line(["mesh", "host", "run"])) == [
        "/usr/bin/env", "mesh", "host", "run",
    ]  # fmt: skip
    assert units.split('/bin/echo  "a b"   c') == ["/bin/echo", "a b", "c"]  # systemd's spacing


def test_split_refuses_what_systemd_would_expand() -> None:
    for line in ("/bin/echo $HOME", "/bin/echo %n", '/bin/echo "open'):
        with pytest.raises(units.UnitError):
            units.split(line)


def _sections(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections: each key with every value it was given, in order."""
    found: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("["):
            section = found.setdefault(line.strip("[]"), {})
        elif "=" in line:
            key, _, value = line.partition("=")
            section.setdefault(key, []).append(value)
    return found


def test_a_host_agent_unit_is_notify_and_never_stops_its_processes() -> None:
    argv = command(
        "host", "run", "--name", "node-2", "--creds", "/var/lib/mesh/creds/hosts/node 2.creds"
    )
    unit = units.host_unit("node-2", argv, env={"MESH_NATS_URL": "tls://10.0.0.1:4222"})
    s = _sections(units.render(unit))
    service = s["Service"]
    assert unit.name == "mesh-host-node-2.service"
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["all"]
    assert service["KillMode"] == ["process"] and service["Restart"] == ["always"]
    assert units.split(service["ExecStart"][0]) == argv
    assert service["Environment"] == ['"MESH_NATS_URL=tls://10.0.0.1:4222"']
    assert s["Unit"]["After"] == ["network-online.target"]
    assert s["Unit"]["Wants"] == ["network-online.target"]
    assert s["Install"]["WantedBy"] == ["multi-user.target"]
    assert "User" not in service  # root: it creates the processes' accounts


def test_a_piece_keeps_the_mesh_settings_of_its_environment_and_nothing_else() -> None:
    env = {"MESH_NATS_URL": "tls://127.0.0.1:4222", "MESH_CREDS": "/x/admin.creds",
           "PATH": "/usr/bin", "TERM": "xterm", "SSH_AUTH_SOCK": "/tmp/s", "PYTHONUNBUFFERED": "1",
           "MESH_DIR": "/var/lib/mesh"}  # fmt: skip
    # each piece's own credentials are in its argv: the admin's (MESH_CREDS) stay out
    assert units.service_env(env) == {
        "MESH_NATS_URL": "tls://127.0.0.1:4222", "PATH": "/usr/bin", "PYTHONUNBUFFERED": "1",
        "MESH_DIR": "/var/lib/mesh",
    }  # fmt: skip
    assert units.service_env(None) == {}


VERIFY = shutil.which("systemd-analyze")
needs_verify = pytest.mark.skipif(
    VERIFY is None, reason="systemd-analyze is not installed (Debian's package systemd has it)"
)


def _verify(paths: list[Path]) -> None:
    """systemd-analyze verify accepts each unit: its syntax, and its program exists."""
    assert VERIFY is not None
    for path in paths:
        done = subprocess.run([VERIFY, "verify", str(path)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        ours = [line for line in done.stderr.splitlines() if path.name in line]
        assert done.returncode == 0 and not ours, f"{path}:\n{path.read_text()}\n{done.stderr}"


@needs_verify
def test_systemd_analyze_verify_accepts_each_kind_of_unit(tmp_path: Path) -> None:
    account = None if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    kinds = [
        Unit(name="mesh-nats-n1.service", description="mesh nats-server n1 (100% test)",
             argv=natsd.argv(tmp_path / "nats dir" / "nats.conf"), user=account,
             env={"MESH_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}),
        Unit(name="mesh-postgres.service", description="mesh PostgreSQL",
             argv=postgres.argv(tmp_path / "pg", port=5432), user=account or "root",
             cwd=str(tmp_path / "pg"), kill_signal="SIGINT"),
        Unit(name="mesh-postgres-front.service", description="mesh PostgreSQL's TLS front",
             argv=postgres.front_argv(tmp_path / "pg", port=5432, socket=tmp_path / "pg-socket"),
             user=account, after=["mesh-postgres.service"]),
        units.host_unit("node-1", command("host", "run", "--name", "node-1",
                                           "--root", str(tmp_path / "a $root"))),
        units.host_unit("node-2", ["mesh", "host", "run", "--name", "node-2"]),  # machine add's
        Unit(name="mesh-awkward.service", description="every kind of word", argv=AWKWARD,
             env={"MESH_X": "$HOME 100% \"q\" \\"}),
    ]  # fmt: skip
    _verify(units.write(kinds, tmp_path / "units"))


@needs_verify
@pytest.mark.slow
async def test_init_prints_units_that_start_each_piece_as_it_runs(made) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    done = subprocess.run(
        [*MESH, "init", "--dir", str(made), "--port", "0", "--name", "ctl-machine",
         "--print-units"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    folder = made.resolve()
    written = sorted((folder / "units").glob("*.service"))
    assert [p.name for p in written] == [
        "mesh-host-ctl-machine.service", "mesh-nats-n1.service", "mesh-postgres-front.service",
        "mesh-postgres.service",
    ]  # fmt: skip
    for path in written:  # printed as written, each under its file's name
        assert f"# {path}\n{path.read_text()}" in done.stdout
    assert "--print-units: not installed" in done.stdout
    _verify(written)

    pids = json.loads((folder / "mesh.json").read_text())["pids"]
    pieces = ("ctl-machine", "nats-n1", "postgres-front", "postgres")
    for path, piece in zip(written, pieces, strict=True):
        service = _sections(path.read_text())["Service"]
        running = Path(f"/proc/{pids[piece]}/cmdline").read_bytes().decode().split("\0")[:-1]
        assert units.split(service["ExecStart"][0]) == running, path.name  # the very argv
        environ = dict(
            line.split("=", 1)
            for line in Path(f"/proc/{pids[piece]}/environ").read_bytes().decode().split("\0")
            if "=" in line
        )
        for value in service.get("Environment", []):
            key, _, setting = units.split(f"/x {value}")[1].partition("=")
            assert environ.get(key) == setting, (path.name, key)
        assert service["Restart"] == ["always"]
        owner = pwd.getpwuid(os.stat(f"/proc/{pids[piece]}").st_uid).pw_name
        assert service.get("User", ["root"]) == [owner], path.name  # runs as it runs now
    host = _sections((folder / "units" / "mesh-host-ctl-machine.service").read_text())
    assert host["Service"]["Type"] == ["notify"] and host["Service"]["KillMode"] == ["process"]
    assert host["Unit"]["After"] == [
        "network-online.target mesh-nats-n1.service mesh-postgres.service "
        "mesh-postgres-front.service"
    ]
    front = _sections((folder / "units" / "mesh-postgres-front.service").read_text())
    assert front["Unit"]["After"] == ["network.target mesh-postgres.service"]

    # A new machine's host: the printed command, as a unit beside it.
    added = subprocess.run([*MESH, "--json", "machine", "add", "node-2", "--dir", str(folder)],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert added.returncode == 0, added.stderr
    reply = json.loads(added.stdout)
    unit = folder / reply["unit_name"]
    unit.write_text(reply["unit"])
    _verify([unit])
    service = _sections(reply["unit"])["Service"]
    assert units.split(service["ExecStart"][0]) == ["/usr/bin/env", *shlex.split(reply["command"])]
    assert service["Type"] == ["notify"]
    shown = subprocess.run([*MESH, "machine", "add", "node-3", "--dir", str(folder)],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert shown.returncode == 0 and "[Service]\nType=notify\n" in shown.stdout, shown.stderr

    # A power cut: every process gone, the controller the host ran too. At boot, systemd starts
    # each unit as it says (argv, environment, account, folder), in their order: the mesh is
    # back, though its controller is a process only this host starts, with secrets only a
    # controller gives (the host keeps those it wrote for the declaration it applied).
    for line in (folder / "env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    before = await _status(env)
    assert before is not None
    for pid in pids.values():
        os.killpg(pid, signal.SIGKILL)  # each piece's group: PostgreSQL's backends too
    stop_supervised(folder)
    await await_until(lambda: already(not any(map(_group_alive, pids.values()))), within=30,
                      what="every process of the mesh gone")  # fmt: skip
    # nats-server, PostgreSQL, then the host, each once the one before listens (systemd would
    # start the host again until it connects: Restart=always)
    # (PostgreSQL on its Unix socket alone, its TLS front on the store's port after it)
    nats_port, store_port = (
        int(url.rsplit(":", 1)[1].split("/")[0])
        for url in (env["MESH_NATS_URL"], env["MESH_DATABASE_URL"].split("?")[0])
    )
    store_socket = postgres.socket_path(postgres.socket_folder(folder / "pg"), store_port)
    up: dict[str, Callable[[], bool] | None] = {
        "mesh-nats-n1.service": lambda: _listens(nats_port),
        "mesh-postgres.service": store_socket.exists,
        "mesh-postgres-front.service": lambda: _listens(store_port),
        "mesh-host-ctl-machine.service": None,
    }
    for name, listening in up.items():
        path = folder / "units" / name
        log = folder / "logs" / f"{path.stem}.boot.log"
        booted = _boot(path, log=log)
        if listening is not None:
            await await_until(
                lambda ready=listening, b=booted: already(ready() or b.poll() is not None),
                within=30,
                what=name,
            )
            assert booted.poll() is None, f"{path.name} exited: {log.read_text()[-2000:]}"
    after = await await_until(lambda: _status(env), within=120, what="the mesh after a reboot")
    assert after["seat"]["pid"] != before["seat"]["pid"]  # a new controller process


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


async def _status(env: dict[str, str]) -> dict | None:
    """`mesh status` when it names a seat and one machine up."""
    done = subprocess.run([*MESH, "--json", "status"], capture_output=True, text=True,
                          timeout=30, env=env)  # fmt: skip
    status = json.loads(done.stdout) if done.returncode == 0 else {}
    return status if status.get("seat") and status["nodes"]["up"] == 1 else None


def _boot(path: Path, *, log: Path) -> subprocess.Popen:
    """Start a unit's command as systemd would: its argv, environment, account and folder."""
    service = _sections(path.read_text())["Service"]
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for value in service.get("Environment", []):
        key, _, setting = units.split(f"/x {value}")[1].partition("=")
        env[key] = setting
    user = service.get("User", [None])[0]
    ours = user is None or user == pwd.getpwuid(os.geteuid()).pw_name  # no account to drop to
    account = {} if ours else {"user": user, "group": user, "extra_groups": []}
    return subprocess.Popen(
        units.split(service["ExecStart"][0]), env=env, stdin=subprocess.DEVNULL,
        cwd=service.get("WorkingDirectory", ["/"])[0], stdout=open(log, "ab"),
        stderr=subprocess.STDOUT, start_new_session=True, **account,
    )  # fmt: skip


async def test_a_host_tells_systemd_it_is_ready_once_registered(
    monkeypatch, nc, start_controller, start_host
) -> None:
    where = f"@mesh-test-notify-{uuid.uuid4().hex}"  # abstract: no path length to mind
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + where[1:])
    listener.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", where)
    try:
        start_controller("ctl-a")
        agent = start_host("node-1", "--tier", "0")

        async def said():
            try:
                return listener.recv(4096).decode()
            except BlockingIOError:
                return None

        message = await await_until(said, within=30, what="the host to notify systemd")
        assert message == f"MAINPID={agent.pid}\nREADY=1"
        status = await ask(nc, "mesh.host.node-1.status")
        assert status["registered"] is True  # ready only once registered
    finally:
        listener.close()
