"""`mesh console [--listen HOST:PORT]`: the fleet as a live web page (programs/console/)."""

import argparse
from typing import Any

from programs.cli.client import CliError, where

DEFAULT_LISTEN = "127.0.0.1:8080"


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    console = verbs.add_parser(
        "console", parents=[common], help="the fleet as a live web page (read-only)"
    )
    console.add_argument(
        "--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
        help=f"where the page is served ({DEFAULT_LISTEN}; port 0: any free one)",
    )  # fmt: skip


async def cmd_console(args: argparse.Namespace) -> None:
    from programs.console.server import parse_listen, run

    try:
        listen = parse_listen(args.listen)
    except ValueError as e:
        raise CliError(f"--listen: {e}") from None
    url, creds = where(args)
    await run(url=url, creds=creds, listen=listen)


COMMANDS = {("console",): cmd_console}
