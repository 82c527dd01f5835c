"""`mesh`: parse the command line, run one command, and turn every failure into one line.

`--json` and the connection options are accepted before or after the command
(`mesh --json status` and `mesh status --json`). Failures print `mesh: error: …` on stderr and
exit 1; a traceback is shown only with MESH_DEBUG=1.
"""

import argparse
import logging
import os
import select
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh import config, errors, loop
from mesh.errors import MeshError
from mesh.model import NodesReply, NodesRequest, StatusReply
from mesh.names import check_name
from programs.cli import (
    certs,
    devcreds,
    handover,
    hosts,
    join,
    machines,
    modules,
    render,
    tokens,
    tools,
    trust,
    versions,
    webconsole,
)
from programs.cli.args import LIMIT_HELP, METRICS_HELP, Parser, count, label, listen, tier
from programs.cli.client import CliError, listed, verb
from programs.cli.output import console, print_json, whole


def _common() -> argparse.ArgumentParser:
    """Options every command takes. SUPPRESS lets the same flag appear before or after it."""
    p = argparse.ArgumentParser(add_help=False)
    s = argparse.SUPPRESS
    p.add_argument("--json", action="store_true", default=s, help="print one JSON document")
    p.add_argument("--nats-url", default=s, metavar="URL", help="NATS server (env MESH_NATS_URL)")
    p.add_argument("--creds", default=s, metavar="FILE", help="NATS credentials (env MESH_CREDS)")
    p.add_argument(
        "--ca", default=s, metavar="FILE", help="the mesh's CA certificate (env MESH_CA)"
    )
    p.add_argument(
        "--timeout", type=float, default=s, metavar="S", help="how long to wait for an answer (5)"
    )
    return p


def parser() -> argparse.ArgumentParser:
    """The command line's grammar. Kept whole: it is one declaration of every command and its
    arguments, read top to bottom like `mesh --help`; split, a command would be looked for in
    several places and the order of the help would depend on the order of calls."""
    common = _common()
    top = Parser(prog="mesh", parents=[common], description="A fleet controller on NATS.")
    verbs = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    verbs.required = True

    verbs.add_parser("status", parents=[common], help="the seat, standbys, plan, node counts")
    verbs.add_parser("handover", parents=[common], help="ask the seat's holder to hand over")
    nodes = verbs.add_parser("nodes", parents=[common], help="every machine and its state")
    nodes.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)

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

    ctl = verbs.add_parser("controller", parents=[common], help="the controller service")
    ctl_verbs = ctl.add_subparsers(
        dest="controller_command", metavar="COMMAND", parser_class=Parser
    )
    ctl_verbs.required = True
    ctl_run = ctl_verbs.add_parser("run", parents=[common], help="hold the seat or stand by")
    ctl_run.add_argument("--database-url", metavar="URL", help="PostgreSQL (env MESH_DATABASE_URL)")
    ctl_run.add_argument("--instance", metavar="NAME", help="this controller's name")
    ctl_run.add_argument(
        "--system-creds", metavar="FILE",
        help="the NATS system account's kicker, to close a cut-off holder's connection at a "
        "takeover (env MESH_SYSTEM_CREDS; controllers only)",
    )  # fmt: skip
    ctl_run.add_argument(
        "--secrets-key-file", metavar="F",
        help="the key of the secrets (env MESH_SECRETS_KEY_FILE; $MESH_FILES/secrets.key)",
    )  # fmt: skip
    ctl_run.add_argument(
        "--down-after", type=int, default=3, metavar="N", help="missed beats before down (3)"
    )
    ctl_run.add_argument("--metrics", type=listen, metavar="ADDR:PORT", help=METRICS_HELP)
    # Read by mesh.config.events_kept, which names the flag (or variable) of a bad value.
    ctl_run.add_argument(
        "--events-max-age", metavar="AGE",
        help=f"events older than this are pruned: 90s, 12h, 30d or off "
        f"(env MESH_EVENTS_MAX_AGE; {config.EVENTS_MAX_AGE})",
    )  # fmt: skip
    ctl_run.add_argument(
        "--events-max-count", metavar="N",
        help=f"the newest N events are kept, or off (env MESH_EVENTS_MAX_COUNT; "
        f"{config.EVENTS_MAX_COUNT})",
    )  # fmt: skip
    ctl_run.add_argument(
        "--events-prune-every", metavar="SPAN",
        help=f"how often the holder prunes (env MESH_EVENTS_PRUNE_EVERY; "
        f"{config.EVENTS_PRUNE_EVERY})",
    )  # fmt: skip

    # Read by mesh.config.versions_kept, which names the flag (or variable) of a bad value.
    ctl_run.add_argument(
        "--versions-kept", metavar="N",
        help="the bundles of each module's newest N versions are kept for rollbacks, or off "
        f"(env MESH_VERSIONS_KEPT; {config.VERSIONS_KEPT})",
    )  # fmt: skip
    ctl_run.add_argument(
        "--versions-prune-every", metavar="SPAN",
        help="how often the holder deletes older versions' bundles (env "
        f"MESH_VERSIONS_PRUNE_EVERY; {config.VERSIONS_PRUNE_EVERY})",
    )  # fmt: skip

    ready = ctl_verbs.add_parser(
        "ready", parents=[common], help="exit 0 if this machine's controller holds or stands by"
    )
    ready.add_argument(
        "--file", type=Path, metavar="F", help="its readiness file ($MESH_FILES/ready)"
    )
    migrate = ctl_verbs.add_parser("migrate", parents=[common], help="bring the store's schema up")
    migrate.add_argument("--database-url", metavar="URL", help="PostgreSQL (env MESH_DATABASE_URL)")

    host = verbs.add_parser("host", parents=[common], help="the host agent")
    host_verbs = host.add_subparsers(dest="host_command", metavar="COMMAND", parser_class=Parser)
    host_verbs.required = True
    host_run = host_verbs.add_parser("run", parents=[common], help="run this machine's agent")
    host_run.add_argument("--name", required=True, help="this machine's name")
    # The operator's (mesh machine add --tier --label, mesh tier, mesh label): a mesh with
    # credentials never takes them from a host; one without takes them at a first registration.
    host_run.add_argument(
        "--tier", type=tier, default=None, help="rollout tier 0-9 (a mesh without credentials)"
    )
    host_run.add_argument("--root", type=Path, default=None, help="confine the host to DIR (dev)")
    host_run.add_argument(
        "--label", type=label, action="append", default=[], metavar="K=V",
        help="repeatable (a mesh without credentials)",
    )  # fmt: skip
    host_run.add_argument(
        "--beat", type=float, default=1.0, metavar="S", help="heartbeat interval in seconds (1)"
    )
    host_run.add_argument("--metrics", type=listen, metavar="ADDR:PORT", help=METRICS_HELP)
    # Given by an agent to the new version of itself it starts (services/host/successor.py).
    host_run.add_argument("--successor-fd", type=int, default=None, help=argparse.SUPPRESS)
    modules.add_parsers(verbs, common)
    versions.add_parsers(verbs, common)
    hosts.add_parsers(verbs, common)
    machines.add_parsers(verbs, common)
    certs.add_parsers(verbs, common)
    webconsole.add_parsers(verbs, common)
    tools.add_parsers(verbs, common)
    trust.add_parsers(verbs, common)
    tokens.add_parsers(verbs, common)
    join.add_parsers(verbs, common)
    return top


# --- commands -------------------------------------------------------------------------------


async def cmd_status(args: argparse.Namespace) -> None:
    s = await verb(args, "status", StatusReply)
    print_json(s) if args.json else render.status(console(), s)


async def cmd_nodes(args: argparse.Namespace) -> None:
    r = await listed(args, "nodes", NodesReply, NodesRequest(), want=args.limit)
    print_json(whole(r)) if args.json else render.nodes(console(), r, want=args.limit)


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


async def cmd_controller_ready(args: argparse.Namespace) -> None:
    from services.controller import readiness

    path = args.file or readiness.default_file()
    if path is None:
        raise CliError("no readiness file: pass --file, or run where MESH_FILES is set")
    why = readiness.problem(path)
    if why:
        raise CliError(why)
    if not args.json:
        console().print("ready")


async def cmd_controller_migrate(args: argparse.Namespace) -> None:
    from mesh.store import db
    from mesh.store.migrate import migrate

    database_url = config.database_url(args.database_url)
    if not database_url:
        raise CliError("no database: set MESH_DATABASE_URL or pass --database-url")
    conn = await db.connect(database_url)
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    print_json({"applied": applied}) if args.json else console().print(
        f"migrations applied: {', '.join(map(str, applied))}" if applied else "schema up to date"
    )


async def cmd_controller_run(args: argparse.Namespace) -> None:
    # The command line starts the services; the services never import the command line.
    from services.controller.main import run

    database_url = config.database_url(args.database_url)
    if not database_url:
        raise CliError("no database: set MESH_DATABASE_URL or pass --database-url")
    if args.instance:
        check_name(args.instance, field="--instance")
    # The flags' values first: a mistyped flag is named before what the machine lacks.
    events = config.events_kept(
        max_age=args.events_max_age, max_count=args.events_max_count,
        every=args.events_prune_every,
    )  # fmt: skip
    versions = config.versions_kept(count=args.versions_kept, every=args.versions_prune_every)
    secrets_key = config.secrets_key_file(args.secrets_key_file)
    if not secrets_key:
        raise CliError(
            "no key for the secrets: set MESH_SECRETS_KEY_FILE or pass --secrets-key-file "
            "(mesh dev up and mesh init make DIR/keys/secrets.key)"
        )
    await run(
        nats_url=config.nats_url(
            getattr(args, "nats_url", None), config.creds(getattr(args, "creds", None))
        ),
        database_url=database_url,
        secrets_key=Path(secrets_key),
        instance=args.instance,
        creds=config.creds(getattr(args, "creds", None)),
        system_creds=config.system_creds(args.system_creds),
        signer_file=config.nats_signer_file(),
        down_after=args.down_after,
        metrics_on=args.metrics,
        events=events,
        versions=versions,
    )


async def cmd_host_run(args: argparse.Namespace) -> None:
    from services.host import successor
    from services.host.main import run

    check_name(args.name, field="--name")
    if not 0.05 <= args.beat <= 3600:
        raise CliError(f"--beat: {args.beat:g} is out of range (0.05 to 3600 seconds)")
    await run(
        name=args.name,
        nats_url=config.nats_url(
            getattr(args, "nats_url", None), config.creds(getattr(args, "creds", None))
        ),
        tier=args.tier,
        labels=dict(args.label),
        root=args.root,
        beat_interval=args.beat,
        creds=config.creds(getattr(args, "creds", None)),
        relaunch=successor.relaunch_args(sys.argv[1:]),
        successor_fd=args.successor_fd,
        metrics_on=args.metrics,
    )


COMMANDS: dict[tuple[str, ...], Callable[[argparse.Namespace], Any]] = {
    ("status",): cmd_status,
    ("nodes",): cmd_nodes,
    ("handover",): handover.cmd_handover,
    ("dev", "up"): cmd_dev_up,
    ("init",): cmd_init,
    ("dev", "init"): cmd_dev_init,
    ("controller", "run"): cmd_controller_run,
    ("controller", "ready"): cmd_controller_ready,
    ("controller", "migrate"): cmd_controller_migrate,
    ("host", "run"): cmd_host_run,
    **modules.COMMANDS,
    **versions.COMMANDS,
    **hosts.COMMANDS,
    **machines.COMMANDS,
    **devcreds.COMMANDS,
    **certs.COMMANDS,
    **webconsole.COMMANDS,
    **tools.COMMANDS,
    **trust.COMMANDS,
    **tokens.COMMANDS,
    **join.COMMANDS,
}


# The commands that start processes as other accounts (mesh/loop.py: never on uvloop)
DROPS_ACCOUNTS = {("host", "run"), ("dev", "up"), ("dev", "init"), ("init",)}


def _key(args: argparse.Namespace) -> tuple[str, ...]:
    sub = getattr(args, f"{args.command}_command", None)
    return (args.command, sub) if sub else (args.command,)


def _reader_gone() -> bool:
    """Whether whoever read our output went away (`mesh audit | head`): a pipe with no reader
    polls POLLERR. A broken pipe elsewhere (a socket) is a real error, said as one."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # reconnect chatter; we report outcomes
    if getattr(args, "ca", None):
        # Read where every connection is made (mesh.config.ca), and inherited by what the
        # command starts (a host's processes, dev up's pieces).
        os.environ["MESH_CA"] = args.ca
    key = _key(args)
    command = COMMANDS[key]
    try:
        loop.run(command, args, drops_accounts=key in DROPS_ACCOUNTS)
        sys.stdout.flush()  # here, where a reader gone is handled, not at the interpreter's exit
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as e:
        leaf = errors.leaf(e)
        if isinstance(leaf, SystemExit):
            raise leaf from None
        if isinstance(leaf, KeyboardInterrupt):
            sys.exit(130)
        if isinstance(leaf, BrokenPipeError) and _reader_gone():
            # Nothing to say, and nobody to say it to on stdout; what is left in its buffer must
            # not be flushed at exit (Python would print that it could not). Exit 1, as rich
            # does for the tables (Console.on_broken_pipe): one answer for every output.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        if os.environ.get("MESH_DEBUG"):
            raise
        if isinstance(leaf, MeshError):
            sys.stderr.write(f"mesh: error: {leaf}\n")
        else:
            sys.stderr.write(
                f"mesh: internal error: {type(leaf).__name__}: {leaf} (MESH_DEBUG=1 shows more)\n"
            )
        sys.exit(1)
