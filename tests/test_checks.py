"""Each kind of check, against real things: a listening socket, an HTTP server, a command,
a NATS responder; and a failing one of each."""

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from mesh.embedded import ports
from mesh.modules.compose import DProcess
from mesh.modules.manifest import Check
from services.host import checks


def proc(check: Check) -> DProcess:
    return DProcess(
        module="m", bundle="system:/", command=["x"], account=None, root=True, env={}, files={},
        prepare=None, prepare_timeout="5m", restart="always", check=check, update="stop-first",
        replaces=None, stop_timeout="10s",
    )  # fmt: skip


async def once(nc, check: Check) -> tuple[bool, str]:
    return await checks.once(proc(check), nc=nc, cwd=Path("/"), uid=None, gid=None, env={})


async def test_tcp(nc) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert (await once(nc, Check(tcp=s.getsockname()[1], timeout="1s")))[0]
    passed, why = await once(nc, Check(tcp=ports.free_port(), timeout="1s"))
    assert not passed and why


class _Status(BaseHTTPRequestHandler):
    hosts: list[str] = []  # the Host header of every request, in order

    def do_GET(self) -> None:
        _Status.hosts.append(self.headers.get("Host", ""))
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/ok")  # a check must not follow it to the 200
        else:
            self.send_response(200 if self.path == "/ok" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_port():
    server = HTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


# A generous timeout where the server answers: what these show is what an answer makes of the
# check; a loaded machine (the suite in workers) may take more than the default 1 s to answer.
ANSWERED = "10s"


async def test_http(nc, http_port) -> None:
    assert (await once(nc, Check(http=f"http://127.0.0.1:{http_port}/ok", timeout=ANSWERED)))[0]
    passed, why = await once(nc, Check(http=f"http://127.0.0.1:{http_port}/sick", timeout=ANSWERED))
    assert not passed and "503" in why


async def test_http_a_redirect_fails_and_is_not_followed(nc, http_port) -> None:
    _Status.hosts.clear()
    passed, why = await once(
        nc, Check(http=f"http://127.0.0.1:{http_port}/moved", timeout=ANSWERED)
    )
    assert not passed and "302" in why
    assert len(_Status.hosts) == 1  # the redirect to /ok was not followed


async def test_http_sends_the_port_in_the_host_header(nc, http_port) -> None:
    # A server routing by Host (virtual hosts, a proxy) must see the port the URL names.
    _Status.hosts.clear()
    assert (await once(nc, Check(http=f"http://localhost:{http_port}/ok", timeout=ANSWERED)))[0]
    assert _Status.hosts == [f"localhost:{http_port}"]


async def test_http_nothing_listening_fails_within_the_timeout(nc) -> None:
    passed, why = await once(nc, Check(http=f"http://127.0.0.1:{ports.free_port()}/", timeout="1s"))
    assert not passed and why


async def test_exec(nc) -> None:
    assert (await once(nc, Check(exec=["true"])))[0]
    passed, why = await once(nc, Check(exec=["false"]))
    assert not passed and "exit code 1" in why


async def test_nats(nc) -> None:
    async def answer(msg):
        await msg.respond(b"{}")

    await nc.subscribe("test.health", cb=answer)
    await nc.flush()
    assert (await once(nc, Check(nats="test.health", timeout="2s")))[0]
    passed, _ = await once(nc, Check(nats="test.nobody", timeout="500ms"))
    assert not passed


async def test_tcp_passes_only_for_the_process_that_holds_the_port(nc) -> None:
    # What `replaces` relies on: an old version or container on the same port is not us.
    port = ports.free_port()
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTEN, str(port)], start_new_session=True, stdout=subprocess.PIPE
    )
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert listener.stdout is not None
        assert listener.stdout.readline() == b"listening\n"
        check = Check(tcp=port, timeout="1s")
        assert (await checks.once(proc(check), nc=nc, cwd=Path("/"), uid=None, gid=None,
                                  env={}, session=listener.pid))[0]  # fmt: skip
        passed, why = await checks.once(
            proc(check), nc=nc, cwd=Path("/"), uid=None, gid=None, env={}, session=other.pid
        )
        assert not passed and "not from this process" in why
    finally:
        for p in (listener, other):
            p.kill()
            p.wait()


LISTEN = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
print("listening", flush=True); time.sleep(60)  # ok: the listener under test stays up
"""


# An HTTP server answering every GET with the status given, on a port it shares with SO_REUSEPORT.
SERVE = """
import http.server, socket, sys
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(int(sys.argv[2])); self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args): pass
class Server(http.server.HTTPServer):
    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()
server = Server(("127.0.0.1", int(sys.argv[1])), Answer)
print("listening", flush=True); server.serve_forever()
"""


async def test_http_counts_only_when_the_process_alone_holds_the_port(nc) -> None:
    """Two processes share a port (SO_REUSEPORT, as `mesh dev up`'s hosts on one machine may):
    which one answered cannot be told, so the check fails saying so, whatever the status. Alone
    on it, the process's own answer counts; a process not on the port is not answered for."""
    port = ports.free_port()
    sick, well = (
        subprocess.Popen(
            [sys.executable, "-c", SERVE, str(port), status],
            start_new_session=True,
            stdout=subprocess.PIPE,
        )
        for status in ("503", "200")
    )
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)
    check = Check(http=f"http://127.0.0.1:{port}/health", timeout=ANSWERED)

    async def as_session(pid: int) -> tuple[bool, str]:
        return await checks.once(
            proc(check), nc=nc, cwd=Path("/"), uid=None, gid=None, env={}, session=pid
        )

    try:
        for p in (sick, well):
            assert p.stdout is not None and p.stdout.readline() == b"listening\n"
        for _ in range(5):  # whichever the kernel hands each connection to
            passed, why = await as_session(sick.pid)
            assert not passed and f"port {port} is listened on by another process too" in why
        # The other is its own other version (start-first): the URL tells them apart, and
        # whichever answered counts (docs/modules.md, `update`).
        kin = await checks.once(proc(check), nc=nc, cwd=Path("/"), uid=None, gid=None, env={},
                                session=sick.pid, kin=[well.pid])  # fmt: skip
        assert kin in ((True, "HTTP status 200"), (False, "HTTP status 503")), kin
        well.kill()
        well.wait()
        assert await as_session(sick.pid) == (False, "HTTP status 503")  # its own answer
        passed, why = await as_session(other.pid)
        assert not passed and "answers, but not from this process" in why
    finally:
        for p in (sick, well, other):
            p.kill()
            p.wait()
