"""A process's output, asked of its host (`mesh.host.<name>.logs`): `mesh logs` and `mesh mcp`
read it here. A host that does not answer is explained as far as the controller knows."""

import time
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
