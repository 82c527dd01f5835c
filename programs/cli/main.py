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
from typing import Any

from mesh import errors, loop
from mesh.errors import MeshError
from programs.cli import (
    certs,
    devcreds,
    fleet,
    handover,
    hosts,
    join,
    machines,
    meshes,
    modules,
    services,
    tokens,
    tools,
    trust,
    versions,
    webconsole,
)
from programs.cli.args import Parser

# Each command module's subcommands, in the order `mesh --help` lists them.
GRAMMAR = (
    fleet, handover, meshes, services, modules, versions, hosts, machines, certs, webconsole,
    tools, trust, tokens, join,
)  # fmt: skip


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
    """The command line's grammar, assembled: each command module adds its own subcommands, in
    the order `mesh --help` lists them."""
    common = _common()
    top = Parser(prog="mesh", parents=[common], description="A fleet controller on NATS.")
    verbs = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    verbs.required = True
    for module in GRAMMAR:
        module.add_parsers(verbs, common)
    return top


COMMANDS: dict[tuple[str, ...], Callable[[argparse.Namespace], Any]] = {
    **fleet.COMMANDS,
    **handover.COMMANDS,
    **meshes.COMMANDS,
    **services.COMMANDS,
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
    # A line per http check of every process (552 of a host's 681 lines): a check's result is
    # said when it changes (services/host/supervisor.py), not each time it is asked.
    logging.getLogger("httpx").setLevel(logging.WARNING)
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
