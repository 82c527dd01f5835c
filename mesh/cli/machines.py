"""`mesh machine add NAME` / `mesh machine remove NAME`: a host's credentials, issued into and
revoked from a mesh's folder on this machine (the one `mesh dev up --dir` made), followed by a
reload of the mesh's nats-server so the change counts at once."""

import argparse
import shlex
from pathlib import Path
from typing import Any

import msgspec

from mesh import config
from mesh.auth import registry, server
from mesh.cli.args import Parser
from mesh.cli.client import CliError
from mesh.cli.output import print_json
from mesh.meshdir import DEFAULT_DIR, MeshDir
from mesh.names import check_name


class Added(msgspec.Struct):
    name: str
    creds: str  # the credentials file, mode 0600: copy it to the machine, keep it secret
    command: str  # what starts the host with it
    reloaded: bool  # the running server admits it now (else: at its next start)


class Removed(msgspec.Struct):
    name: str
    revoked: str  # the credentials file that no longer works (deleted)
    reloaded: bool


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    machine = verbs.add_parser("machine", parents=[common], help="machines' credentials")
    machine_verbs = machine.add_subparsers(
        dest="machine_command", metavar="COMMAND", parser_class=Parser
    )
    machine_verbs.required = True
    add = machine_verbs.add_parser(
        "add", parents=[common], help="issue a new host's credentials and print its command"
    )
    add.add_argument("name", metavar="NAME")
    add.add_argument(
        "--builder", action="store_true", help="it may store build outputs (label it builder=true)"
    )
    remove = machine_verbs.add_parser(
        "remove", parents=[common], help="revoke a host's credentials"
    )
    remove.add_argument("name", metavar="NAME")
    for p in (add, remove):
        p.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"the mesh's folder ({DEFAULT_DIR})"
        )


def _mesh(args: argparse.Namespace) -> MeshDir:
    folder = MeshDir(args.dir)
    if not folder.users.exists():
        raise CliError(
            f"no mesh credentials in {folder.root} (no {folder.users}); "
            f"`mesh dev up --dir {args.dir}` makes a mesh there"
        )
    return folder


def _reload(folder: MeshDir) -> bool:
    try:
        server.reload(folder.pid_file)
    except server.ServerNotRunning:
        return False
    return True


async def cmd_machine_add(args: argparse.Namespace) -> None:
    name = check_name(args.name, field="NAME")
    folder = _mesh(args)
    with registry.locked(folder) as users:
        if users.get("host", name) is not None:
            raise CliError(
                f"machine {name} already has credentials ({folder.creds_file('host', name)}); "
                f"`mesh machine remove {name}` revokes them, then add it again for new ones"
            )
        path = users.issue("host", name, builder=args.builder)
        users.save()
    reloaded = _reload(folder)
    url = folder.nats_url() or config.nats_url(getattr(args, "nats_url", None))
    argv = ["mesh", "host", "run", "--name", name, "--creds", str(path), "--nats-url", url]
    if args.builder:
        argv += ["--label", "builder=true"]
    added = Added(name=name, creds=str(path), command=shlex.join(argv), reloaded=reloaded)
    if args.json:
        print_json(added)
        return
    print(f"machine {name}: credentials in {path} (mode 0600; copy it to the machine, secretly)")
    print(
        "the mesh's nats-server admits it now"
        if reloaded
        else f"no nats-server is running for {folder.root}: it admits {name} once started"
    )
    print(f"start the host with:\n  {added.command}")


async def cmd_machine_remove(args: argparse.Namespace) -> None:
    name = check_name(args.name, field="NAME")
    folder = _mesh(args)
    with registry.locked(folder) as users:
        try:
            path = users.revoke("host", name)
        except registry.AuthError:
            raise CliError(f"machine {name} has no credentials in {folder.root}") from None
        users.save()
    reloaded = _reload(folder)
    removed = Removed(name=name, revoked=str(path), reloaded=reloaded)
    if args.json:
        print_json(removed)
        return
    print(f"machine {name}: credentials revoked ({path} deleted)")
    print(
        "the mesh's nats-server reloaded: it has closed the machine's connections"
        if reloaded
        else f"no nats-server is running for {folder.root}: it will not admit {name}"
    )


COMMANDS = {("machine", "add"): cmd_machine_add, ("machine", "remove"): cmd_machine_remove}
