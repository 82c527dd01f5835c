"""The host's tool runtime against real tool servers, good and bad (services/host/tools.py,
mcpstdio.py): a server is ready once initialized and listed (following nextCursor), calls are
answered or fail with a code a caller can act on, a server killed mid-call fails that call
clearly and serves the next one after its restart, and a server that does not speak MCP
(garbage, a huge line, no answer to initialize, a wrong id, an exit at once) is reported so,
killed and started again, while the runtime goes on serving the others. The SDK's own server
(docs/examples/clock) speaks to the same client."""

import os
import signal
import sys
from pathlib import Path

import anyio
import pytest
from helpers import await_until

from mesh.modules.compose import DTool
from services.host import tools
from services.host.supervisor import Launch, spec_digest
from services.host.tools import ToolFailed, ToolRuntime

pytestmark = pytest.mark.slow  # starts tool servers (processes), seconds each

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"
FILES = EXAMPLES / "files" / "src"

BAD = {
    # each prints something that is not MCP where an answer to initialize should be, then
    # stays until the host closes its stdin (or kills it)
    "garbage": "import sys\nsys.stdin.readline()\nprint('hello, I am not MCP', flush=True)\n"
    "sys.stdin.read()\n",
    "huge": "import sys\nsys.stdin.readline()\nsys.stdout.write('x' * (5 * 2**20))\n"
    "sys.stdout.flush()\nsys.stdin.read()\n",
    "silent": "import sys\nsys.stdin.readline()\nsys.stdin.read()\n",
    "wrong-id": "import sys\nsys.stdin.readline()\n"
    'print(\'{"jsonrpc": "2.0", "id": 999, "result": {}}\', flush=True)\nsys.stdin.read()\n',
    "exits": "import sys\nsys.exit(3)\n",
    "bool-id": "import sys\nsys.stdin.readline()\n"
    'print(\'{"jsonrpc": "2.0", "id": true, "result": {}}\', flush=True)\nsys.stdin.read()\n',
    "not-utf8": "import sys\nsys.stdin.readline()\n"
    "sys.stdout.buffer.write(b'\\xff\\xfe{}\\n')\nsys.stdout.flush()\nsys.stdin.read()\n",
}
WHY = {
    "garbage": "does not speak MCP: it wrote something that is not JSON on stdout: 'hello, I am",
    "huge": "does not speak MCP: it wrote a line longer than",
    "silent": "did not answer initialize",
    "wrong-id": "does not speak MCP: it answered id '999', which was never asked",
    "exits": "exited with code 3",
    "bool-id": "does not speak MCP: it answered id 'True', which was never asked",
    "not-utf8": "does not speak MCP: it wrote something that is not JSON on stdout",
}


def launch(tmp_path: Path, name: str, command: list[str], *, cwd: Path, timeout: str = "5s"):
    decl = DTool(
        module="m", bundle="files:x", command=command, account=None, root=False,
        env={}, files={}, timeout=timeout, stop_timeout="2s",
    )  # fmt: skip
    folder = tmp_path / "processes" / name
    (folder / "files").mkdir(parents=True, exist_ok=True)
    (folder / "files" / "notes.txt").write_text("notes\n")
    env = {"PATH": os.environ["PATH"], "MESH_FILES": str(folder / "files"), "FILES_VERSION": "1"}
    return Launch(
        name=name, decl=decl, spec=spec_digest(decl), cwd=cwd, env=env, uid=None, gid=None,
        log_file=folder / "logs" / "output.log",
    )  # fmt: skip


async def ready(runtime: ToolRuntime, name: str) -> bool:
    return any(s.name == name and s.healthy for s in runtime.states())


async def test_a_good_server_is_listed_and_called(tmp_path: Path) -> None:
    runtime = ToolRuntime(nc=None, root=tmp_path, changed=lambda: None)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime.run)
        files = launch(tmp_path, "files", ["python3", "files_server.py", "--machine", "n1"],
                       cwd=FILES)  # fmt: skip
        assert await runtime.reconcile({"files": files}) == []
        await await_until(lambda: ready(runtime, "files"), within=30, what="files ready")
        [report] = runtime.reports()
        # six tools, three a page: the runtime followed nextCursor
        assert [t.name for t in report.tools] == ["echo", "fail", "list", "read", "sleep", "whoami"]
        assert report.state == "ready" and report.timeout == 5.0
        assert report.tools[3].input_schema["required"] == ["path"]
        result = await runtime.call("files", "read", {"path": "notes.txt"}, timeout=None)
        assert result["content"] == [{"type": "text", "text": "notes\n"}]
        failed = await runtime.call("files", "fail", {"message": "boom"}, timeout=None)
        assert failed["isError"] is True and failed["content"][0]["text"] == "boom"
        # calls run side by side: a slow one does not hold up a quick one
        async with anyio.create_task_group() as calls:
            calls.start_soon(lambda: runtime.call("files", "sleep", {"seconds": 1}, timeout=None))
            with anyio.fail_after(0.9):
                await runtime.call("files", "echo", {"text": "quick"}, timeout=None)
        for args, code, words in [
            (("files", "sleep", {"seconds": 3}, 0.5), "timeout", "did not answer within 0.5s"),
            (("files", "nope", {}, None), "not_found", "has no tool 'nope'"),
            (("other", "echo", {}, None), "not_found", "no tool server other here"),
            (("files", "echo", {"text": "x" * 800_000}, None), "too_large", "more than a reply"),
        ]:
            with pytest.raises(ToolFailed) as e:
                await runtime.call(*args[:3], timeout=args[3])
            assert e.value.code == code and words in str(e.value), str(e.value)
        # a declared limit caps what a caller asks for
        with pytest.raises(ToolFailed, match="within 5s"):
            await runtime.call("files", "sleep", {"seconds": 30}, timeout=60)
        # still serving after all of that
        echoed = await runtime.call("files", "echo", {"text": "still here"}, timeout=None)
        assert echoed["content"][0]["text"] == "still here"
        assert "files 1 on n1" in (tmp_path / "processes/files/logs/output.log").read_text()
        tg.cancel_scope.cancel()


async def test_a_server_killed_mid_call_fails_the_call_and_serves_the_next(tmp_path: Path) -> None:
    runtime = ToolRuntime(nc=None, root=tmp_path, changed=lambda: None)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime.run)
        files = launch(tmp_path, "files", ["python3", "files_server.py"], cwd=FILES,
                       timeout="30s")  # fmt: skip
        await runtime.reconcile({"files": files})
        await await_until(lambda: ready(runtime, "files"), within=30, what="files ready")
        first = runtime.servers["files"].instance
        assert first is not None
        failure: list[ToolFailed] = []

        async def slow_call() -> None:
            try:
                await runtime.call("files", "sleep", {"seconds": 20}, timeout=None)
            except ToolFailed as e:
                failure.append(e)

        tg.start_soon(slow_call)
        await await_until(lambda: _in_flight(runtime), within=10, what="the call in flight")
        os.kill(first.pid, signal.SIGKILL)

        async def failed() -> bool:
            return bool(failure)

        await await_until(failed, within=10, what="the call to fail")
        assert failure[0].code == "unavailable" and "stopped during the call" in str(failure[0])
        with pytest.raises(ToolFailed) as e:  # restarting, with backoff: says so
            await runtime.call("files", "echo", {}, timeout=None)
        assert e.value.code == "unavailable" and "tool server files is" in str(e.value)
        await await_until(lambda: ready(runtime, "files"), within=30, what="files restarted")
        again = await runtime.call("files", "echo", {"text": "back"}, timeout=None)
        assert again["content"][0]["text"] == "back"
        assert runtime.servers["files"].instance.pid != first.pid
        assert runtime.servers["files"].restarts == 1
        tg.cancel_scope.cancel()


async def _in_flight(runtime: ToolRuntime) -> bool:
    return runtime.servers["files"].in_flight == 1


@pytest.mark.parametrize("kind", sorted(BAD))
async def test_a_server_that_does_not_speak_mcp_is_reported_and_restarted(
    tmp_path: Path, kind: str
) -> None:
    (tmp_path / "bad.py").write_text(BAD[kind])
    runtime = ToolRuntime(nc=None, root=tmp_path, changed=lambda: None, ready_within=2.0)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime.run)
        good = launch(tmp_path, "files", ["python3", "files_server.py"], cwd=FILES)
        bad = launch(tmp_path, "bad", [sys.executable, "bad.py"], cwd=tmp_path)
        await runtime.reconcile({"files": good, "bad": bad})

        async def said_why():
            state = next(s for s in runtime.states() if s.name == "bad")
            return state if WHY[kind] in state.error else None

        state = await await_until(said_why, within=30, what=f"{kind}: its error")
        assert state.tool and not state.healthy
        report = next(r for r in runtime.reports() if r.name == "bad")
        assert WHY[kind] in report.error and report.tools == []
        with pytest.raises(ToolFailed) as e:
            await runtime.call("bad", "anything", {}, timeout=None)
        assert e.value.code == "unavailable" and WHY[kind] in str(e.value)
        # killed and started again, with backoff, while the good one serves
        await await_until(lambda: _restarted(runtime), within=30, what=f"{kind}: a restart")
        await await_until(lambda: ready(runtime, "files"), within=30, what="files ready")
        echoed = await runtime.call("files", "echo", {"text": "fine"}, timeout=None)
        assert echoed["content"][0]["text"] == "fine"
        tg.cancel_scope.cancel()
    # a runtime that stops stops its servers: nobody could speak to them again
    for name in ("files", "bad"):
        instance = runtime.servers[name].instance
        assert instance is None or not os.path.exists(f"/proc/{instance.pid}")


async def _restarted(runtime: ToolRuntime) -> bool:
    return runtime.servers["bad"].restarts >= 1


async def test_a_server_written_with_the_mcp_package_speaks_to_the_host(tmp_path: Path) -> None:
    # The SDK is installed beside the tests: the venv's python runs the example's server as is.
    runtime = ToolRuntime(nc=None, root=tmp_path, changed=lambda: None)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime.run)
        clock = launch(tmp_path, "clock", [sys.executable, "clock_server.py"],
                       cwd=EXAMPLES / "clock" / "src")  # fmt: skip
        await runtime.reconcile({"clock": clock})
        await await_until(lambda: ready(runtime, "clock"), within=60, what="clock ready")
        [report] = runtime.reports()
        assert [t.name for t in report.tools] == ["add", "now", "uptime"]
        add = next(t for t in report.tools if t.name == "add")
        assert set(add.input_schema["properties"]) == {"a", "b"}
        result = await runtime.call("clock", "add", {"a": 2, "b": 40}, timeout=None)
        assert result["content"][0]["text"] == "42.0" and not result.get("isError")
        bad = await runtime.call("clock", "add", {"a": "two"}, timeout=None)
        assert bad["isError"] is True  # the SDK validates arguments: a tool error, not a crash
        tg.cancel_scope.cancel()


def test_the_limits_fit_a_nats_message() -> None:
    # a result and a host's tools report must each fit NATS's default max_payload (1 MiB)
    assert tools.MAX_RESULT < 2**20 and tools.MAX_REPORT < 2**20
