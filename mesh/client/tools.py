"""The fleet's tools as a client sees them: the list from the controller (the `tools` verb,
every page followed) and a call at the machine's host (`mesh.host.<name>.tool`), which calls its
tool server. `mesh tools`, `mesh tool call` and `mesh mcp` use these.

Names are checked before anything is sent: a machine's name becomes a subject token
(`mesh.host.*.tool` would be a wildcard), a server's is a name as a module declares it, and a
tool's is what its server listed, which no wildcard ever is."""

import re
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
from mesh.names import InvalidName, check_name

CALL_TIMEOUT = 30.0  # seconds a call may take unless the caller says (the server's own caps it)
ANSWER_GRACE = 5.0  # past a call's limit, for the host's answer to come back
NO_RESPONDERS_FOR = 2.0  # a host that is not subscribed this long is down (or reconnecting)
MAX_TOOL_NAME = 128  # as ToolCallRequest takes it (mesh/model.py ToolName)
# Control characters, as ToolName refuses them, and NATS's wildcards: a tool's name never has
# one (MCP's are [A-Za-z0-9._-]), and whoever sends `*` means "any", which no call can be.
_NOT_IN_TOOL_NAME = re.compile(r"[\x00-\x1f\x7f*>]")


class ToolCallFailed(VerbFailed):
    """A call with no result: `code` as the host said (not_found, unavailable, timeout, …)."""


def check_tool_name(value: object, *, field: str = "tool") -> str:
    """Return `value` if it can name a tool, else raise InvalidName naming `field` and it."""
    if not isinstance(value, str):
        raise InvalidName(f"{field}: expected a string, got {type(value).__name__}")
    if value == "":
        raise InvalidName(f"{field}: must not be empty")
    if len(value) > MAX_TOOL_NAME:
        raise InvalidName(
            f"{field}: {value[:20]!r}… is {len(value)} characters, at most {MAX_TOOL_NAME}"
        )
    if _NOT_IN_TOOL_NAME.search(value):
        raise InvalidName(
            f"{field}: {value!r} is not a tool's name: no wildcards '*' '>' or control characters"
        )
    return value


def check_call(*, machine: object, server: object, tool: object) -> None:
    """A call's names, each checked (InvalidName naming the first wrong one)."""
    check_name(machine, field="machine")
    check_name(server, field="server")
    check_tool_name(tool, field="tool")


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
    if machine is not None:
        check_name(machine, field="machine")
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
    has it: a tool call may change things. A name that is not one is `bad_request`, before
    anything is sent."""
    try:
        check_call(machine=machine, server=server, tool=tool)
    except InvalidName as e:
        raise ToolCallFailed(str(e), code="bad_request") from None
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
