"""The fleet's tools end to end, on a real controller, two real hosts and their tool servers:
a tool module assigned to two hosts is listed by `mesh tools` and called by `mesh tool call`;
`mesh mcp`, driven by the mcp package's own client, lists and calls the same tools (one on
node-2, one that fails, one that times out, one on a machine that is down); a tool server
killed mid-call fails that call in words and serves the next after its restart; an update of
the module through a plan swaps the servers while calls run, none of them failing."""

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import anyio
from helpers import MESH, ask, await_until, ok, ok_json, one_line_error, wait_until
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from mesh import bus, subjects
from mesh.client.tools import ToolCallFailed, call_tool
from mesh.embedded import ports

EXAMPLE = Path(__file__).parent.parent / "docs" / "examples" / "files"
CONTRACT = {"machine", "server", "name", "description", "input_schema"}


def files_module(folder: Path, *, version: str = "1", timeout: str = "2s") -> Path:
    """The example tool module, with a short call limit (the timeout test) and a version its
    `whoami` tells."""
    if not folder.exists():
        shutil.copytree(EXAMPLE, folder)
    text = (EXAMPLE / "module.toml").read_text()
    text = text.replace('FILES_VERSION = "1"', f'FILES_VERSION = "{version}"')
    text = text.replace('timeout = "30s"', f'timeout = "{timeout}"')
    (folder / "module.toml").write_text(text)
    return folder


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def listed(cli, *, machines: set[str], version: str | None = None):
    """`mesh tools --json` once every machine's files server is ready (and runs `version`)."""

    async def ready():
        done = cli("tools", "--json")
        if done.returncode != 0:
            return None
        tools = json.loads(done.stdout)["tools"]
        ready = {t["machine"] for t in tools if t["state"] == "ready" and t["up"]}
        return tools if ready == machines else None

    return await await_until(ready, within=60, what=f"the tools of {sorted(machines)}")


async def test_a_tool_module_on_two_hosts_is_listed_and_called_from_the_cli(
    start_fleet, nc, tmp_path, cli
) -> None:
    await start_fleet(hosts=2, within=40)
    folder = files_module(tmp_path / "files")
    ok(cli("push", str(folder)))
    ok(cli("assign", "files", "node-1", "node-2", "--wait"))
    tools = await listed(cli, machines={"node-1", "node-2"})
    assert all(CONTRACT <= set(t) for t in tools)
    names = sorted((t["machine"], t["server"], t["name"]) for t in tools)
    assert names == [(m, "files", n) for m in ("node-1", "node-2")
                     for n in ("echo", "fail", "list", "read", "sleep", "whoami")]  # fmt: skip
    read = next(t for t in tools if t["name"] == "read")
    assert read["input_schema"]["required"] == ["path"] and "256 KiB" in read["description"]
    only = ok_json(cli("tools", "node-2", "--json"))["tools"]
    assert {t["machine"] for t in only} == {"node-2"} and len(only) == 6
    table = ok(cli("tools"))
    assert "node-2" in table and "whoami" in table and "MACHINE" in table

    # a call, on the machine named, as the tool server's account, in its own folder
    said = ok(cli("tool", "call", "node-2", "files", "read", "--args",
                  '{"path": "notes.txt"}'))  # fmt: skip
    assert said == "Tools are launched by the node's runtime, which knows no language.\n"
    me = ok_json(cli("tool", "call", "node-2", "files", "whoami", "--json"))
    assert me["structuredContent"]["machine"] == "node-2" and me["isError"] is False
    assert me["machine"] == "node-2" and me["server"] == "files" and me["tool"] == "whoami"
    nodes = await ask(nc, "mesh.ctl.nodes")
    node2 = next(n for n in nodes["nodes"] if n["name"] == "node-2")
    server = next(p for p in node2["processes"] if p["name"] == "files")
    assert (
        server["tool"] is True
        and server["healthy"]
        and server["pid"] == me["structuredContent"]["pid"]
    )
    assert "files 1 on node-2" in ok(cli("logs", "node-2", "files"))

    # what keeps a call from a result: one line, exit 1
    failed = cli("tool", "call", "node-1", "files", "fail", "--args", '{"message": "no"}')
    assert one_line_error(failed) == "mesh: error: node-1 files.fail reported an error: no"
    for args, words in [
        (("node-2", "files", "nope"), "tool server files has no tool 'nope'"),
        (("node-2", "other", "echo"), "no tool server other here"),
        (("node-2", "files", "sleep", "--args", '{"seconds": 10}'), "did not answer within 2s"),
        (("node-9", "files", "echo"), "machine node-9 does not answer"),
        (("node-2", "files", "echo", "--args", "[1]"), "--args: '[1]' is not a JSON object"),
    ]:
        assert words in one_line_error(cli("tool", "call", *args)), args

    # killed mid-call: that call fails in words, the next works once it is back
    def sleep_call():
        return cli("tool", "call", "node-2", "files", "sleep", "--args", '{"seconds": 20}',
                   answer=30)  # fmt: skip

    async def slow_call() -> None:
        killed.append(await anyio.to_thread.run_sync(sleep_call))

    killed: list = []
    files2 = files_module(tmp_path / "files", timeout="30s")
    ok(cli("push", str(files2), "--wait"))
    await listed(cli, machines={"node-1", "node-2"})
    me = ok_json(cli("tool", "call", "node-2", "files", "whoami", "--json"))
    pid = me["structuredContent"]["pid"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_call)

        async def in_flight():  # the server runs each call in a thread of its own
            return len(os.listdir(f"/proc/{pid}/task")) >= 2

        await await_until(in_flight, within=30, what="the call in flight")
        os.kill(pid, signal.SIGKILL)
    line = one_line_error(killed[0])
    assert "node-2 files.sleep: tool server files stopped during the call" in line, line

    async def back():
        done = cli("tool", "call", "node-2", "files", "echo", "--args", '{"text": "b"}')
        return done.stdout == "b\n"

    await await_until(back, within=30, what="files on node-2 to be back")


async def test_mesh_mcp_lists_and_calls_the_fleets_tools(
    start_fleet, nc, nats_url, tmp_path, procs, cli
) -> None:
    fleet = await start_fleet(hosts=2, within=40)
    ok(cli("push", str(files_module(tmp_path / "files"))))
    ok(cli("assign", "files", "node-1", "node-2", "--wait"))
    await listed(cli, machines={"node-1", "node-2"})

    # streamable HTTP on loopback, as an option (and never on another address)
    port = ports.free_port()
    procs.start("mcp-http", [*MESH, "mcp", "--http", f"127.0.0.1:{port}"],
                env={"MESH_NATS_URL": nats_url})  # fmt: skip
    wait_until(lambda: _listening(port), within=60, what="mesh mcp --http to listen")
    async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            with anyio.fail_after(60):
                await session.initialize()
                offered = (await session.list_tools()).tools
                assert len([t for t in offered if "." in t.name]) == 12  # beside mesh_status, ...
                echoed = await session.call_tool("node-2.files.echo", {"text": "over http"})
            assert not echoed.is_error and echoed.content[0].text == "over http"
    line = one_line_error(cli("mcp", "--http", "0.0.0.0:8765"))
    assert "0.0.0.0 is not a loopback address" in line
    params = StdioServerParameters(
        command=MESH[0], args=[*MESH[1:], "mcp"],
        env={**os.environ, "MESH_NATS_URL": nats_url},
    )  # fmt: skip
    told: list[str] = []

    async def heard(message) -> None:
        told.append(getattr(message, "method", type(message).__name__))

    with open(tmp_path / "mcp.log", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write, message_handler=heard) as session:
                with anyio.fail_after(60):
                    await session.initialize()
                    listing = await session.list_tools()
                names = {t.name for t in listing.tools if "." in t.name}  # the machines' tools
                assert {"node-1.files.read", "node-2.files.read", "node-2.files.sleep"} <= names
                assert len(names) == 12
                read_tool = next(t for t in listing.tools if t.name == "node-2.files.read")
                assert read_tool.input_schema["required"] == ["path"]
                assert "node-2" in (read_tool.description or "")

                with anyio.fail_after(30):
                    result = await session.call_tool("node-2.files.read", {"path": "motd.txt"})
                assert not result.is_error
                assert result.content[0].text == "hello from the files tool server\n"
                me = await session.call_tool("node-2.files.whoami", {})
                assert me.structured_content["machine"] == "node-2"

                failed = await session.call_tool("node-1.files.fail", {"message": "as it does"})
                assert failed.is_error and failed.content[0].text == "as it does"

                with anyio.fail_after(30):
                    slow = await session.call_tool("node-2.files.sleep", {"seconds": 10})
                assert slow.is_error and "did not answer within 2s" in slow.content[0].text

                unknown = await session.call_tool("node-2.files.nope", {})
                assert unknown.is_error and "has no tool 'nope'" in unknown.content[0].text

                # a machine that is down: its host is gone, nothing answers its subject
                host = fleet.hosts["node-1"]
                os.killpg(host.pid, signal.SIGKILL)
                host.wait(timeout=10)

                async def nobody_subscribed():
                    # The process is gone at once; the NATS server drops its connection (and
                    # with it the subscription) a moment later. A call in between is routed to
                    # the dead connection and times out: another case than "does not answer".
                    try:
                        await nc.request(subjects.host("node-1", "tool"), b"{}", timeout=2)
                    except NoRespondersError:
                        return True
                    except NatsTimeout:
                        pass
                    return False

                await await_until(nobody_subscribed, within=30, what="node-1's subscription gone")
                with anyio.fail_after(30):
                    down = await session.call_tool("node-1.files.echo", {"text": "x"})
                assert down.is_error
                assert "machine node-1 does not answer" in down.content[0].text

                async def told_of_a_change():
                    return "notifications/tools/list_changed" in told

                # node-1 is down once it misses its beats: the client is told the list changed
                await await_until(
                    told_of_a_change, within=30, what="notifications/tools/list_changed"
                )

                async def node1_gone():
                    found = await session.list_tools()
                    names = {t.name for t in found.tools}
                    return names if not any(n.startswith("node-1.") for n in names) else None

                left = await await_until(node1_gone, within=30, what="node-1's tools unlisted")
                assert "node-2.files.echo" in left
    assert "Traceback" not in (tmp_path / "mcp.log").read_text()


async def test_an_update_through_a_plan_swaps_the_servers_while_calls_run(
    start_fleet, nats_url, tmp_path, cli
) -> None:
    await start_fleet(hosts=2, within=40)
    folder = files_module(tmp_path / "files", version="1", timeout="30s")
    ok(cli("push", str(folder)))
    ok(cli("assign", "files", "node-1", "node-2", "--wait"))
    await listed(cli, machines={"node-1", "node-2"})
    nc = await bus.connect(nats_url, name="test calls", reconnect=False)
    seen: dict[str, list[str]] = {"node-1": [], "node-2": []}
    failures: list[str] = []
    stop = anyio.Event()

    async def keep_calling(machine: str) -> None:
        while not stop.is_set():
            try:
                reply = await call_tool(nc, machine=machine, server="files", tool="whoami",
                                        arguments={}, timeout=10)  # fmt: skip
                seen[machine].append(reply.structured_content["version"])
            except ToolCallFailed as e:
                failures.append(f"{machine}: {e}")
            await anyio.sleep(0.02)  # ok: the pace of a caller, not a synchronisation

    try:
        async with anyio.create_task_group() as tg:
            for machine in seen:
                tg.start_soon(keep_calling, machine)
            files_module(folder, version="2", timeout="30s")
            done = await anyio.to_thread.run_sync(lambda: cli("push", str(folder), "--wait"))
            ok(done)
            assert "done" in done.stdout

            async def both_new():
                return all(v and v[-1] == "2" for v in seen.values())

            await await_until(both_new, within=30, what="calls answered by version 2")
            stop.set()
    finally:
        await nc.close()
    assert failures == [], failures[:5]
    for machine, versions in seen.items():
        assert versions[0] == "1" and versions[-1] == "2", machine
        # each machine switched once: never back to the old version after the new answered
        assert versions == sorted(versions), machine
    print(f"calls during the update: {sum(map(len, seen.values()))}", file=sys.stderr)


async def test_the_tools_verb_pages_a_large_fleets_tools(nc, start_controller, cli) -> None:
    """Hosts' reports of many tools with big schemas: every page stays well under a NATS
    message, `next` leads through all of them in order, and `mesh tools` prints them all."""
    from mesh import paging, wire
    from mesh.model import Register, ToolInfo, ToolServerReport, ToolsEvent
    from services.host.facts import gather

    start_controller("ctl-a")
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    machines = [f"m-{i}" for i in range(3)]
    for name in machines:
        body = wire.encode(Register(name=name, tier=2, labels={}, facts=gather(),
                                    beat_interval=60, pid=1))  # fmt: skip
        reply = await bus.request(nc, f"mesh.ctl.host.{name}.register", body,
                                  deadline=anyio.current_time() + 30)  # fmt: skip
        assert b'"epoch"' in reply
        servers = [
            ToolServerReport(name=server, state="ready", tools=[
                ToolInfo(name=f"t{i:03}", description="d" * 200, input_schema=schema)
                for i in range(150)
            ])
            for server in ("a", "b")
        ]  # fmt: skip
        await nc.publish(
            f"mesh.event.{name}.tools", wire.encode(ToolsEvent(name=name, servers=servers))
        )

    async def all_heard():
        reply = await ask(nc, "mesh.ctl.tools", {"limit": 1})
        return reply if reply and reply["tools"] and reply["next"] else None

    await await_until(all_heard, within=30, what="the controller to hear the reports")
    pages, after = [], None
    while True:
        msg = await nc.request("mesh.ctl.tools", json.dumps({"after": after}).encode(), timeout=10)
        # a page: at most mesh/paging.py's budget of items, well under the server's max_payload
        assert len(msg.data) <= paging.budget(nc.max_payload) < nc.max_payload
        page = json.loads(msg.data)
        pages.append(page["tools"])
        if page["next"] is None:
            break
        after = page["next"]
    found = [(t["machine"], t["server"], t["name"]) for p in pages for t in p]
    assert len(pages) > 2 and len(found) == 3 * 2 * 150
    assert found == sorted(found) and len(set(found)) == len(found)
    one = ok_json(cli("tools", "m-1", "--json"))["tools"]
    assert len(one) == 300 and {t["machine"] for t in one} == {"m-1"}
    every = ok_json(cli("tools", "--json"))["tools"]
    assert [(t["machine"], t["server"], t["name"]) for t in every] == found
    bad = await ask(nc, "mesh.ctl.tools", {"after": "bm90LWEtY3Vyc29y"})
    assert bad["error"]["code"] == "bad_request" and "after" in bad["error"]["message"]
    # a host speaks only for itself: a report naming another machine is ignored (then m-1's
    # own, heard after it on the same subscription, shows it was handled)
    evil = ToolServerReport(name="evil", state="ready", tools=[ToolInfo(name="x")])
    await nc.publish("mesh.event.m-1.tools", wire.encode(ToolsEvent(name="m-0", servers=[evil])))
    marker = ToolServerReport(name="marker", state="ready", tools=[ToolInfo(name="y")])
    await nc.publish("mesh.event.m-1.tools", wire.encode(ToolsEvent(name="m-1", servers=[marker])))

    async def marked():
        reply = await ask(nc, "mesh.ctl.tools", {"machine": "m-1"})
        return reply if reply and [t["server"] for t in reply["tools"]] == ["marker"] else None

    await await_until(marked, within=30, what="m-1's own report")
    servers = {t["server"] for t in ok_json(cli("tools", "m-0", "--json"))["tools"]}
    assert servers == {"a", "b"}


async def test_a_restarted_host_starts_its_tool_servers_again(
    host, nc, tmp_path, start_host, cli
) -> None:
    """A tool server's pipes are its host's: it cannot be adopted. A host killed with SIGKILL
    leaves it without its stdin (it exits, or the next host kills it), and the next host
    starts it again; processes, meanwhile, are adopted as ever."""
    ok(cli("push", str(files_module(tmp_path / "files", timeout="30s"))))
    ok(cli("assign", "files", "node-1", "--wait"))
    await listed(cli, machines={"node-1"})
    before = ok_json(cli("tool", "call", "node-1", "files", "whoami", "--json"))
    old = before["structuredContent"]["pid"]
    os.killpg(host.pid, signal.SIGKILL)
    host.wait(timeout=10)
    start_host("node-1", "--tier", "0")

    async def started_again():
        done = cli("tool", "call", "node-1", "files", "whoami", "--json")
        if done.returncode != 0:
            return None
        pid = json.loads(done.stdout)["structuredContent"]["pid"]
        return pid if pid != old else None

    await await_until(started_again, within=60, what="a new files server on node-1")

    async def old_gone():  # exited (or a zombie its new parent has not reaped yet)
        try:
            stat = Path(f"/proc/{old}/stat").read_text()
        except OSError:
            return True
        return stat[stat.rindex(")") + 2] == "Z"

    await await_until(old_gone, within=15, what="the old files server to be gone")
    state = json.loads((tmp_path / "hosts" / "node-1" / "state" / "tools.json").read_text())
    assert list(state) == ["files"] and state["files"]["pid"] != old
