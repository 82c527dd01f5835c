"""The fleet's tools as a client sees them: the list from the controller (the `tools` verb,
every page followed) and a call at the machine's host (`mesh.host.<name>.tool`), which calls its
tool server. `mesh tools`, `mesh tool call` and `mesh mcp` use these."""

import time
from typing import Any

import anyio
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import subjects, wire
from mesh.client.asking import VerbFailed
from mesh.client.pages import ask_list
from mesh.model import ToolCallReply, ToolCallRequest, ToolEntry, ToolsReply, ToolsRequest

CALL_TIMEOUT = 30.0  # seconds a call may take unless the caller says (the server's own caps it)
ANSWER_GRACE = 5.0  # past a call's limit, for the host's answer to come back
NO_RESPONDERS_FOR = 2.0  # a host that is not subscribed this long is down (or reconnecting)


class ToolCallFailed(VerbFailed):
    """A call with no result: `code` as the host said (not_found, unavailable, timeout, …)."""


async def fleet_tools(
    nc: Client,
    *,
    url: str,
    machine: str | None = None,
    timeout: float = 5.0,
    want: int | None = None,
) -> list[ToolEntry]:
    """Every tool the controller knows of (one machine's), following every page (at most
    `want` of them)."""

    request = ToolsRequest(machine=machine)
    listed = await ask_list(nc, url=url, verb="tools", reply=ToolsReply, request=request,
                            timeout=timeout, want=want)  # fmt: skip
    return listed.tools


async def call_tool(
    nc: Client,
    *,
    machine: str,
    server: str,
    tool: str,
    arguments: dict[str, Any],
    timeout: float,
) -> ToolCallReply:
    """One call, at the machine's host; ToolCallFailed with the host's code when there is no
    result, or `unavailable` for a machine that does not answer. Never retried once the host
    has it: a tool call may change things."""
    subject = subjects.host(machine, "tool")
    body = wire.encode(
        ToolCallRequest(server=server, tool=tool, arguments=arguments, timeout=timeout)
    )
    if len(body) > nc.max_payload:
        raise ToolCallFailed(f"tool call: the request is {len(body)} bytes, more than the NATS "
                             f"server takes ({nc.max_payload})", code="too_large")  # fmt: skip
    patience = time.monotonic() + NO_RESPONDERS_FOR
    pause = 0.05
    while True:
        try:
            msg = await nc.request(subject, body, timeout=timeout + ANSWER_GRACE)
            break
        except NoRespondersError:
            # Nobody subscribed: a machine that is down (or a host reconnecting, for a moment).
            if time.monotonic() + pause > patience:
                raise ToolCallFailed(
                    f"machine {machine} does not answer (is it up? `mesh nodes`)",
                    code="unavailable",
                ) from None
            await anyio.sleep(pause)
            pause = min(pause * 2, 0.5)
        except NatsTimeout:
            raise ToolCallFailed(
                f"machine {machine} did not answer within {timeout + ANSWER_GRACE:g}s "
                "(is it up? `mesh nodes`)",
                code="timeout",
            ) from None
    try:
        return wire.decode_reply(msg.data, ToolCallReply)
    except wire.RemoteError as e:
        raise ToolCallFailed(f"{machine} {server}.{tool}: {e}", code=e.code) from None
