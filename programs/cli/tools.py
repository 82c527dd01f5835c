"""`mesh tools [MACHINE]`, `mesh tool call MACHINE SERVER TOOL --args JSON` and `mesh mcp`: the
fleet's tools from the command line.

The list comes from the controller (the `tools` verb, every page followed); a call goes to the
machine's host directly (`mesh.host.<name>.tool`), which calls its tool server: both through
the library's client (mesh/client/tools.py). `mesh mcp` (programs/mcp/) offers the same tools
to an MCP client.
"""

import argparse
import json
import sys
from typing import Any

import msgspec

from mesh import wire
from mesh.client.asking import connected
from mesh.client.tools import CALL_TIMEOUT, call_tool, check_tool_name, fleet_tools
from mesh.model import ToolCallReply
from mesh.names import check_name
from programs.cli import render
from programs.cli.args import LIMIT_HELP, Parser, count, listen
from programs.cli.client import CliError, where
from programs.cli.output import console, print_json


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
    check_tool_name(args.tool, field="TOOL")
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
