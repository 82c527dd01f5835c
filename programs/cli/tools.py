"""`mesh tools [MACHINE]`, `mesh tool call MACHINE SERVER TOOL --args JSON` and `mesh mcp`: the
fleet's tools from the command line.

The list comes from the controller (the `tools` verb, every page followed); a call goes to the
machine's host directly (`mesh.host.<name>.tool`), which calls its tool server. `mesh mcp`
(programs/mcp/) offers the same tools to an MCP client.
"""

import argparse
import json
import sys
import time
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import subjects, wire
from mesh.model import ToolCallReply, ToolCallRequest, ToolEntry, ToolsReply, ToolsRequest
from mesh.names import check_name
from programs.cli import render
from programs.cli.args import LIMIT_HELP, Parser, count, listen
from programs.cli.client import CliError, ask, connected, every_page, where
from programs.cli.output import console, print_json

CALL_TIMEOUT = 30.0  # seconds a call may take unless --timeout says (the server's own caps it)
ANSWER_GRACE = 5.0  # past a call's limit, for the host's answer to come back
NO_RESPONDERS_FOR = 2.0  # a host that is not subscribed this long is down (or reconnecting)


class ToolCallFailed(CliError):
    """A call with no result: `code` as the host said (not_found, unavailable, timeout, …)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    listing = verbs.add_parser("tools", parents=[common], help="the fleet's tools")
    listing.add_argument("machine", nargs="?", help="one machine's tools")
    listing.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)

    tool = verbs.add_parser("tool", parents=[common], help="call a tool")
    tool_verbs = tool.add_subparsers(dest="tool_command", metavar="COMMAND", parser_class=Parser)
    tool_verbs.required = True
    call = tool_verbs.add_parser(
        "call", parents=[common], help="call one tool of a machine's tool server"
    )
    call.add_argument("machine")
    call.add_argument("server")
    call.add_argument("tool")
    call.add_argument("--args", default="{}", metavar="JSON", help="its arguments ({})")

    mcp = verbs.add_parser(
        "mcp", parents=[common], help="an MCP server (stdio) offering every tool of the fleet"
    )
    mcp.add_argument(
        "--http", type=listen, default=None, metavar="ADDR:PORT",
        help="streamable HTTP on a loopback address instead of stdio (PORT: 127.0.0.1)",
    )  # fmt: skip


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

    async def page(body: ToolsRequest) -> ToolsReply:
        return await ask(nc, url=url, verb="tools", reply=ToolsReply, timeout=timeout,
                         body=wire.encode(body))  # fmt: skip

    return (await every_page(page, ToolsRequest(machine=machine), want=want)).tools


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


def arguments_of(text: str) -> dict[str, Any]:
    try:
        value = wire.decode_json(text.encode(errors="surrogateescape"))
    except wire.TooDeep as e:
        raise CliError(f"--args: {e}") from None
    except msgspec.DecodeError as e:
        raise CliError(f"--args: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise CliError(f"--args: {text[:60]!r} is not a JSON object")
    return value


def result_text(reply: ToolCallReply) -> str:
    """What a result says, for a person: its text blocks, other blocks as JSON."""
    parts = []
    for block in reply.content:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            parts.append(json.dumps(block))
    if not parts and reply.structured_content is not None:
        parts.append(json.dumps(reply.structured_content))
    return "\n".join(parts)


async def cmd_tools(args: argparse.Namespace) -> None:
    if args.machine is not None:
        check_name(args.machine, field="MACHINE")
    url, creds = where(args)
    async with connected(url=url, creds=creds, what="tools") as nc:
        tools = await fleet_tools(
            nc, url=url, machine=args.machine, timeout=getattr(args, "timeout", 5.0),
            want=args.limit,
        )  # fmt: skip
    if args.json:
        print_json({"tools": tools})
    else:
        render.tools(console(), tools, machine=args.machine)


async def cmd_tool_call(args: argparse.Namespace) -> None:
    check_name(args.machine, field="MACHINE")
    check_name(args.server, field="SERVER")
    arguments = arguments_of(args.args)
    url, creds = where(args)
    async with connected(url=url, creds=creds, what="tool call") as nc:
        reply = await call_tool(
            nc, machine=args.machine, server=args.server, tool=args.tool, arguments=arguments,
            timeout=getattr(args, "timeout", CALL_TIMEOUT),
        )  # fmt: skip
    if args.json:
        print_json(reply)
    else:
        text = result_text(reply)
        if not reply.is_error:
            sys.stdout.write(text + ("\n" if text and not text.endswith("\n") else ""))
    if reply.is_error:
        said = " ".join(result_text(reply).split())[:300] or "(no message)"
        raise CliError(f"{args.machine} {args.server}.{args.tool} reported an error: {said}")


async def cmd_mcp(args: argparse.Namespace) -> None:
    try:
        from programs.mcp.server import serve
    except ImportError as e:  # a mesh bundle leaves the mcp package out (services/host/meshbuild)
        raise CliError(f"mesh mcp needs the mcp package, which is not installed here ({e}): "
                       "pip install mcp") from None  # fmt: skip
    url, creds = where(args)
    await serve(url=url, creds=creds, http=args.http)


COMMANDS = {("tools",): cmd_tools, ("tool", "call"): cmd_tool_call, ("mcp",): cmd_mcp}
