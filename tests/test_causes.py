"""A failure's cause reaches the plan (issue 42): a process that crashes over and over fails its
step as soon as its host has restarted it `crash_loop` times in a row, saying how it exited,
rather than when the deadline passes; a process whose check fails names what the check said.
Real hosts, real processes, through the command line."""

import io
import socket
from datetime import UTC, datetime, timedelta

from helpers import ok_json
from module_folders import svc_module, write_module
from rich.console import Console

from mesh.embedded import ports
from mesh.model import Node, NodesReply, ProcessState
from programs.cli import render

# An HTTP server whose every answer is 503: its process runs, its check never passes.
SICK = """\
import http.server, sys

class Sick(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Sick).serve_forever()
"""


def _last_plan(cli) -> dict:
    newest = ok_json(cli("plan", "--json"))["plans"][0]
    return ok_json(cli("plan", str(newest["id"]), "--json"))


async def test_a_crash_loop_fails_its_step_at_once_saying_how_it_exited(
    host, cli, tmp_path
) -> None:
    # The deadline is 150 s: a failure that names the loop came from the host's restarts.
    folder = svc_module(tmp_path / "svc", version="1", port=ports.free_port(), mode="crash")
    failed = cli("push", str(folder), "--wait")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    plan = _last_plan(cli)
    assert plan["state"] == "reverted", plan
    said = plan["failure"]  # with the last line it printed before it exited
    assert said.startswith(
        "machine node-1: process svc is in a crash loop: exited with code 3 (its last line: "
        "version 1 starting at "
    ) and said.endswith("); restarted 3 time(s) in a row"), said
    assert "crash loop" in failed.stderr.strip().splitlines()[-1], failed.stderr


async def test_a_failing_check_is_named_in_the_plan(host, cli, tmp_path) -> None:
    """...and the host's log does not say each check it made (a line per request, before)."""
    port = ports.free_port()
    folder = write_module(
        tmp_path / "sick",
        '[module]\nname = "sick"\n'
        '[bundle.code]\nkind = "files"\nsource = "src"\n'
        '[process.sick]\nbundle = "code"\nroot = true\n'
        f'command = ["python3", "sick.py", "{port}"]\n'
        f'check = {{ http = "http://127.0.0.1:{port}/health", every = "200ms", timeout = "5s" }}\n'
        '[rollout]\ndeadline = "15s"\n'
        '[assign]\nmachines = ["node-1"]\n',
        files={"src/sick.py": SICK},
    )
    failed = cli("push", str(folder), "--wait")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    plan = _last_plan(cli)
    assert plan["state"] == "reverted", plan
    assert plan["failure"].startswith("machine node-1: process sick is running, not healthy"), plan[
        "failure"
    ]
    assert plan["failure"].endswith("its check said: HTTP status 503"), plan["failure"]
    said = host.log_path.read_text()
    assert "process sick" in said and "HTTP Request:" not in said


def test_nodes_shows_each_process_restarts_and_what_its_check_said() -> None:
    started = datetime.now(UTC) - timedelta(minutes=10)
    sick = ProcessState("api", "running", False, 41, restarts=4, in_a_row=2, since=started,
                        check="HTTP status 503")  # fmt: skip
    looping = ProcessState("worker", "restarting", False, None, reason="exited with code 1",
                           restarts=3, in_a_row=3)  # fmt: skip
    node = Node(name="node-1", tier=0, labels={}, up=True, last_seen=None, facts=None,
                processes=[sick, looping])  # fmt: skip
    out = io.StringIO()
    render.nodes(Console(file=out, width=300, color_system=None), NodesReply(nodes=[node]))
    row = out.getvalue().splitlines()[1]
    assert (
        "api running pid 41 [started 10m ago; 4 restart(s), 2 in a row; check: HTTP status 503]"
        in row
    )
    assert "worker restarting (exited with code 1) [3 restart(s), 3 in a row]" in row


BIND = "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))"


async def test_a_process_without_a_check_that_dies_at_start_over_and_over_is_not_done(
    host, cli, tmp_path
) -> None:
    """Without a check a process counts healthy once it has run a second (supervisor.SETTLE):
    one that dies before, each time (here: its port is taken), is a crash loop, not a step
    done, and the plan says the last line it printed."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        folder = write_module(
            tmp_path / "dies",
            '[module]\nname = "dies"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
            '[process.dies]\nbundle = "code"\nroot = true\nrestart = "always"\n'
            f'command = ["python3", "-c", "{BIND}", "{port}"]\n'
            '[rollout]\ndeadline = "150s"\n[assign]\nmachines = ["node-1"]\n',
            files={"src/x": "x"},
        )
        failed = cli("push", str(folder), "--wait")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    plan = _last_plan(cli)
    assert plan["state"] == "reverted", plan
    assert plan["failure"] == (
        "machine node-1: process dies is in a crash loop: exited with code 1 (its last line: "
        "OSError: [Errno 98] Address already in use); restarted 3 time(s) in a row"
    ), plan["failure"]
