"""`mesh init`, `mesh dev up` and `mesh dev init`: the commands that make a mesh (programs/init.py,
programs/dev_up.py). `dev`'s other subcommands are `devcreds.py`'s and `machines.py`'s, given
the subparsers made here."""

import argparse
from pathlib import Path
from typing import Any

from mesh import config
from programs.cli import devcreds, machines
from programs.cli.args import Parser
from programs.cli.client import CliError


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    dev = verbs.add_parser("dev", parents=[common], help="the embedded dev mesh")
    dev_verbs = dev.add_subparsers(dest="dev_command", metavar="COMMAND", parser_class=Parser)
    dev_verbs.required = True
    dev_up = dev_verbs.add_parser(
        "up", parents=[common], help="run NATS, PostgreSQL, two controllers and hosts"
    )
    dev_up.add_argument("--hosts", type=int, default=3, metavar="N", help="number of hosts (3)")
    dev_up.add_argument("--dir", type=Path, default=Path(".mesh/dev"), help="state (.mesh/dev)")
    dev_up.add_argument(
        "--port", type=int, default=None, help="NATS port (4222, or a free one if taken; 0: free)"
    )
    dev_up.add_argument(
        "--nats", type=int, default=1, metavar="N", help="nats-servers in one cluster (1)"
    )
    dev_up.add_argument(
        "--store-standby", action="store_true", help="PostgreSQL with a synchronous standby"
    )
    dev_init = dev_verbs.add_parser(
        "init", parents=[common],
        help="install the controller on running servers and hosts (compose.dev.yaml)",
    )  # fmt: skip
    add = dev_init.add_argument
    add("--hosts", type=int, default=3, metavar="N", help="node-1..N to place, then wait for (3)")
    add("--control", type=int, default=2, metavar="K",
        help="node-1..K run the controller: one holds the seat, the rest stand by (2)")  # fmt: skip
    add("--controller-creds", type=Path, required=True, metavar="FILE",
        help="the controllers' credentials")  # fmt: skip
    add("--database-url", metavar="URL", help="PostgreSQL (env MESH_DATABASE_URL)")
    add("--placed", type=Path, default=Path("/tmp/placed"), metavar="FILE",
        help="written once the machines are placed (/tmp/placed)")  # fmt: skip
    devcreds.add_parser(dev_verbs, common)
    machines.add_dev_parser(dev_verbs, common)

    new = verbs.add_parser(
        "init", parents=[common], help="a new mesh on this machine, its controller a process"
    )
    new.add_argument("--dir", type=Path, default=None,
                     help="where it lives (/var/lib/mesh as root, else ~/.mesh)")  # fmt: skip
    new.add_argument("--name", default=None, help="this machine's name (its hostname)")
    new.add_argument("--port", type=int, default=None, help="NATS port (4222, or a free one)")
    new.add_argument(
        "--address", action="append", default=[], metavar="HOST",
        help="an IP address or DNS name of this machine that other machines reach the servers "
        "at (repeatable; the first is the one the URLs name); without it, loopback only",
    )  # fmt: skip
    new.add_argument(
        "--nats", type=int, default=1, metavar="N", help="nats-servers in one cluster (1)"
    )
    new.add_argument(
        "--print-units", action="store_true",
        help="print the systemd units, never install them (they are printed without systemd)",
    )  # fmt: skip


async def cmd_dev_up(args: argparse.Namespace) -> None:
    from programs.dev_up import up

    await up(
        folder=args.dir, hosts=args.hosts, port=args.port, nats=args.nats,
        store_standby=args.store_standby,
    )  # fmt: skip


async def cmd_dev_init(args: argparse.Namespace) -> None:
    from programs.init import init_running

    if not 1 <= args.control <= args.hosts <= 64:
        raise CliError(f"--control {args.control} --hosts {args.hosts}: "
                       "1 <= control <= hosts <= 64 is needed")  # fmt: skip
    database_url = config.database_url(args.database_url)
    if not database_url:
        raise CliError("no database: set MESH_DATABASE_URL or pass --database-url")
    admin = config.creds(getattr(args, "creds", None))
    if not admin:
        raise CliError("no admin credentials: set MESH_CREDS or pass --creds")
    for flag, path in (("--creds", Path(admin)), ("--controller-creds", args.controller_creds)):
        if not path.is_file():
            raise CliError(f"{flag}: {path} is not a file")
    await init_running(
        url=config.nats_url(getattr(args, "nats_url", None), admin), admin=Path(admin),
        controller=args.controller_creds, database_url=database_url, hosts=args.hosts,
        control=args.control, placed=args.placed, logs=args.placed.parent,
    )  # fmt: skip


async def cmd_init(args: argparse.Namespace) -> None:
    import socket

    from programs.init import default_dir, init

    name = args.name or socket.gethostname().split(".")[0]
    await init(folder=args.dir or default_dir(), name=name, port=args.port, nats=args.nats,
               print_units=args.print_units, addresses=args.address)  # fmt: skip


COMMANDS = {("dev", "up"): cmd_dev_up, ("init",): cmd_init, ("dev", "init"): cmd_dev_init}
