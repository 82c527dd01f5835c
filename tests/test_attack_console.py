"""Attacks from this machine on `mesh console` and `mesh mcp` (issue 39).

The console: `runuser -u nobody -- curl http://127.0.0.1:PORT/api/logs/node-3/steal` read a
process's log (root's, 0600 on disk) through `mesh dev up`'s console, which answered anyone who
knew its port. Now it asks who you are: a request without its token (or the cookie the token
sets), or with a wrong one, gets 401, the page, the API and the events alike, from this account
or another; its unix socket (`--socket`) is 0600; `mesh dev up` gives the token to its console
where no other account reads it (never its command line or log) and prints it with the URL.

`mesh mcp` took a tool's name apart and put its machine in a subject: `*.files.read` called
`mesh.host.*.tool`. A machine, server or tool that is not a name is an MCP tool error naming
the field and the value, before anything is sent on the bus, and the server goes on serving.
"""

import http.client
import os
import re
import socket
import subprocess
from pathlib import Path

import anyio
import pytest
from helpers import MESH, DevUp, await_until, mesh_cli, one_line_error, wait_until
from mcp import ClientSession, StdioServerParameters, stdio_client
from nats.aio.msg import Msg

from mesh.client.tools import ToolCallFailed, call_tool
from mesh.embedded import ports
from programs.console.server import COOKIE

ROOT = os.geteuid() == 0
NOT_ROOT = "another local account (nobody) is tried only as root (runuser)"
# The paths an attacker would want: the page, its events, a process's log, a plan, its script.
PATHS = ("/", "/events", "/api/logs/node-3/steal", "/api/plan/1", "/static/app.js")
WRONG = "x" * 43  # the length of a real token, not it


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """One GET, no redirect followed, no cookie kept: the status and headers as sent (the
    events' stream is closed once its headers are in)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    answer = conn.getresponse()
    answer.body = b"" if path == "/events" and answer.status == 200 else answer.read()  # type: ignore[attr-defined]
    conn.close()
    return answer


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True,
                          text=True, timeout=60, cwd="/")  # fmt: skip


def _status_as_nobody(url: str, *curl: str) -> str:
    """What curl, run as nobody, gets from `url` (its HTTP status; 000: no connection)."""
    done = _as_nobody("curl", "-s", "--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code}",
                      "--max-time", "10", *curl, url)  # fmt: skip
    return done.stdout.strip()


def _console(
    procs, nats_url: str, creds: str, *flags: str, name: str = "console"
) -> tuple[subprocess.Popen, str]:
    """`mesh console` with `flags` on the test's NATS as `creds` (its log: `name`.log); its
    process and the line of its log that says where it is, once it says it."""
    proc = procs.start(name, [*MESH, "console", "--creds", creds, *flags],
                       env={"MESH_NATS_URL": nats_url})  # fmt: skip
    log = proc.log_path

    def said() -> str | None:
        assert proc.poll() is None, log.read_text()
        return next((line for line in log.read_text().splitlines() if "console on " in line),
                    None)  # fmt: skip

    return proc, str(wait_until(said, within=60, what="the console to say where it is"))


def _listens_on_tcp(pid: int) -> bool:
    """Whether process `pid` holds a listening TCP socket (its fds against /proc/net/tcp*)."""
    fds = Path(f"/proc/{pid}/fd")
    held = {os.readlink(fd) for fd in fds.iterdir()}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in held:  # 0A: LISTEN
                return True
    return False


def _token_url(line: str) -> tuple[int, str]:
    found = re.search(r"console on http://127\.0\.0\.1:(\d+)/\?token=([\w-]+) ", line)
    assert found, line
    return int(found.group(1)), found.group(2)


@pytest.mark.slow
def test_the_console_answers_401_without_its_token(secured, procs) -> None:
    port = ports.free_port()
    _console(procs, secured.url, secured.viewer, "--listen", f"127.0.0.1:{port}")
    for path in PATHS:
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"},
                        {"Cookie": f"{COOKIE}-{port}={WRONG}"}):  # fmt: skip
            answer = _get(port, path, headers)
            assert answer.status == 401, (path, headers, answer.status)
            assert answer.getheader("Set-Cookie") is None
            assert b"asks who you are" in answer.body, answer.body  # type: ignore[attr-defined]
        wrong = _get(port, f"{path}{'&' if '?' in path else '?'}token={WRONG}")
        assert wrong.status == 401 and wrong.getheader("Set-Cookie") is None, path


@pytest.mark.slow
def test_the_console_takes_its_token_then_the_cookie_alone(secured, procs) -> None:
    port = ports.free_port()
    proc, line = _console(procs, secured.url, secured.viewer, "--listen", f"127.0.0.1:{port}")
    assert _listens_on_tcp(proc.pid)
    _, token = _token_url(line)
    assert len(token) >= 43  # secrets.token_urlsafe(32)
    first = _get(port, f"/?token={token}")
    assert first.status == 303 and first.getheader("Location") == "/"  # the token out of sight
    cookie = first.getheader("Set-Cookie")
    assert cookie.startswith(f"{COOKIE}-{port}={token};"), cookie
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie, cookie
    alone = {"Cookie": f"{COOKIE}-{port}={token}"}
    page = _get(port, "/", alone)
    assert page.status == 200 and b"/static/app.js" in page.body  # type: ignore[attr-defined]
    events = _get(port, "/events", alone)
    assert events.status == 200 and events.getheader("Content-Type") == "text/event-stream"
    assert _get(port, "/static/app.js", alone).status == 200
    bearer = _get(port, "/", {"Authorization": f"Bearer {token}"})
    assert bearer.status == 200
    # The Host check stands with the cookie: another site's page by DNS rebinding reads nothing.
    assert _get(port, "/", {**alone, "Host": f"evil.example:{port}"}).status == 403


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason=NOT_ROOT)
def test_the_consoles_socket_is_its_owners_alone(secured, procs, open_dir) -> None:
    sock = open_dir / "console.sock"  # in a folder every account may enter: only its mode bars
    proc, line = _console(procs, secured.url, secured.viewer, "--socket", str(sock))
    assert f"console on unix socket {sock} (mode 0600: no token)" in line, line
    assert (sock.stat().st_mode & 0o777) == 0o600 and sock.stat().st_uid == os.geteuid()
    refused = _as_nobody("curl", "-s", "--max-time", "10", "--unix-socket", str(sock),
                         "http://localhost/")  # fmt: skip
    assert refused.returncode == 7 and refused.stdout == "", refused  # could not connect
    # Its owner needs no token there: the socket's mode said who it is.
    for path in ("/", "/api/plan/x"):  # the page; the API (a plan that is not one: 400)
        mine = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                               "--max-time", "10", "--unix-socket", str(sock),
                               f"http://localhost{path}"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert mine.stdout == ("200" if path == "/" else "400"), (path, mine)
    assert not _listens_on_tcp(proc.pid)  # --socket alone: no port at all
    # Another console is not let take it over, and says why in one line.
    taken = mesh_cli("console", "--socket", str(sock), nats_url=secured.url, creds=secured.viewer)
    assert one_line_error(taken) == f"mesh: error: --socket: {sock} is in use (another console " \
        "answers there)"  # fmt: skip
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    assert not sock.exists()  # removed as it stops
    # One left by a console that is gone (killed) is replaced, and made 0600 again.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as left:
        left.bind(str(sock))
    sock.chmod(0o666)
    _console(procs, secured.url, secured.viewer, "--socket", str(sock), name="console-again")
    assert (sock.stat().st_mode & 0o777) == 0o600


@pytest.mark.slow
@pytest.mark.skipif(not ROOT, reason=NOT_ROOT)
def test_dev_ups_console_gives_another_local_account_nothing(open_dir: Path) -> None:
    folder = open_dir / "dev"
    dev = DevUp(folder, hosts=0)
    try:
        found = dev.match(r"console http://127\.0\.0\.1:(\d+)/(\S*) \(read-only: the viewer's "
                          r"credentials, pid (\d+)\)$", within=180)  # fmt: skip
        port, pid = int(found.group(1)), int(found.group(3))
        # What the attack did, and the rest of what the console serves: 401.
        for path in PATHS:
            assert _status_as_nobody(f"http://127.0.0.1:{port}{path}") == "401", path
        assert _status_as_nobody(f"http://127.0.0.1:{port}/?token={WRONG}") == "401"
        token = found.group(2).removeprefix("?token=")
        assert re.fullmatch(r"[\w-]{43}", token), found.group(0)
        # Nor can it learn the token: not from the console's command line, its environment
        # (where `dev up` put it) or its log (DIR/logs is open to every account here).
        cmdline = _as_nobody("cat", f"/proc/{pid}/cmdline")
        assert cmdline.returncode == 0 and token not in cmdline.stdout
        environ = _as_nobody("cat", f"/proc/{pid}/environ")
        assert environ.returncode != 0 and token not in environ.stdout
        assert token not in (folder / "logs" / "console.log").read_text()
        # Whoever ran `dev up` has its URL: the token, then the cookie.
        first = _get(port, f"/?token={token}")
        assert first.status == 303 and f"{COOKIE}-{port}={token};" in first.getheader("Set-Cookie")
        assert _get(port, "/", {"Cookie": f"{COOKIE}-{port}={token}"}).status == 200
    finally:
        dev.kill()
        dev.drain()
        print("mesh dev up said:", *dev.seen[-200:], sep="\n")


# --- mesh mcp and mesh tool call -------------------------------------------------------------

# (the MCP tool's name, the field its error names, the value)
NOT_NAMES = [
    ("*.files.read", "machine", "*"),
    (">.files.read", "machine", ">"),
    ("node 1.files.read", "machine", "node 1"),
    ("node-1.*.read", "server", "*"),
    ("node-1.>.read", "server", ">"),
    ("node-1.files.*", "tool", "*"),
    ("node-1.files.>", "tool", ">"),
    ("node-1.files.re*d", "tool", "re*d"),
]


@pytest.mark.slow
async def test_mesh_mcp_refuses_names_that_are_not_names_and_goes_on(
    start_fleet, nc, nats_url, tmp_path
) -> None:
    await start_fleet(hosts=1)
    sent: list[str] = []  # what anyone sends about tools: the listing and calls

    async def heard(msg: Msg) -> None:
        if msg.subject.startswith("mesh.ctl.tools") or msg.subject.endswith(".tool"):
            sent.append(msg.subject)

    await nc.subscribe(">", cb=heard)
    await nc.flush()
    params = StdioServerParameters(command=MESH[0], args=[*MESH[1:], "mcp"],
                                   env={**os.environ, "MESH_NATS_URL": nats_url})  # fmt: skip
    with open(tmp_path / "mcp.log", "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                with anyio.fail_after(60):
                    await session.initialize()
                for name, field, value in NOT_NAMES:
                    with anyio.fail_after(30):
                        result = await session.call_tool(name, {})
                    said = result.content[0].text
                    assert result.is_error, (name, said)
                    assert f"{field}: {value!r} is not" in said, (name, said)
                # A machine's name with a dot cannot be told from the server's (the first dot
                # splits them): `node-1.x` alone is not a tool's name at all.
                two = await session.call_tool("node-1.x", {})
                assert two.is_error and "MACHINE.SERVER.TOOL" in two.content[0].text
                # It goes on serving: a name that is one is asked of the fleet and called on
                # node-1, whose host says what it lacks.
                with anyio.fail_after(60):
                    real = await session.call_tool("node-1.files.read", {"path": "x"})
                assert real.is_error and "no tool server files" in real.content[0].text, real
                assert (await session.list_tools()).tools == []

    async def the_real_call_seen() -> bool:
        return "mesh.host.node-1.tool" in sent

    await await_until(the_real_call_seen, within=30, what="the call on mesh.host.node-1.tool")
    # One publisher's messages arrive in order: nothing came before the real call's own
    # listing, so none of the names above reached the bus, not even to ask for the list.
    assert sent[: sent.index("mesh.host.node-1.tool")] == ["mesh.ctl.tools"], sent
    assert "Traceback" not in (tmp_path / "mcp.log").read_text()

    # The library's call, as any other client makes it: the same refusal, nothing sent.
    before = len(sent)
    for machine in ("*", ">", "node-1.x"):
        with pytest.raises(ToolCallFailed) as refused:
            await call_tool(nc, machine=machine, server="files", tool="read", arguments={},
                            timeout=5)  # fmt: skip
        assert refused.value.code == "bad_request"
        assert str(refused.value).startswith(f"machine: {machine!r} is not"), refused.value
    await nc.flush()
    assert len(sent) == before


def test_mesh_tool_call_refuses_names_that_are_not_names() -> None:
    # Refused before any connection is made: no NATS is needed to say so.
    for args, field, value in [
        (("node-1.x", "files", "read"), "MACHINE", "node-1.x"),
        (("*", "files", "read"), "MACHINE", "*"),
        (("node-1", ">", "read"), "SERVER", ">"),
        (("node-1", "files", "*"), "TOOL", "*"),
        (("node-1", "files", ">"), "TOOL", ">"),
    ]:
        line = one_line_error(mesh_cli("tool", "call", *args, nats_url="nats://127.0.0.1:1"))
        assert line.startswith(f"mesh: error: {field}: {value!r} is not"), (args, line)
