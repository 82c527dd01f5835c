"""A process's log rotates by size while the process runs: output.log and at most KEEP older
files, each at most LIMIT bytes, cut after whole lines; `mesh logs` shows the latest output and
`mesh logs -f` reads on across rotations, losing and repeating nothing, and streams: its request
waits at the host until there is new output, so it asks once per chunk, not once per interval."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from helpers import MESH, already, ask, await_until, mesh_cli, ok
from module_folders import write_module

from services.host import logwriter

LIMIT = 4096
KEEP = 3
STAMP_TEXT = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "  # in front of each line
STAMP = re.compile(rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ", re.M)
STAMPED = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z line \d{5} z*")

CHATTY = """\
import os, sys, time
print("starting", flush=True)
for i in range(1000):  # 100,000 bytes at once: many times what the files keep
    print(f"fast {i:04d} " + "x" * 89, flush=True)
print("fast done", flush=True)
go = os.path.join(os.environ["MESH_FILES"], "go")
while not os.path.exists(go):
    time.sleep(0.05)  # ok: the process under test polls for the test's signal
for i in range(150):  # paced: `mesh logs -f` keeps up across the rotations
    print(f"slow {i:04d} " + "y" * 89, flush=True)
    time.sleep(0.02)  # ok: the process under test writes at its own pace
print("slow done", flush=True)
time.sleep(3600)  # ok: it keeps running; its log rotated while it ran
"""


def _files(folder: Path) -> dict[str, int]:
    """The log files (not the offset record) and their sizes."""
    found = folder.glob("output.log*")
    return {p.name: p.stat().st_size for p in found if re.fullmatch(r"output\.log(\.\d+)?", p.name)}


def test_the_log_writer_rotates_at_whole_lines_and_reads_across_files(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    lines = [f"line {i:05d} {'z' * (i % 50)}\n".encode() for i in range(3000)]
    writer = subprocess.Popen(
        [sys.executable, "-I", "-S", logwriter.__file__, str(log), str(LIMIT), str(KEEP)],
        stdin=subprocess.PIPE,
    )
    assert writer.stdin is not None
    for i in range(0, len(lines), 37):  # writes of many sizes, not aligned with lines
        writer.stdin.write(b"".join(lines[i : i + 37]))
        writer.stdin.flush()
    writer.stdin.close()
    assert writer.wait(timeout=30) == 0  # it ends with its pipe

    sizes = _files(tmp_path)
    assert set(sizes) == {"output.log", *(f"output.log.{n}" for n in range(1, KEEP + 1))}
    assert all(size <= LIMIT for size in sizes.values())
    oldest_first = ["output.log.3", "output.log.2", "output.log.1", "output.log"]
    kept = b"".join((tmp_path / name).read_bytes() for name in oldest_first)
    # Each line with the time it was read in front of it, whole lines, in order.
    assert all(STAMPED.fullmatch(line) for line in kept.splitlines()), kept[:200]
    everything = b"".join(lines)
    assert everything.endswith(STAMP.sub(b"", kept)) and STAMPED.match(kept)

    # offsets count the whole output: the end is its length, and reading on is seamless
    end, last = logwriter.read(log, None, 100)
    assert end == logwriter.end(log) and last == kept[-100:]
    start = end - len(kept)
    assert start == logwriter.read(log, 0, 0)[0]  # the oldest byte kept
    offset, data = logwriter.read(log, start, 1000)
    assert data == kept[:1000] and offset == start + 1000
    offset, more = logwriter.read(log, offset, len(kept))
    assert data + more == kept and offset == end
    assert logwriter.read(log, 0, 10) == (start + 10, kept[:10])  # rotated away: oldest kept

    # The last N lines, across the files; the first line stamped at a time or later.
    assert logwriter.read(log, logwriter.tail_offset(log, 3), LIMIT)[1] == b"".join(
        kept.splitlines(keepends=True)[-3:]
    )
    assert logwriter.tail_offset(log, 10**6) == start  # fewer kept: from the oldest
    stamps = [line[: logwriter.STAMP_BYTES - 1] for line in kept.splitlines()]
    middle = stamps[len(stamps) // 2]
    at = logwriter.since(log, middle.decode())
    assert logwriter.read(log, at, logwriter.STAMP_BYTES - 1)[1] == middle
    assert stamps.index(middle) == len(kept[: at - start].splitlines())  # the first such line
    assert logwriter.since(log, "9999-01-01T00:00:00.000Z") == end
    assert logwriter.since(log, "2000-01-01T00:00:00.000Z") == start


def test_lines_are_stamped_where_they_start_whatever_the_chunks() -> None:
    now = b"T "
    out, at_start = logwriter.stamped(b"a\nb", at_start=True, now=now)
    assert (out, at_start) == (b"T a\nT b", False)
    out, at_start = logwriter.stamped(b"c\n\nd\n", at_start=at_start, now=now)
    assert (out, at_start) == (b"c\nT \nT d\n", True)
    assert logwriter.stamped(b"e", at_start=True, now=now) == (b"T e", False)


@pytest.fixture
async def small_logs_host(monkeypatch, start_fleet):
    """A controller and node-1, whose processes' logs rotate at LIMIT bytes."""
    monkeypatch.setenv("MESH_PROCESS_LOG_BYTES", str(LIMIT))
    monkeypatch.setenv("MESH_PROCESS_LOG_KEEP", str(KEEP))
    await start_fleet(hosts=1)


def _module(folder: Path, name: str = "chatty", script: str = CHATTY) -> Path:
    return write_module(
        folder,
        f'[module]\nname = "{name}"\n'
        f'[bundle.{name}]\nkind = "files"\nsource = "src"\n'
        f"[account.{name}]\n"
        f'[process.{name}]\nbundle = "{name}"\naccount = "{name}"\n'
        f'command = ["python3", "{name}.py"]\n'
        '[assign]\nmachines = ["node-1"]\n',
        files={f"src/{name}.py": script},
    )


def _logs(nats_url: str, process: str = "chatty") -> str:
    return ok(mesh_cli("logs", "node-1", process, nats_url=nats_url, timeout=30))


async def test_a_running_process_log_rotates_and_mesh_logs_follows(
    small_logs_host, nc, nats_url, tmp_path, cli
) -> None:
    ok(cli("push", str(_module(tmp_path / "m"))))
    folder = tmp_path / "hosts" / "node-1" / "processes" / "chatty"

    async def running():
        s = await ask(nc, "mesh.host.node-1.status")
        p = next((p for p in s["processes"] if p["name"] == "chatty"), None) if s else None
        return p if p and p["pid"] else None

    first = await await_until(running, within=60, what="chatty running")
    await await_until(
        lambda: already("fast done" in _logs(nats_url)), within=30, what="the fast lines"
    )
    sizes = _files(folder / "logs")
    assert set(sizes) == {"output.log", *(f"output.log.{n}" for n in range(1, KEEP + 1))}
    assert sum(sizes.values()) <= (KEEP + 1) * LIMIT  # bounded, while it runs
    assert "fast 0999" in _logs(nats_url)  # the latest output

    follow = subprocess.Popen(
        [*MESH, "logs", "node-1", "chatty", "-f", "--nats-url", nats_url],
        stdout=open(tmp_path / "follow.out", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        await await_until(
            lambda: already("fast done" in _read(tmp_path / "follow.out")),
            within=30,
            what="mesh logs -f to print what is there",
        )
        (folder / "files" / "go").touch()
        await await_until(
            lambda: already("slow done" in _read(tmp_path / "follow.out")),
            within=60,
            what="mesh logs -f to print the slow lines",
        )
    finally:
        os.killpg(follow.pid, 9)
        follow.wait(timeout=10)
    shown = _read(tmp_path / "follow.out")
    slow = re.findall(rf"^{STAMP_TEXT}slow (\d{{4}}) y+$", shown, flags=re.M)
    assert slow == [f"{i:04d}" for i in range(150)]  # across rotations: no gap, no repeat
    assert shown.count("fast done") == 1
    sizes = _files(folder / "logs")
    assert all(size <= LIMIT for size in sizes.values()) and len(sizes) == KEEP + 1
    again = await running()
    assert again["pid"] == first["pid"]  # rotated while it ran: never restarted for it


TICKER = """\
import os, sys, time
print("waiting", flush=True)
go = os.path.join(os.environ["MESH_FILES"], "go")
while not os.path.exists(go):
    time.sleep(0.05)  # ok: the process under test polls for the test's signal
for i in range(120):  # 12,000 bytes: the log rotates under the follower (LIMIT 4096)
    print(f"tick {i:04d} " + "t" * 89, flush=True)
    time.sleep(0.01)  # ok: it writes at its own pace
print("ticks done", flush=True)
time.sleep(3600)  # ok: then it is quiet, and keeps running
"""
IDLE = 3.0  # seconds of a quiet log in which a poller (every 0.5 s) would have asked 6 times


async def test_mesh_logs_follow_streams_new_lines_in_order_and_asks_nothing_while_idle(
    small_logs_host, nc, nats_url, tmp_path, cli
) -> None:
    ok(cli("push", str(_module(tmp_path / "m", "ticker", TICKER))))
    folder = tmp_path / "hosts" / "node-1" / "processes" / "ticker"
    await await_until(
        lambda: already("waiting" in _logs(nats_url, "ticker")), within=60, what="ticker waiting"
    )
    asked = [0]  # requests seen on the host's logs subject
    idle_from = [0]  # how many there were when the log went quiet
    idle: list[anyio.Event] = []  # set by a request past the one a stream has waiting

    async def on_request(_msg) -> None:
        asked[0] += 1
        if idle and asked[0] > idle_from[0] + 1:
            idle[0].set()

    counted = await nc.subscribe("mesh.host.node-1.logs", cb=on_request)
    await nc.flush()
    out, err = tmp_path / "follow.out", tmp_path / "follow.err"
    follow = subprocess.Popen(
        [*MESH, "logs", "node-1", "ticker", "-f", "--nats-url", nats_url],
        stdout=open(out, "wb"), stderr=open(err, "wb"), start_new_session=True,
    )  # fmt: skip
    try:
        await await_until(lambda: already("waiting" in _read(out)), within=30, what="-f started")
        (folder / "files" / "go").touch()  # every tick is written after -f started
        await await_until(
            lambda: already("ticks done" in _read(out)), within=60, what="-f to show every tick"
        )
        shown = _read(out)
        ticks = re.findall(rf"^{STAMP_TEXT}tick (\d{{4}}) t+$", shown, flags=re.M)
        assert ticks == [f"{i:04d}" for i in range(120)]  # in order, across rotations, once each
        assert shown.count("waiting") == 1 and shown.count("ticks done") == 1
        assert len(_files(folder / "logs")) > 1  # it did rotate under the follower

        # Quiet now: a poller asks every interval; a stream's one request waits at the host.
        idle_from[0] = asked[0]
        idle.append(anyio.Event())
        with anyio.move_on_after(IDLE):  # a deadline for something that must not happen
            await idle[0].wait()
        assert asked[0] - idle_from[0] <= 1, f"{asked[0] - idle_from[0]} requests in {IDLE:g}s"
        assert follow.poll() is None  # still following

        follow.send_signal(signal.SIGINT)  # Ctrl-C
        await await_until(lambda: already(follow.poll() is not None), within=10, what="-f to end")
        assert follow.returncode == 130 and "Traceback" not in _read(err), _read(err)
    finally:
        await counted.unsubscribe()
        if follow.poll() is None:
            os.killpg(follow.pid, 9)
            follow.wait(timeout=10)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def test_mesh_logs_of_a_machine_the_mesh_does_not_know_says_so(host, nats_url) -> None:
    """A host that does not answer: the controller says whether the machine is known at all."""
    unknown = mesh_cli("logs", "node-9", "api", nats_url=nats_url, answer=3)
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == (
        "mesh: error: machine node-9 is not known to this mesh (`mesh nodes` lists those it knows)"
    ), unknown.stderr


TALKER = """\
import os, sys
print("hello from {version}", flush=True)
crashed = os.path.join(os.environ["MESH_FILES"], "crashed-once")
if not os.path.exists(crashed):
    open(crashed, "w").close()
    print("about to crash", flush=True)
    sys.exit(3)
print("second run", flush=True)
import time
time.sleep(3600)  # ok: it keeps running
"""
PREP = 'print("preparing 1")\nprint("preparing 2", end="")\n'


def _talker(folder: Path, version: str) -> Path:
    return write_module(
        folder,
        '[module]\nname = "talker"\n[bundle.talker]\nkind = "files"\nsource = "src"\n'
        '[process.talker]\nbundle = "talker"\nroot = true\ncommand = ["python3", "talker.py"]\n'
        'prepare = ["python3", "prep.py"]\nrestart = "always"\n'
        '[assign]\nmachines = ["node-1"]\n',
        files={"src/talker.py": TALKER.format(version=version), "src/prep.py": PREP},
    )


async def test_mesh_logs_gives_times_markers_tail_since_json_and_the_preparation(
    host, nats_url, tmp_path, cli
) -> None:
    def logs(*args: str) -> str:
        return ok(mesh_cli("logs", "node-1", "talker", *args, nats_url=nats_url, timeout=30))

    ok(cli("push", str(_talker(tmp_path / "v1", "v1"))))
    await await_until(lambda: already("second run" in logs()), within=60, what="the second run")
    shown = logs().splitlines()
    assert all(re.match(STAMP_TEXT, line) for line in shown), shown  # each line, its time
    said = [line.split(" ", 1)[1] for line in shown]
    assert said[0].startswith("[mesh] talker started, spec sha256:"), said
    assert "a new version" not in said[0]  # its first start
    assert said[1:3] == ["hello from v1", "about to crash"], said
    assert said[3] == "[mesh] talker restarted (exited with code 3; restart 1, 1 in a row)", said
    assert said[4:] == ["hello from v1", "second run"], said

    assert logs("--tail", "2").splitlines() == shown[-2:]
    assert logs("--tail", "100").splitlines() == shown
    restart_at = shown[3].split(" ", 1)[0]  # a second (the backoff) after the first run's lines
    assert logs("--since", restart_at).splitlines() == shown[3:]
    assert logs("--since", "1h").splitlines() == shown
    as_json = json.loads(logs("--json", "--tail", "2"))
    assert (as_json["machine"], as_json["process"]) == ("node-1", "talker")
    assert [(line["at"], line["text"]) for line in as_json["lines"]] == [
        tuple(line.split(" ", 1)) for line in shown[-2:]
    ]
    for bad, why in ((("--since", "yesterday"), "--since: 'yesterday' is neither"),
                     (("--tail", "0"), "--tail: 0 is not a count")):  # fmt: skip
        usage = mesh_cli("logs", "node-1", "talker", *bad, nats_url=nats_url)
        assert usage.returncode == 2 and why in usage.stderr, usage.stderr
    both = mesh_cli("logs", "node-1", "talker", "--tail", "1", "--since", "1h", nats_url=nats_url)
    assert both.returncode == 1 and "--tail and --since: one or the other" in both.stderr

    prepared = [line.split(" ", 1)[1] for line in logs("--prepare").splitlines()]
    assert prepared[0].startswith("[mesh] prepare ['python3', 'prep.py'] of talker, spec ")
    assert prepared[1:] == ["preparing 1", "preparing 2", "[mesh] prepare ended: exit code 0"]

    ok(cli("push", str(_talker(tmp_path / "v2", "v2")), "--wait"))
    await await_until(lambda: already("hello from v2" in logs()), within=60, what="v2's output")
    started = [line for line in logs().splitlines() if "[mesh] talker started" in line]
    assert len(started) == 2 and "a new version (was sha256:" in started[1], started
