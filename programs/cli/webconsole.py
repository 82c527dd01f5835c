"""`mesh console [--listen ADDR:PORT] [--socket PATH]`: the fleet as a live web page
(programs/console/)."""

import argparse
import os
from pathlib import Path
from typing import Any

from programs.cli.args import listen
from programs.cli.client import where

DEFAULT_LISTEN = "127.0.0.1:8080"


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    console = verbs.add_parser(
        "console", parents=[common], help="the fleet as a live web page (read-only)"
    )
    console.add_argument(
        "--listen", type=listen, default=None, metavar="ADDR:PORT",
        help=f"where the page is served ({DEFAULT_LISTEN}, unless --socket alone is given; PORT "
        "alone: on 127.0.0.1); it asks for the token printed with its URL",
    )  # fmt: skip
    console.add_argument(
        "--socket", type=Path, default=None, metavar="PATH",
        help="serve on a unix socket of mode 0600 too (alone without --listen): whoever can "
        "open it needs no token",
    )  # fmt: skip


async def cmd_console(args: argparse.Namespace) -> None:
    from programs.console.server import TOKEN_ENV, check_token, run

    url, creds = where(args)
    listen_on = args.listen
    if listen_on is None and args.socket is None:
        listen_on = listen(DEFAULT_LISTEN)
    # Whoever starts the console may choose its token (`mesh dev up` does, to print the URL);
    # in the environment, never on the command line, which every account sees (ps).
    given = os.environ.get(TOKEN_ENV)
    token = check_token(given) if given is not None else None
    await run(url=url, creds=creds, listen=listen_on, socket_path=args.socket, token=token)


COMMANDS = {("console",): cmd_console}
