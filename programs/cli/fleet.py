"""`mesh status` and `mesh nodes`: the seat and the machines, as the controller answers them."""

import argparse
from typing import Any

from mesh.model import NodesReply, NodesRequest, StatusReply
from programs.cli import render
from programs.cli.args import LIMIT_HELP, count
from programs.cli.client import listed, verb
from programs.cli.output import console, print_json, whole


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    verbs.add_parser("status", parents=[common], help="the seat, standbys, plan, node counts")
    nodes = verbs.add_parser("nodes", parents=[common], help="every machine and its state")
    nodes.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)


async def cmd_status(args: argparse.Namespace) -> None:
    s = await verb(args, "status", StatusReply)
    print_json(s) if args.json else render.status(console(), s)


async def cmd_nodes(args: argparse.Namespace) -> None:
    r = await listed(args, "nodes", NodesReply, NodesRequest(), want=args.limit)
    print_json(whole(r)) if args.json else render.nodes(console(), r, want=args.limit)


COMMANDS = {("status",): cmd_status, ("nodes",): cmd_nodes}
