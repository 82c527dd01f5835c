"""The fleet's own verbs through `mesh mcp` (programs/mcp/fleet.py), on a secured mesh (a
controller and two hosts, every piece with its own credentials), driven by the mcp package's
own client over stdio and over streamable HTTP: an agent's push and assign are held, its
approve is neither listed nor allowed; a viewer is offered reads alone; arguments of the wrong
type are a tool error and the server goes on serving."""

import os
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from helpers import MESH, ok, ok_json, wait_until
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from module_folders import write_module
from secured import Secured

from mesh.embedded import ports
from programs.mcp.fleet import READS, VERBS, input_schema, output_schema
from programs.mcp.server import MCP_NAME, split

READ_TOOLS = {name for name, v in VERBS.items() if v.hints.read_only_hint}


def _web(folder: Path, name: str) -> Path:
    return write_module(
        folder / name,
        f'[module]\nname = "{name}"\n[bundle.site]\nkind = "files"\nsource = "src"\n',
        files={"src/index.html": f"{name}\n"},
    )


def _add(secured: Secured, name: str, *args: str) -> str:
    return ok_json(secured.cli(None, "operator", "add", name, *args,
                               "--dir", str(secured.dir.root), "--json"))["creds"]  # fmt: skip


@asynccontextmanager
async def _stdio(secured: Secured, creds: str, log: Path):
    params = StdioServerParameters(
        command=MESH[0], args=[*MESH[1:], "mcp"],
        env={**os.environ, "MESH_NATS_URL": secured.url, "MESH_CREDS": creds},
    )  # fmt: skip
    with open(log, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                with anyio.fail_after(60):
                    await session.initialize()
                yield session


async def _names(session: ClientSession) -> set[str]:
    return {t.name for t in (await session.list_tools()).tools}


def test_the_fleets_tools_are_named_apart_from_the_machines_and_described() -> None:
    for name, v in VERBS.items():
        assert MCP_NAME.fullmatch(name) and split(name) is None, name  # never MACHINE.SERVER.TOOL
        assert input_schema(v.args)["type"] == "object" == output_schema(v.reply)["type"]
        assert v.hints.read_only_hint or v.hints.destructive_hint is not None, name
    assert {"mesh_status", "mesh_nodes", "mesh_plans", "mesh_plan", "mesh_plan_diff",
            "mesh_history", "mesh_logs", "mesh_audit"} == READ_TOOLS  # fmt: skip
    assert VERBS["mesh_status"].hints == READS
    for name in ("mesh_unassign", "mesh_drain", "mesh_plan_reject"):
        assert VERBS[name].hints.destructive_hint, name
    for name in ("mesh_assign", "mesh_push", "mesh_plan_approve"):
        assert not VERBS[name].hints.read_only_hint, name
    # who may: the policy's lists (mesh/auth/policy.py), nats-server's own
    assert VERBS["mesh_assign"].roles == {"admin", "deployer", "agent"}
    assert VERBS["mesh_restart"].roles == {"admin", "deployer", "agent"}  # an agent's: held
    assert VERBS["mesh_plan_approve"].roles == {"admin", "deployer"}
    assert VERBS["mesh_drain"].roles == {"admin"}
    assert VERBS["mesh_status"].roles == {"admin", "deployer", "agent", "viewer", "tools"}


@pytest.mark.slow
async def test_an_agent_through_mesh_mcp_proposes_and_is_held(
    secured_fleet, secured: Secured, tmp_path: Path, procs
) -> None:
    ada = _add(secured, "ada", "--role", "agent", "--modules", "web-*")
    async with _stdio(secured, ada, tmp_path / "mcp-ada.log") as session:
        names = await _names(session)
        assert {
            "mesh_push",
            "mesh_assign",
            "mesh_unassign",
            "mesh_plan_diff",
            "mesh_restart",
        } <= names
        assert READ_TOOLS <= names
        for never in ("mesh_plan_approve", "mesh_plan_reject", "mesh_drain", "mesh_rollback"):
            assert never not in names, never
        # its push, of a folder on this machine: held until a person approves it
        with anyio.fail_after(120):
            pushed = await session.call_tool(
                "mesh_push", {"folder": str(_web(tmp_path, "web-a")), "note": "by an agent"}
            )
        assert not pushed.is_error, pushed.content[0].text
        assert pushed.structured_content["state"] == "held", pushed.structured_content
        plan = pushed.structured_content["plan"]
        # its own approval: not listed, and refused when called anyway (nothing sent)
        approve = await session.call_tool("mesh_plan_approve", {"id": plan})
        assert approve.is_error and "forbidden" in approve.content[0].text, approve.content
        assert "\n" not in approve.content[0].text
        ok(secured.cli(secured.admin, "plan", "approve", str(plan), "--wait", "--timeout", "60"))

        with anyio.fail_after(120):
            assigned = await session.call_tool(
                "mesh_assign", {"module": "web-a", "machines": ["node-2"]}
            )
        assert not assigned.is_error, assigned.content[0].text
        assert assigned.structured_content["state"] == "held", assigned.structured_content
        shown = await session.call_tool("mesh_plan", {"id": assigned.structured_content["plan"]})
        assert not shown.is_error, shown.content[0].text
        assert (shown.structured_content["state"], shown.structured_content["by"]) == (
            "held", "ada")  # fmt: skip

        # arguments of the wrong type, unknown ones, none where some are needed: tool errors
        for name, arguments in (("mesh_assign", {"module": 5, "machines": ["node-2"]}),
                                ("mesh_plan", {"id": "one"}),
                                ("mesh_history", {"module": "web-a", "whatever": 1}),
                                ("mesh_logs", {})):  # fmt: skip
            bad = await session.call_tool(name, arguments)
            assert bad.is_error and "bad arguments" in bad.content[0].text, (name, bad.content)
        # beyond its glob: the controller refuses it, in a line
        refused = await session.call_tool("mesh_assign", {"module": "hello", "machines": ["x"]})
        assert refused.is_error and "forbidden" in refused.content[0].text, refused.content
        # and it goes on serving
        status = await session.call_tool("mesh_status", {})
        assert not status.is_error and "seat" in status.structured_content, status.content
    assert "Traceback" not in (tmp_path / "mcp-ada.log").read_text()

    # over streamable HTTP: the same operator, the same hold
    port = ports.free_port()
    procs.start("mcp-http", [*MESH, "mcp", "--http", f"127.0.0.1:{port}"],
                env={"MESH_NATS_URL": secured.url, "MESH_CREDS": ada})  # fmt: skip
    wait_until(lambda: not ports.port_free(port), within=60, what="mesh mcp --http to listen")
    async with (
        streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        with anyio.fail_after(60):
            await session.initialize()
        names = await _names(session)
        assert "mesh_assign" in names and "mesh_plan_approve" not in names
        with anyio.fail_after(120):
            again = await session.call_tool(
                "mesh_assign", {"module": "web-a", "machines": ["node-1"]}
            )
        assert not again.is_error, again.content[0].text
        assert again.structured_content["state"] == "held", again.structured_content


@pytest.mark.slow
async def test_a_viewer_is_offered_reads_and_a_tools_operator_its_own(
    secured_fleet, secured: Secured, tmp_path: Path
) -> None:
    async with _stdio(secured, secured.viewer, tmp_path / "mcp-viewer.log") as session:
        listed = (await session.list_tools()).tools
        assert {t.name for t in listed} == READ_TOOLS - {"mesh_plan_diff"}  # a deployer's dry run
        assert all(t.annotations.read_only_hint for t in listed)
        assert all(t.output_schema and t.input_schema for t in listed)
        nodes = await session.call_tool("mesh_nodes", {})
        assert not nodes.is_error, nodes.content[0].text
        assert {n["name"] for n in nodes.structured_content["nodes"]} == {"node-1", "node-2"}
        drain = await session.call_tool("mesh_drain", {"machine": "node-1"})
        assert drain.is_error and "forbidden" in drain.content[0].text, drain.content
    async with _stdio(secured, secured.tools, tmp_path / "mcp-tools.log") as session:
        assert await _names(session) == {"mesh_status", "mesh_nodes"}
    for log in ("mcp-viewer.log", "mcp-tools.log"):
        assert "Traceback" not in (tmp_path / log).read_text()
