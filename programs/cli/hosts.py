"""`mesh logs MACHINE PROCESS [-f]`: a process's output, asked of its host."""

import argparse
import signal
import sys
import time
from typing import Any

import anyio

from mesh import bus, subjects, wire
from mesh.client.asking import VerbFailed, ask, connected
from mesh.model import LogsReply, LogsRequest, NodesReply, NodesRequest
from mesh.names import check_name
from programs.cli.client import CliError, where

# How long a follower's request may wait at the host for new output: the host answers the
# moment there is some, so `-f` asks once per chunk of output, and once per this while idle.
FOLLOW_WAIT = 20.0


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    logs = verbs.add_parser("logs", parents=[common], help="a process's output, from its host")
    logs.add_argument("machine")
    logs.add_argument("process")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new output")


async def _read(nc: Any, machine: str, req: LogsRequest, timeout: float) -> LogsReply:
    subject = subjects.host(machine, "logs")
    try:
        data = await bus.request(
            nc, subject, wire.encode(req), deadline=time.monotonic() + timeout + req.wait,
            attempt_timeout=1.0 + req.wait,
        )  # fmt: skip
    except bus.NoAnswer:
        raise CliError(await _why_silent(nc, machine, subject, timeout)) from None
    try:
        return wire.decode_reply(data, LogsReply)
    except wire.RemoteError as e:
        raise CliError(f"logs: {e}") from None


async def _why_silent(nc: Any, machine: str, subject: str, timeout: float) -> str:
    """Why a host did not answer, as far as the controller knows: no such machine, or down."""
    said = f"host {machine} did not answer on {subject}"
    try:
        known = await ask(nc, url="", verb="nodes", reply=NodesReply, timeout=timeout,
                          body=wire.encode(NodesRequest(names=[machine])))  # fmt: skip
    except VerbFailed:  # no controller either: say what is known
        return f"{said}; is it up? (`mesh nodes`)"
    if not known.nodes:
        return f"machine {machine} is not known to this mesh (`mesh nodes` lists those it knows)"
    if not known.nodes[0].up:
        return f"{said}: machine {machine} is down (`mesh nodes`)"
    return f"{said}; it is up: is its host agent running? (`mesh nodes`)"


async def cmd_logs(args: argparse.Namespace) -> None:
    check_name(args.machine, field="MACHINE")
    check_name(args.process, field="PROCESS")
    url, creds = where(args)
    timeout = getattr(args, "timeout", 5.0)
    interrupted = False
    async with connected(url=url, creds=creds, what="logs") as nc:
        reply = await _read(nc, args.machine, LogsRequest(process=args.process), timeout)
        sys.stdout.write(reply.data)
        sys.stdout.flush()
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
                reply = await _read(
                    nc, args.machine,
                    LogsRequest(process=args.process, offset=reply.offset, wait=FOLLOW_WAIT),
                    timeout,
                )  # fmt: skip
                sys.stdout.write(reply.data)
                sys.stdout.flush()
    if interrupted:
        sys.exit(130)


COMMANDS = {("logs",): cmd_logs}
