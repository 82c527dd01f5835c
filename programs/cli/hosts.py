"""`mesh logs MACHINE PROCESS [-f] [--tail N] [--since D] [--prepare] [--json]`: a process's
output, asked of its host, each line with the time its host read it."""

import argparse
import json
import signal
import sys
from typing import Any

import anyio

from mesh.client.asking import connected
from mesh.client.logs import STAMP, read_logs, since
from mesh.model import LogsRequest
from mesh.names import check_name
from programs.cli.args import count
from programs.cli.client import CliError, where

# How long a follower's request may wait at the host for new output: the host answers the
# moment there is some, so `-f` asks once per chunk of output, and once per this while idle.
FOLLOW_WAIT = 20.0


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    logs = verbs.add_parser("logs", parents=[common], help="a process's output, from its host")
    logs.add_argument("machine")
    logs.add_argument("process")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new output")
    logs.add_argument("--tail", type=count, metavar="N", help="the last N lines")
    logs.add_argument(
        "--since", type=since, metavar="D",
        help="the lines since D ago (90s, 15m, 2h, 7d) or since a time (2026-12-07T19:40:00Z)",
    )  # fmt: skip
    logs.add_argument(
        "--prepare", action="store_true",
        help="the output of its last preparation step (`prepare`), kept by its host",
    )  # fmt: skip


def _lines(data: str) -> list[dict[str, str | None]]:
    """Output as `--json` gives it: each line's time (null: a line written without one) and
    text."""
    found = []
    for line in data.splitlines():
        m = STAMP.fullmatch(line)
        found.append({"at": m.group(1), "text": m.group(2)} if m else {"at": None, "text": line})
    return found


def _show(args: argparse.Namespace, data: str, rest: str = "") -> str:
    """Print `data`; `-f --json`: a line of JSON per whole line of output, as it comes (`rest`,
    a line not yet ended, is held back for the next read: returned)."""
    if args.json and args.follow:
        whole, _, rest = (rest + data).rpartition("\n")
        for line in _lines(whole) if whole else []:
            sys.stdout.write(json.dumps(line) + "\n")
    elif not args.json:
        sys.stdout.write(data)
    sys.stdout.flush()
    return rest


async def cmd_logs(args: argparse.Namespace) -> None:
    check_name(args.machine, field="MACHINE")
    check_name(args.process, field="PROCESS")
    if args.tail is not None and args.since is not None:
        raise CliError("--tail and --since: one or the other")
    url, creds = where(args)
    timeout = getattr(args, "timeout", 5.0)
    interrupted = False
    first = LogsRequest(process=args.process, tail=args.tail, since=args.since,
                        prepare=args.prepare)  # fmt: skip
    async with connected(url=url, creds=creds, what="logs") as nc:
        reply = await read_logs(nc, args.machine, first, timeout)
        data = reply.data
        while args.since is not None and reply.data and not args.follow:  # to the end
            reply = await read_logs(
                nc,
                args.machine,
                LogsRequest(process=args.process, offset=reply.offset, prepare=args.prepare),
                timeout,
            )
            data += reply.data
        if args.json and not args.follow:
            print(json.dumps({"machine": args.machine, "process": args.process,
                              "offset": reply.offset, "lines": _lines(data)}))  # fmt: skip
            return
        rest = _show(args, data)
        if not args.follow:
            return
        async with anyio.create_task_group() as tg:

            async def until_interrupted() -> None:
                # Ctrl-C (or SIGTERM) ends the request waiting at the host at once: the
                # follow loop is cancelled here rather than by the event loop's own handler.
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                    async for _ in received:
                        interrupted = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(until_interrupted)
            while True:  # from the offset the last reply ended at: nothing lost or repeated
                reply = await read_logs(
                    nc, args.machine,
                    LogsRequest(process=args.process, offset=reply.offset, wait=FOLLOW_WAIT,
                                prepare=args.prepare),
                    timeout,
                )  # fmt: skip
                rest = _show(args, reply.data, rest)
    if interrupted:
        sys.exit(130)


COMMANDS = {("logs",): cmd_logs}
