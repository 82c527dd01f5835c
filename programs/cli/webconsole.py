"""`mesh console [--listen ADDR:PORT]`: the fleet as a live web page (programs/console/)."""

import argparse
from typing import Any

from programs.cli.args import listen
from programs.cli.client import where

DEFAULT_LISTEN = "127.0.0.1:8080"


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    console = verbs.add_parser(
        "console", parents=[common], help="the fleet as a live web page (read-only)"
    )
    console.add_argument(
        "--listen", type=listen, default=DEFAULT_LISTEN, metavar="ADDR:PORT",
        help=f"where the page is served ({DEFAULT_LISTEN}; PORT alone: on 127.0.0.1)",
    )  # fmt: skip


async def cmd_console(args: argparse.Namespace) -> None:
    from programs.console.server import run

    url, creds = where(args)
    await run(url=url, creds=creds, listen=args.listen)


COMMANDS = {("console",): cmd_console}
