"""A process's output, asked of its host (`mesh.host.<name>.logs`): `mesh logs` and `mesh mcp`
read it here. A host that does not answer is explained as far as the controller knows."""

import argparse
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from mesh import bus, subjects, wire
from mesh.client.asking import VerbFailed, ask
from mesh.model import LogsReply, LogsRequest, NodesReply, NodesRequest


async def read_logs(nc: Any, machine: str, req: LogsRequest, timeout: float) -> LogsReply:
    """One read; VerbFailed, in words, when the host refuses it or does not answer."""
    subject = subjects.host(machine, "logs")
    try:
        data = await bus.request(
            nc, subject, wire.encode(req), deadline=time.monotonic() + timeout + req.wait,
            attempt_timeout=1.0 + req.wait,
        )  # fmt: skip
    except bus.NoAnswer:
        raise VerbFailed(await _why_silent(nc, machine, subject, timeout)) from None
    try:
        return wire.decode_reply(data, LogsReply)
    except wire.RemoteError as e:
        raise VerbFailed(f"logs: {e}", code=e.code) from None


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


# `--since` (and mesh mcp's `since`): a while ago or a time, as the host's stamps spell it.
_AGO = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d)")
_AT = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d(?::\d\d(?:\.\d+)?)?)(Z|[+-]\d\d:\d\d)")
STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (.*)", re.S)


def since(text: str) -> str:
    """`--since`: a time as the host's stamps spell it, from a while ago or a time."""
    if m := _AGO.fullmatch(text):
        seconds = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        at = datetime.now(UTC) - timedelta(seconds=min(seconds, 10 * 365 * 86400))
    elif _AT.fullmatch(text):
        at = datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    else:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is neither a while (90s, 15m, 2h, 7d) nor a time (2026-12-07T19:40:00Z)"
        )
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"
