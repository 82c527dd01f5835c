"""Processes on a real host: restarted after SIGKILL, backing off when they crash, adopted by a
restarted host (same pids), swapped start-first only once the new version is healthy, prepared
before they start, and their output readable with `mesh logs`."""

import grp
import os
import signal
import uuid
from pathlib import Path

import pytest
from helpers import ask, await_until, mesh_cli, next_failure, ok
from module_folders import SERVER, svc_module, write_module

from mesh.embedded import ports


async def svc(nc) -> dict | None:
    status = await ask(nc, "mesh.host.node-1.status")
    if not status:
        return None
    return next((p for p in status["processes"] if p["name"] == "svc"), None)


async def healthy(nc) -> dict | None:
    p = await svc(nc)
    return p if p and p["healthy"] and p["pid"] else None


async def test_a_killed_process_comes_back(host, nc, tmp_path, cli) -> None:
    ok(cli("push", str(svc_module(tmp_path / "m", version="1", port=ports.free_port()))))
    first = await await_until(lambda: healthy(nc), within=30, what="svc healthy")
    os.kill(first["pid"], signal.SIGKILL)

    async def replaced():
        p = await healthy(nc)
        return p if p and p["pid"] != first["pid"] else None

    again = await await_until(replaced, within=20, what="svc restarted")
    assert again["state"] == "running"

    async def controller_knows():
        nodes = await ask(nc, "mesh.ctl.nodes")
        procs = nodes["nodes"][0]["processes"] if nodes else []
        return procs if procs and procs[0]["pid"] == again["pid"] else None

    await await_until(controller_knows, within=10, what="mesh nodes to show the new pid")

    # the host's restart verb: a new instance; an unknown process is an error, not a crash
    assert (await ask(nc, "mesh.host.node-1.restart", {"process": "svc"}, timeout=30)) == {
        "process": "svc",
        "restarted": True,
    }

    async def restarted():
        p = await healthy(nc)
        return p if p and p["pid"] != again["pid"] else None

    await await_until(restarted, within=20, what="svc restarted by the verb")
    reply = await ask(nc, "mesh.host.node-1.restart", {"process": "nope"})
    assert reply["error"]["code"] == "not_found"


async def test_a_crashing_process_backs_off(host, nc, tmp_path, cli) -> None:
    # Its plan would fail the crash loop at its third restart and take it away (test_causes.py):
    # here the loop is what is watched.
    folder = svc_module(tmp_path / "m", version="1", port=ports.free_port(), mode="crash",
                        rollout="crash_loop = 1000\n")  # fmt: skip
    ok(cli("push", str(folder)))
    log = tmp_path / "hosts" / "node-1" / "processes" / "svc" / "logs" / "output.log"
    await await_until(lambda: _starts(log, 3), within=60, what="two restarts")
    # Backoff 1 s, then 2 s: without it, a process that exits at once restarts hundreds of times.
    # The process says when it started (a loaded machine only lengthens the gaps).
    began = [float(line.rsplit(" ", 1)[1]) for line in log.read_text().splitlines()
             if " starting at " in line][:3]  # fmt: skip
    first, second = began[1] - began[0], began[2] - began[1]
    assert first >= 0.9 and second >= 1.8 and second > first, began
    p = await svc(nc)
    assert p["state"] in ("restarting", "running") and not p["healthy"]


async def _starts(log: Path, at_least: int) -> bool:
    try:
        return log.read_text().count("starting") >= at_least
    except FileNotFoundError:
        return False


async def test_a_restarted_host_adopts_its_processes(host, nc, tmp_path, start_host, cli) -> None:
    ok(cli("push", str(svc_module(tmp_path / "m", version="1", port=ports.free_port()))))
    before = await await_until(lambda: healthy(nc), within=30, what="svc healthy")
    os.killpg(host.pid, signal.SIGKILL)
    host.wait(timeout=10)
    assert os.path.exists(f"/proc/{before['pid']}")  # the process outlived its host
    start_host("node-1", "--tier", "0")

    async def adopted():
        s = await ask(nc, "mesh.host.node-1.status")
        if not s or s["pid"] == host.pid:
            return None
        p = next((p for p in s["processes"] if p["name"] == "svc"), None)
        return p if p and p["healthy"] else None

    after = await await_until(adopted, within=30, what="the new host to adopt svc")
    assert after["pid"] == before["pid"]


async def test_start_first_swaps_only_when_the_new_version_is_healthy(
    host, nc, nats_url, tmp_path, cli
) -> None:
    port = ports.free_port()
    folder = svc_module(tmp_path / "m", version="1", port=port, extra='update = "start-first"\n')
    ok(cli("push", str(folder)))
    v1 = await await_until(lambda: healthy(nc), within=30, what="v1 healthy")

    # v2 never listens: it never gets healthy, so v1 keeps running and the apply says why.
    # (Its check is on a port of its own: checking v1's port would find v1 answering.)
    events = await nc.subscribe("mesh.event.node-1.applied")
    await nc.flush()  # subscribed at the server before the push below
    deaf = ports.free_port()
    svc_module(folder, version="2", port=deaf, mode="deaf", extra='update = "start-first"\n')
    ok(cli("push", str(folder)))
    event = await next_failure(events, within=90)
    assert event["step"] == "processes" and "never got healthy" in event["error"]
    still = await await_until(lambda: healthy(nc), within=10, what="v1 still healthy")
    assert still["pid"] == v1["pid"]

    # v3 listens on a port of its own, so that it can run beside v1 until it is healthy
    port3 = ports.free_port()
    svc_module(folder, version="3", port=port3, extra='update = "start-first"\n')
    ok(cli("push", str(folder)))

    async def swapped():
        p = await healthy(nc)
        return p if p and p["pid"] != v1["pid"] else None

    v3 = await await_until(swapped, within=60, what="v3 to replace v1")
    assert not os.path.exists(f"/proc/{v1['pid']}")  # stopped and reaped: no zombie
    assert "version 3 listening" in ok(mesh_cli("logs", "node-1", "svc", nats_url=nats_url))
    assert v3["pid"]


async def test_prepare_runs_before_the_start_and_a_failing_one_keeps_the_old(
    host, nc, tmp_path, cli
) -> None:
    port = ports.free_port()
    prepare = 'prepare = ["python3", "prepare.py"]\n'
    folder = svc_module(tmp_path / "m", version="1", port=port, extra=prepare)
    # The order, seen by the process itself: prepare leaves a marker, and the process says in
    # its first line what it found at its start (nothing, had prepare not run yet).
    (folder / "src" / "server.py").write_text(
        "import os\n"
        "marker = os.path.join(os.environ['MESH_FILES'], 'prepared')\n"
        "found = open(marker).read() if os.path.exists(marker) else 'nothing'\n"
        "print(f'at start, the marker says: {found}', flush=True)\n" + SERVER
    )
    ok(cli("push", str(folder)))
    v1 = await await_until(lambda: healthy(nc), within=30, what="v1 healthy")
    processes = tmp_path / "hosts" / "node-1" / "processes" / "svc"
    assert (processes / "files" / "prepared").read_text() == "yes"
    output = [line.split(" ", 1)[-1] for line in  # each line after its time
              (processes / "logs" / "output.log").read_text().splitlines()]  # fmt: skip
    assert "at start, the marker says: yes" in output, output
    assert "at start, the marker says: nothing" not in output, output

    events = await nc.subscribe("mesh.event.node-1.applied")
    await nc.flush()  # subscribed at the server before the push below
    svc_module(
        folder,
        version="2",
        port=port,
        extra='prepare = ["python3", "-c", "raise SystemExit(4)"]\n',
    )
    ok(cli("push", str(folder)))
    event = await next_failure(events, within=60)
    assert event["step"] == "prepare svc" and "exit code 4" in event["error"]
    kept = await await_until(lambda: healthy(nc), within=10, what="v1 still healthy")
    assert kept["pid"] == v1["pid"]


IN_GROUP = """\
import grp, os, sys
sys.exit(0 if grp.getgrnam(sys.argv[1]).gr_gid in os.getgroups() else 1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="accounts with groups are made only as root")
async def test_an_exec_check_runs_with_the_accounts_supplementary_groups(
    host, nc, tmp_path, cli
) -> None:
    # The process has its account's groups; its check must too, or a check that reads what
    # only the group may read fails while the process itself is fine.
    tag = uuid.uuid4().hex[:6]
    account, group = f"svc-g{tag}", f"meshg{tag}"
    folder = write_module(
        tmp_path / "m",
        '[module]\nname = "svc"\n'
        '[bundle.svc]\nkind = "files"\nsource = "src"\n'
        f'[account.{account}]\ngroups = ["{group}"]\n'
        f'[process.svc]\nbundle = "svc"\naccount = "{account}"\n'
        'command = ["python3", "-c", "import signal; signal.pause()"]\n'
        f'check = {{ exec = ["python3", "in_group.py", "{group}"], every = "300ms", passes = 2 }}\n'
        '[assign]\nmachines = ["node-1"]\n',
        files={"src/in_group.py": IN_GROUP},
    )
    ok(cli("push", str(folder)))
    p = await await_until(lambda: healthy(nc), within=30, what="svc healthy by its exec check")
    status = Path(f"/proc/{p['pid']}/status").read_text()
    groups = next(line for line in status.splitlines() if line.startswith("Groups:"))
    assert str(grp.getgrnam(group).gr_gid) in groups.split()  # the process has the group too
