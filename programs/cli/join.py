"""`mesh join TOKEN [--name NAME] [--dir DIR]`: this machine joins a mesh with one command, as
`k3s agent --token` or `kubeadm join` does (docs/operations.md, "Mesh on three machines").

In order, each step said in a line, nothing sent before the CA is checked:
1. the token read (mesh/tokens.py), another mesh's settings in the environment set aside;
2. the servers' CA found in their TLS handshake and checked against the token's fingerprint;
3. the machine's own key made (DIR/keys/machine.nk, kept for a second run), its public half
   sent with the token's secret, as the token's bearer (mesh/client/join.py): the controller
   places the machine and signs its credentials;
4. its credentials file written (DIR/creds/hosts/NAME.creds: the JWT, its seed, the CA, the
   servers, the controllers' key), and its host agent started: as root where systemd runs, a unit
   installed, enabled and started (`systemctl start` returns once the agent says it registered);
   otherwise a detached process, waited on the same way (it tells us on NOTIFY_SOCKET).

Interrupted, it is run again with the same token: the key is kept, a controller that admitted
it answers again without another use, a host already running is left as it is. A machine that
has joined says so, and what to remove to join again.
"""

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec

from mesh.auth import creds
from mesh.auth.policy import User, inbox
from mesh.auth.trust import TrustError, key_file
from mesh.client.join import JoinError, ask_to_join, mesh_ca
from mesh.embedded.children import spawn
from mesh.entry import command
from mesh.meshdir import MeshDir
from mesh.model import labels_said
from mesh.names import InvalidName, check_name
from mesh.tokens import TokenError, decode
from programs.cli.client import CliError
from programs.cli.output import print_json
from programs.init import default_dir, forget_another_mesh
from programs.units import UnitError, host_unit, install, main_pid, systemctl, systemd_runs

READY_WITHIN = 90.0  # seconds for the host to register (a Python start on a loaded machine)
STATE = "join.json"


class Joined(msgspec.Struct):
    """What `mesh join` did (DIR/join.json, and its `--json`)."""

    name: str
    token: str  # the token's id
    tier: int
    labels: dict[str, str]
    control: bool
    creds: str
    dir: str
    unit: str | None = None  # the host's systemd unit
    pid: int | None = None  # the host's process (without systemd)


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    join = verbs.add_parser(
        "join", parents=[common], help="this machine joins a mesh with a token (mesh token create)"
    )
    join.add_argument("token", metavar="TOKEN")
    join.add_argument("--name", help="this machine's name in the mesh (its host name)")
    join.add_argument("--dir", type=Path, help="its folder (/var/lib/mesh as root, else ~/.mesh)")
    join.add_argument(
        "--root", type=Path,
        help="confine its host agent to this folder (as `mesh host run --root`: to try it, or "
        "for tests; without root it is DIR/host)",
    )  # fmt: skip


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _name(given: str | None) -> str:
    if given is not None:
        try:
            return check_name(given, field="--name")
        except InvalidName as e:
            raise CliError(str(e)) from None
    host = socket.gethostname().split(".")[0]
    try:
        return check_name(host, field="name")
    except InvalidName:
        raise CliError(
            f"this machine's host name {host!r} is not a machine name (letters, digits, '-', "
            "'_'): give one with --name"
        ) from None


def _refuse_joined(folder: MeshDir) -> None:
    state = folder.root / STATE
    if state.exists():
        try:
            was = msgspec.json.decode(state.read_bytes(), type=Joined)
        except (OSError, msgspec.DecodeError):
            raise CliError(f"{state} is damaged: remove {folder.root} to join again") from None
        raise CliError(
            f"this machine joined a mesh already, as {was.name} ({folder.root}): to join again, "
            f"`mesh machine remove {was.name}` on the mesh, stop its host, and remove "
            f"{folder.root}"
        )
    if folder.users.exists():
        raise CliError(
            f"{folder.root} holds a mesh of its own (mesh init): join with another --dir"
        )


async def cmd_join(args: argparse.Namespace) -> None:
    try:
        token = decode(args.token)
    except TokenError as e:
        raise CliError(str(e)) from None
    name = _name(args.name)
    folder = MeshDir(args.dir or default_dir())
    _refuse_joined(folder)
    forget_another_mesh("mesh join", tell=say)

    pem = await anyio.to_thread.run_sync(mesh_ca, token, abandon_on_cancel=True)
    folder.tls.mkdir(parents=True, exist_ok=True)
    folder.ca.write_text(pem)
    say(f"the servers present the CA the token names (sha256 {token.ca_sha256[:16]}…)")

    try:  # made once: a second run (its answer lost) asks with the same
        key = key_file(folder.nats_keys.parent / "machine.nk", "user")
    except TrustError as e:
        raise CliError(str(e)) from None
    try:
        reply = await ask_to_join(token, ca=folder.ca, machine=name, public=key.public)
    except JoinError as e:
        raise CliError(str(e)) from None
    labels = labels_said(reply.labels)
    say(f"admitted as {name}: tier {reply.tier}, labels {labels}"
        + (" (again: the answer before was lost)" if reply.again else ""))  # fmt: skip

    path = folder.creds_file("host", name)
    host = User(name=name, kind="host", public=key.public)
    creds.write(path, who=host.describe(), seed=key.seed, inbox=inbox(host), ca=pem,
                servers=",".join(token.urls), controller=reply.controller,
                jwt=reply.jwt)  # fmt: skip
    joined = Joined(name=name, token=token.id, tier=reply.tier, labels=reply.labels,
                    control=reply.control, creds=str(path), dir=str(folder.root))  # fmt: skip
    joined = await _start_host(folder, joined, args.root)
    (folder.root / STATE).write_bytes(msgspec.json.format(msgspec.json.encode(joined)) + b"\n")
    if args.json:
        print_json(joined)
        return
    where = f"unit {joined.unit}" if joined.unit else f"pid {joined.pid}"
    print(f"joined the mesh as {name}: its host agent is up ({where}); `mesh nodes` on the mesh "
          "shows it")  # fmt: skip


async def _start_host(folder: MeshDir, joined: Joined, root: Path | None) -> Joined:
    argv = command("host", "run", "--name", joined.name, "--creds", joined.creds)
    if root is not None or os.geteuid() != 0:  # accounts map to this user: its own folder
        argv += ["--root", str(root or folder.root / "host")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    if os.geteuid() == 0 and systemd_runs():
        unit = host_unit(joined.name, argv, env={"PATH": env.get("PATH", "")})
        try:
            install([unit])
            # Type=notify: returns once the agent has registered (or fails, saying so)
            await anyio.to_thread.run_sync(systemctl, "start", unit.name)
        except UnitError as e:
            raise CliError(f"the host agent's unit {unit.name}: {e}") from None
        say(f"host {joined.name} runs under systemd: {unit.name} (enabled: it starts at boot)")
        return msgspec.structs.replace(joined, unit=unit.name, pid=main_pid(unit.name))
    log = folder.root / "logs" / f"host-{joined.name}.log"
    with tempfile.TemporaryDirectory(prefix="mesh-join-") as held:
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        where = str(Path(held) / "notify")
        try:
            notify.bind(where)
            child = await spawn(f"host-{joined.name}", argv, log=log, detached=True,
                                env={**env, "NOTIFY_SOCKET": where})  # fmt: skip
            await _ready(notify, child, log)
        finally:
            notify.close()
    say(f"host {joined.name} started (pid {child.pid}; its log: {log})")
    return msgspec.structs.replace(joined, pid=child.pid)


async def _ready(notify: socket.socket, child: Any, log: Path) -> None:
    """Until the host says READY=1 on `notify` (it has registered); CliError with its log's last
    lines if it exits or does not within READY_WITHIN."""
    notify.setblocking(False)
    with anyio.move_on_after(READY_WITHIN):
        while child.running:
            with anyio.move_on_after(0.5):  # and look at the child again
                await anyio.wait_readable(notify)
                if b"READY=1" in notify.recv(4096):
                    return
        raise CliError(f"the host agent exited ({child.proc.returncode}): {_tail(log)}")
    raise CliError(f"the host agent did not register within {READY_WITHIN:g}s: {_tail(log)}")


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"(no log at {log})"
    return " / ".join(lines[-3:]) or f"(its log {log} is empty)"


COMMANDS = {("join",): cmd_join}
