"""`mesh handover`: ask the seat's holder to hand over, then follow the seat until another
controller holds it, so the command says what happened, not what was asked: the holder keeps the
seat when no standby answers in time (a standby cut off from the bus must not take it)."""

import argparse
from typing import Any

import anyio
import msgspec

from mesh.client.asking import ask, connected
from mesh.client.changes import CHANGE_TIMEOUT
from mesh.model import HandoverReply, StatusReply
from programs.cli.client import CliError, where
from programs.cli.output import console, print_json

# From the holder's answer to the next epoch: a standby says it is ready within 2 s
# (services/controller/seat/handover.py) and takes the seat within a second or two after; a loaded
# machine takes longer. A holder no standby answered keeps the seat and its epoch.
FOLLOW_FOR = 15.0


class HandedOver(msgspec.Struct):
    holder: str  # who held the seat when asked
    to: list[str]  # the standbys that could take it
    now: str  # who holds it now
    epoch: int  # the seat's epoch now
    gap_ms: float | None  # from the old holder's release to the new one's takeover
    message: str


async def cmd_handover(args: argparse.Namespace) -> None:
    url, creds = where(args)
    timeout = getattr(args, "timeout", CHANGE_TIMEOUT)
    async with connected(url=url, creds=creds, what="handover") as nc:

        async def status() -> StatusReply:
            return await ask(nc, url=url, verb="status", reply=StatusReply, timeout=timeout)

        before = await status()
        asked = await ask(nc, url=url, verb="handover", reply=HandoverReply, timeout=timeout,
                          attempt=timeout)  # fmt: skip
        epoch = before.seat.epoch if before.seat else 0
        now = before
        with anyio.move_on_after(FOLLOW_FOR):
            while not (now.seat and now.seat.epoch > epoch):
                await anyio.sleep(0.25)  # ok: polling the seat, with a deadline
                now = await status()
    seat = now.seat
    if seat is None or seat.epoch <= epoch:
        raise CliError(
            f"{asked.holder} kept the seat: no standby answered the handover within "
            f"{FOLLOW_FOR:g}s (its log says why)"
        )
    if seat.holder == asked.holder:
        raise CliError(
            f"no standby took the seat: {asked.holder} let it go and took it again "
            f"(epoch {seat.epoch}); see the standbys' logs"
        )
    gap = now.handover.gap_ms if now.handover and now.handover.planned else None
    done = HandedOver(
        holder=asked.holder, to=asked.to, now=seat.holder, epoch=seat.epoch, gap_ms=gap,
        message=f"{asked.holder} handed the seat to {seat.holder} (epoch {seat.epoch}"
        + (f", gap {gap:g} ms)" if gap is not None else ")"),
    )  # fmt: skip
    print_json(done) if args.json else console().print(done.message)


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    verbs.add_parser("handover", parents=[common], help="ask the seat's holder to hand over")


COMMANDS = {("handover",): cmd_handover}
