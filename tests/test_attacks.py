"""Attacks on a running mesh, each made as the attack on `mesh dev up` made it: with that piece's
own credentials, its raw subjects and the JetStream API, against a real nats-server, real
controllers, hosts and PostgreSQL. Each shows the hole closed: the server refuses the action, or
the piece it was aimed at refuses what arrived (and says so in its log), and nothing moved.

docs/security.md, "Threat model", lists what each compromised piece can and cannot do. The
attacks of issue 39 are here too: a scoped operator (a deployer of `web-*`, bob) through what it
may push and the raw JetStream API; a local account at the console's port; names that are not
names given to `mesh mcp`; and a host flooding its own subjects.
"""

import base64
import grp
import http.client
import json
import logging
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import anyio
import asyncpg
import msgspec
import nats
import pytest
from helpers import (
    MESH,
    DevUp,
    ask,
    await_until,
    env_file,
    js,
    mesh_cli,
    next_failure,
    node_named,
    ok,
    ok_json,
    one_line_error,
    wait_until,
)
from mcp import ClientSession, StdioServerParameters, stdio_client
from module_folders import HELLO, built_module
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from secured import Secured

from mesh import blobs, bus, wire
from mesh.auth import creds as credentials
from mesh.auth import registry, secretkeys
from mesh.auth.signing import Signing
from mesh.client.tools import ToolCallFailed, call_tool
from mesh.embedded import ports, postgres
from mesh.model import Applied, Beat, Facts, Register, SeatAnnounce
from mesh.modules import archive, compose, gate
from mesh.store import db, secrets
from mesh.store.migrate import migrate
from programs.console.server import COOKIE
from services.controller.fleet import noisy
from services.controller.fleet.noisy import Budgets
from services.host import mcpstdio

ROOT = Path(__file__).parent.parent
SECRET = "s3cr3t-attack-51f0"


# --- the bus: deliveries, reflections, the seat and the bundle store ---------------------------


async def _logged(path: Path, *words: str, within: float, what: str) -> None:
    """Wait until a line of `path` has all `words` (the event loop runs meanwhile: what we
    published goes out)."""

    async def said() -> bool:
        return any(all(w in line for w in words) for line in path.read_text().splitlines())

    await await_until(said, within=within, what=what)


async def _applied(admin: Client, machine: str) -> dict | None:
    node = await node_named(admin, machine)
    if node and node["digest_wanted"] and node["digest_applied"] == node["digest_wanted"]:
        return node
    return None


async def _hello_on(secured: Secured, admin: Client, machine: str) -> None:
    """node-1 with a declaration in the bucket: what its own watch consumer can deliver."""
    ok(secured.cli(secured.admin, "secret", "set", "hello-token", stdin=SECRET))
    ok(secured.cli(secured.admin, "push", str(HELLO), "--timeout", "120"))
    ok(secured.cli(secured.admin, "assign", "hello", machine, "--timeout", "120"))
    await await_until(lambda: _applied(admin, machine), within=60, what=f"{machine} to apply")


async def _consumer(nc: Client, stream: str, **config) -> str:
    """Create a push consumer as `nc`: its name, or why not ("refused": never answered)."""
    try:
        made = await nc.jsm().add_consumer(stream, config=ConsumerConfig(**config), timeout=2)
    except NatsTimeout:
        return "refused"
    return made.name or "made"


@pytest.fixture
def marker_dir(tmp_path: Path):
    """A folder any account may write in (a build runs as `mesh-build`): where a command that
    an attacker got run would leave its mark."""
    folder = Path(tempfile.mkdtemp(prefix="mesh-attack-", dir=tmp_path / "hosts"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_a_builder_cannot_make_another_host_run_a_command(
    secured_fleet, secured, as_identity, tmp_path, marker_dir
):
    """Rows 1 and 2: a build request stored in the bundle store by the builder (node-1) and
    delivered to node-2's `build` verb by a push consumer whose deliver subject the server does
    not check; and a host's own watch consumer aimed at another host's verbs."""
    admin = secured_fleet
    marker = marker_dir / "ran"
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (source_dir / "x").write_text("x\n")
    source = await blobs.put(await blobs.store(admin), archive.pack(source_dir))
    request = wire.encode({
        "key": blobs.digest(b"evil"), "module": "evil", "bundle": "x", "source": source,
        "path": ".", "argv": ["touch", str(marker)], "output": ".", "timeout": 10,
        "kind": "command",
    })  # fmt: skip
    builder = await as_identity(secured.creds("host", "node-1"))

    # The attack as it was made: refused by the server at each step now.
    assert await builder.publish_refused("$O.mesh-bundles.C.build", request)
    made = await _consumer(
        builder.nc, "OBJ_mesh-bundles", name="x", filter_subject="$O.mesh-bundles.C.build",
        deliver_subject="mesh.host.node-2.build", ack_policy=AckPolicy.NONE,
    )  # fmt: skip
    assert made == "refused"
    # What a builder may write (its builds' bucket) it cannot have delivered or read back raw.
    assert not await builder.publish_refused("$O.mesh-builds.C.build", request)
    made = await _consumer(
        builder.nc, "OBJ_mesh-builds", name="y", filter_subject="$O.mesh-builds.C.build",
        deliver_subject="mesh.host.node-2.build", ack_policy=AckPolicy.NONE,
    )  # fmt: skip
    assert made == "refused"
    assert await builder.publish_refused("$JS.API.DIRECT.GET.OBJ_mesh-builds.$O.mesh-builds.C.>")
    assert await builder.publish_refused("$JS.API.DIRECT.GET.OBJ_mesh-bundles")

    # The one consumer a host may still make, on its own key, aimed at node-2's verbs: it
    # arrives, under the subject it was stored as, and node-2 refuses it.
    await _hello_on(secured, admin, "node-1")
    made = await _consumer(
        builder.nc, "KV_mesh-declarations", name="aimed",
        filter_subject="$KV.mesh-declarations.node-1", deliver_subject="mesh.host.node-2.build",
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ack_policy=AckPolicy.NONE,
    )  # fmt: skip
    assert made == "aimed"
    node2_log = tmp_path / "node-2.log"
    await _logged(
        node2_log, "refused a message on mesh.host.node-2.build", "$KV.mesh-declarations.node-1",
        within=20, what="node-2 to refuse the delivery aimed at its build verb",
    )  # fmt: skip
    assert not marker.exists(), "node-2 ran a command a builder sent it"
    # node-2 is none the worse: it answers, and ran no build.
    status = await ask(admin, "mesh.host.node-2.status")
    assert status is not None and status["name"] == "node-2", status
    assert "building evil/x" not in node2_log.read_text()


async def test_a_forged_seat_announcement_moves_no_host(secured_fleet, secured, as_identity):
    """Row 3: a forged `held` of epoch 99 sent every host registering again and again, its
    loop stuck waiting for a holder of that epoch. The builder can no longer store one where a
    consumer would deliver it; and one that reaches the subject unsigned (here: published with
    the controllers' own credentials, without their signature) is refused by every host."""
    admin = secured_fleet
    before = await ask(admin, "mesh.host.node-2.status")
    assert before is not None and before["epoch"] >= 1
    forged = wire.encode(SeatAnnounce(instance="evil", pid=1, host="evil",
                                      since=datetime.now(UTC), epoch=99))  # fmt: skip
    builder = await as_identity(secured.creds("host", "node-1"))
    assert await builder.publish_refused("$O.mesh-bundles.C.held", forged)
    assert not await builder.publish_refused("$O.mesh-builds.C.held", forged)
    made = await _consumer(
        builder.nc, "OBJ_mesh-builds", name="seat", filter_subject="$O.mesh-builds.C.held",
        deliver_subject="mesh.seat.mesh-controller.held", ack_policy=AckPolicy.NONE,
    )  # fmt: skip
    assert made == "refused"

    # Unsigned, then a genuine `held` of the current epoch from the same connection (so in
    # that order): a host not stuck on the forged one answers the genuine one by reporting
    # its processes again.
    controller_creds = secured.creds("controller", registry.CONTROLLER)
    current = wire.encode(SeatAnnounce(instance="ctl-a", pid=1, host="ctl",
                                       since=datetime.now(UTC), epoch=before["epoch"]))  # fmt: skip
    reports = await admin.subscribe("mesh.event.node-2.processes", max_msgs=1)
    await admin.flush()
    ctl = await secured.connect(controller_creds)
    try:
        await ctl.publish("mesh.seat.mesh-controller.held", forged)
        subject = "mesh.seat.mesh-controller.held"
        signed = Signing.controller(controller_creds).headers(subject, current)
        await ctl.publish(subject, current, headers=signed)
        await ctl.flush()
        await reports.next_msg(timeout=20)  # node-2 handled both, in order
    finally:
        await ctl.close()
    for name in ("node-1", "node-2"):
        now = await ask(admin, f"mesh.host.{name}.status")
        assert now is not None and now["epoch"] == before["epoch"], (name, now)
    status = await ask(admin, "mesh.ctl.status")
    assert status["seat"]["epoch"] == before["epoch"] and status["nodes"]["up"] == 2, status


async def test_a_reflected_answer_is_no_hosts_report(secured_fleet, secured, as_identity, tmp_path):
    """Reflection into the controller's reports: node-2 asks the JetStream API to make a
    consumer named `node-1`, with node-1's tools report as the reply subject; the answer (its
    top level has `"name": "node-1"`) would read as node-1 reporting no tool servers."""
    admin = secured_fleet
    ok(secured.cli(secured.admin, "push", str(ROOT / "docs" / "examples" / "files"),
           "--timeout", "120"))  # fmt: skip
    ok(secured.cli(secured.admin, "assign", "files", "node-1", "--timeout", "120"))

    async def servers() -> list:
        reply = await ask(admin, "mesh.ctl.tools", {"machine": "node-1"})
        return [t for t in (reply or {}).get("tools", []) if t["state"] == "ready"]

    await await_until(servers, within=60, what="node-1's tool server ready")
    host = await as_identity(secured.creds("host", "node-2"))
    await host.nc.publish(
        "$JS.API.CONSUMER.CREATE.KV_mesh-declarations.node-1.$KV.mesh-declarations.node-2",
        json.dumps({"stream_name": "KV_mesh-declarations", "config": {
            "name": "node-1", "filter_subject": "$KV.mesh-declarations.node-2",
            "deliver_subject": "_INBOX_node-2.nowhere", "ack_policy": "none",
            "inactive_threshold": 5_000_000_000}}).encode(),
        reply="mesh.event.node-1.tools",
    )  # fmt: skip
    await host.nc.flush()
    await _logged(
        tmp_path / "ctl-a.log", "refused a message on mesh.event.*.*",
        "answer of the JetStream API", within=20, what="the controller to refuse the answer",
    )  # fmt: skip
    assert await servers(), "node-1's tools were taken away by an answer reflected as its report"


async def test_no_host_purges_or_overwrites_the_bundle_store(secured_fleet, secured, as_identity):
    """Row 4: the builder purged the bundle store (302 objects gone, plans reverted). Now
    neither a builder nor another host may purge, roll up or write it; hosts still read it,
    one message per request."""
    admin = secured_fleet
    obs = await blobs.store(admin)
    kept = await blobs.put(obs, b"a bundle that must stay")
    info = await admin.jsm().stream_info("OBJ_mesh-bundles")
    for name in ("node-1", "node-2"):
        host = await as_identity(secured.creds("host", name))
        assert await host.publish_refused("$JS.API.STREAM.PURGE.OBJ_mesh-bundles")
        assert await host.publish_refused("$O.mesh-bundles.M.x")  # a rollup would purge too
        assert await host.publish_refused("$O.mesh-bundles.C.x")
        assert await host.publish_refused("$JS.API.CONSUMER.CREATE.OBJ_mesh-bundles")
        assert await blobs.get(host.nc, kept) == b"a bundle that must stay"
    after = await admin.jsm().stream_info("OBJ_mesh-bundles")
    assert after.state.messages == info.state.messages


async def test_hosts_credentials_name_the_controllers_key(secured: Secured):
    """What hosts check signatures with is in the one file a machine is given, and follows the
    controllers' identity when it is issued again."""
    users = registry.Registry.load(secured.dir)
    controller = users.get("controller", registry.CONTROLLER)
    assert controller is not None
    for name in ("node-1", "node-2"):
        assert credentials.read(secured.creds("host", name)).controller == controller.public
    with registry.locked(secured.dir) as users:
        users.issue("controller", registry.CONTROLLER)
        users.save()
        renewed = users.get("controller", registry.CONTROLLER)
    assert renewed is not None and renewed.public != controller.public
    for name in ("node-1", "node-2"):
        assert credentials.read(secured.creds("host", name)).controller == renewed.public


async def test_the_bundle_store_heals_from_a_push(secured_fleet, secured, tmp_path):
    """Row 4, after a purge (JetStream's data lost, or purged by the one identity that still
    may): plans reverted one by one (`sha256:… is not in mesh-bundles`) and a push answered
    `no change`. Now a plan that would need a missing bundle stops before any machine, saying
    what to run, and a push of the same folder stores (and builds) what is missing again."""
    admin = secured_fleet
    built = built_module(
        tmp_path / "built",
        "set -e\nmkdir -p out\nprintf '#!/bin/sh\\necho built\\n' > out/app\n",
        process=False,
    )
    await _hello_on(secured, admin, "node-2")
    ok(secured.cli(secured.admin, "push", str(built), "--timeout", "120"))
    await admin.jsm().purge_stream("OBJ_mesh-bundles")

    assigned = secured.cli(secured.admin, "--json", "assign", "hello", "node-1", "--wait",
                   "--timeout", "120")  # fmt: skip
    assert assigned.returncode != 0
    plan = ok_json(secured.cli(secured.viewer, "--json", "plan",
                             str(json.loads(assigned.stdout)["plan"])))  # fmt: skip
    assert plan["state"] == "reverted", plan
    assert "not in the bundle store" in plan["failure"] and "mesh push" in plan["failure"], plan
    assert all(s["state"] == "pending" for s in plan["steps"]), plan  # no machine touched

    for folder in (HELLO, built):
        pushed = ok_json(secured.cli(secured.admin, "--json", "push", str(folder),
                                   "--timeout", "120"))  # fmt: skip
        assert "restored" in pushed["message"] and pushed["plan"] is None, pushed
    ok(secured.cli(secured.admin, "assign", "hello", "node-1", "--wait", "--timeout", "120"))
    await await_until(lambda: _applied(admin, "node-1"), within=60, what="node-1 to apply")
    again = ok_json(secured.cli(secured.admin, "--json", "push", str(HELLO)))
    assert again["plan"] is None and again["message"] == "no change", again


# --- the gate and the wire ---
# JSON nested thousands deep (the decoder's recursion: an `internal` error and a traceback in
# the holder's log), NUL bytes and privileged accounts and groups that only a host refused (or
# nobody), numbers out of any range, the CLI reading a module's whole folder into memory
# before measuring it, and a verb whose limit was not what its docs said.

DEEP = b"[" * 5000 + b"]" * 5000  # what the attack sent: 10 KB, under every verb's limit
NOWHERE = "sha256:" + "0" * 64  # a source nobody uploaded: the gate refuses before it is read
FACTS = {"os": "linux", "arch": "x86_64", "cpus": 1, "memory": 1, "mesh_version": "0"}


def _register(name: str = "node-x") -> dict:
    return {"name": name, "tier": 1, "labels": {}, "facts": FACTS, "beat_interval": 1, "pid": 1}


@pytest.mark.parametrize(
    ("body", "deepest"),
    [
        (b"[" * 64 + b"]" * 64, None),  # the limit itself is fine
        (b"[" * 65 + b"]" * 65, 65),
        (b'{"a": ' * 65 + b"1" + b"}" * 65, 65),
        (b"[]" * 100_000, None),  # many, side by side, is not deep
        (b'["' + b"[" * 5000 + b'"]', None),  # brackets in a string are text
        (b'["\\"' + b"{" * 5000 + b'\\\\", 1]', None),  # ... escaped quotes and all
        (b"[" * 5000, 5000),  # never closed: the decoder would still recurse into each
        (DEEP, 5000),
    ],
)
def test_nesting_is_measured_on_the_bytes_before_decoding(body: bytes, deepest: int) -> None:
    if deepest is None:
        wire.check_depth(body)
        return
    with pytest.raises(wire.TooDeep) as e:
        wire.decode_json(body)
    assert str(e.value) == f"arrays and objects nested {deepest} deep, at most {wire.MAX_DEPTH}"
    assert isinstance(e.value, msgspec.DecodeError)  # so refused wherever malformed JSON is


async def test_json_nested_5000_deep_is_a_bad_request_and_the_holder_goes_on(
    nc, start_controller
) -> None:
    ctl = start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=20, what="the controller")
    registered = await ask(nc, "mesh.ctl.host.node-x.register", _register())
    assert registered is not None and "error" not in registered, registered
    # A host's own request (its registration), nested 5,000 deep in a field a newer host might
    # add (skipped, as a Peer's unknown fields are: the decoder recursed into it all the same,
    # an `internal` error), and an operator's verb nested as deep where a word belongs.
    later = json.dumps(_register()).encode()[:-1] + b', "added_later": ' + DEEP + b"}"
    for subject, body in [
        ("mesh.ctl.host.node-x.register", later),
        ("mesh.ctl.label", b'{"machine": "node-x", "set": {"a": ' + DEEP + b"}}"),
    ]:
        reply = await ask(nc, subject, body)
        assert reply is not None, f"{subject}: no answer"
        assert reply["error"]["code"] == "bad_request", (subject, reply)
        # DEEP and the object (or two) it lies in
        said = "body: arrays and objects nested 500[12] deep, at most 64"
        assert re.fullmatch(said, reply["error"]["message"]), (subject, reply)
    # A host's reports (nobody answers them): ignored as any malformed report, in the order
    # they came, so once the good report after them is heard they have been read.
    await nc.publish("mesh.event.node-x.tools", b'{"name": "node-x", "later": ' + DEEP + b"}")
    await nc.publish("mesh.event.node-x.applied", b'{"name": "node-x", "later": ' + DEEP + b"}")
    server = {"name": "s", "state": "ready", "tools": [{"name": "t"}]}
    good = {"name": "node-x", "servers": [server]}
    await nc.publish("mesh.event.node-x.tools", json.dumps(good).encode())

    async def heard() -> bool:
        listed = await ask(nc, "mesh.ctl.tools", {"machine": "node-x"})
        return bool(listed and [t["name"] for t in listed.get("tools", [])] == ["t"])

    await await_until(heard, within=10, what="the good report after the deep ones")
    status = await ask(nc, "mesh.ctl.status")
    assert status["seat"]["holder"] == "ctl-a"
    log = ctl.log_path.read_text()
    assert "RecursionError" not in log and "Traceback" not in log, log[-3000:]


async def test_a_tool_server_writing_json_5000_deep_does_not_speak_mcp() -> None:
    # A tool server's messages are bounded by the same rule as the bus's (one helper).
    line = b'{"jsonrpc": "2.0", "id": 1, "result": ' + DEEP + b"}\n"
    server = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.stdout.write({line.decode()!r}); "
         "sys.stdout.flush(); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert server.stdin is not None and server.stdout is not None
        os.set_blocking(server.stdout.fileno(), False)
        session = mcpstdio.Session(stdin=server.stdin.fileno(), stdout=server.stdout.fileno())
        with pytest.raises(mcpstdio.ProtocolError) as e, anyio.fail_after(20):
            await session.run()
        assert str(e.value) == "it wrote JSON nested 5001 deep on stdout, at most 64"
    finally:
        server.kill()
        server.wait()


def _manifest(*, account: str = "", process: str = "", extra: str = "") -> str:
    return (
        '[module]\nname = "attack"\n'
        '[bundle.b]\nkind = "files"\nsource = "src"\n'
        f"[account.app]\n{account}"
        f'[process.p]\nbundle = "b"\naccount = "app"\ncommand = ["./app"]\n{process}'
        f"{extra}"
    )


REFUSED_AT_THE_GATE = [
    # (what the attack pushed, the field named, the value named)
    (_manifest(process='prepare = ["./app", "a\\u0000b"]\n'), "process.p.prepare", r"'a\x00b'"),
    (_manifest().replace('["./app"]', '["./app", "--x=\\u0000"]'), "process.p.command",
     r"'--x=\x00'"),
    (_manifest(process='env = { A = "x\\u0000" }\n'), "process.p.env.A", r"'x\x00'"),
    (_manifest(process='files = { "a\\u0000b" = { text = "x" } }\n'), r"process.p.files.a\x00b",
     r"'a\x00b'"),
    (_manifest(extra="[account.root]\n"), "account.root", "'root'"),
    (_manifest(account='groups = ["root"]\n'), "account.app.groups", "'root'"),
    (_manifest(account='groups = ["disk"]\n'), "account.app.groups", "'disk'"),
    (_manifest(account='groups = ["docker"]\n'), "account.app.groups", "'docker'"),
    (_manifest(account='groups = ["sudo"]\n'), "account.app.groups", "'sudo'"),
    (_manifest(account='privileged_groups = ["root"]\n'), "account.app.privileged_groups",
     "'root'"),
    (_manifest(extra="[assign]\ntiers = [-1, 99999999999999]\n"), "assign.tiers", "-1"),
    (_manifest(extra="[assign]\ntiers = [2, 99999999999999]\n"), "assign.tiers",
     "99999999999999"),
    (_manifest(extra="[rollout]\nmax_parallel = 99999999999999999999\n"),
     "rollout.max_parallel", "99999999999999999999"),
]  # fmt: skip


async def test_the_gate_refuses_what_only_a_host_refused_or_nobody(nc, start_controller) -> None:
    start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=20, what="the controller")
    wrong = []
    for manifest, field, value in REFUSED_AT_THE_GATE:
        reply = await ask(nc, "mesh.ctl.push", {"manifest": manifest, "source": NOWHERE})
        error = (reply or {}).get("error", {})
        message = error.get("message", "")
        named = message.startswith(f"module attack: {field}: ") and value in message
        if error.get("code") != "refused" or not named:
            wrong.append(f"{field} {value}: {reply}")
    assert wrong == []
    status = await ask(nc, "mesh.ctl.status")
    assert status["seat"]["holder"] == "ctl-a"


def _run_measured(argv: list[str], *, env: dict[str, str], stderr: Path) -> tuple[int, int]:
    """Run `argv`; its exit code and its peak resident memory in bytes (of it alone: wait4).
    Its address space is capped at 2 GiB, so a CLI that reads a huge file fails at once with
    a MemoryError instead of taking the machine's memory."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    with stderr.open("wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=err, env=env, preexec_fn=cap)  # fmt: skip
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        watchdog.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return proc.returncode, usage.ru_maxrss * 1024


async def test_mesh_push_of_a_10_gib_file_refuses_it_unread(
    nc, start_controller, nats_url, tmp_path
) -> None:
    start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=20, what="the controller")
    folder = tmp_path / "big"
    (folder / "src").mkdir(parents=True)
    (folder / "module.toml").write_text(
        '[module]\nname = "big"\n[bundle.big]\nkind = "files"\nsource = "src"\n'
    )
    (folder / "src" / "a.txt").write_text("small\n")
    huge = folder / "src" / "huge.bin"
    with huge.open("wb") as f:
        f.truncate(10 * 2**30)  # sparse: 10 GiB that take no disk
    env = {**os.environ, "MESH_NATS_URL": nats_url}
    code, peak = await anyio.to_thread.run_sync(
        lambda: _run_measured([*MESH, "push", str(folder)], env=env, stderr=tmp_path / "err")
    )
    text = (tmp_path / "err").read_text()
    lines = text.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Traceback" not in text, text
    assert f"src/huge.bin is {10 * 2**30} bytes" in lines[0], lines[0]
    assert f"{archive.MAX_ARCHIVE} bytes at most" in lines[0], lines[0]
    assert peak < 256 * 2**20, f"the CLI's peak memory was {peak} bytes"


async def test_tools_takes_the_limits_its_docs_say(nc, start_controller) -> None:
    docs = (ROOT / "docs" / "verbs.md").read_text()
    section = docs[docs.index("## `tools`") : docs.index("## What hosts ask")]
    said = re.search(r'"limit" \((\d+)\u2013(\d+), (\d+)\)', section)  # an en dash
    assert said, "docs/verbs.md's tools section no longer says its limit as it did"
    low, high, _ = (int(n) for n in said.groups())
    start_controller("ctl-a")
    await await_until(lambda: ask(nc, "mesh.ctl.status"), within=20, what="the controller")
    fine = await ask(nc, "mesh.ctl.tools", {"limit": high})
    assert fine is not None and "error" not in fine, fine
    for limit in (high + 1, low - 1):
        reply = await ask(nc, "mesh.ctl.tools", {"limit": limit})
        assert reply is not None and "error" in reply, f"limit {limit} was taken: {reply}"
        assert reply["error"]["code"] == "bad_request", reply
        said_back = f"limit: {limit} is out of range ({low} to {high})"
        assert said_back in reply["error"]["message"], reply
    # ... and what the docs say of every page, and their table of limits, is the same range
    assert f"items at most in the page: {low} to {high};" in docs
    assert f"`limit` {low} to {high} and" in docs


@pytest.mark.skipif(os.geteuid() != 0, reason="accounts with groups are made only as root")
async def test_a_privileged_group_is_taken_only_when_named_so_by_gate_and_host(
    host, nc, nats_url, tmp_path
) -> None:
    # The opt-in: `privileged_groups` passes the gate, and the process has the group.
    tag = uuid.uuid4().hex[:6]
    account = f"logs-{tag}"
    folder = tmp_path / "logship"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "keep").write_text("")
    (folder / "module.toml").write_text(
        '[module]\nname = "logship"\n[bundle.b]\nkind = "files"\nsource = "src"\n'
        f'[account.{account}]\nprivileged_groups = ["adm"]\n'
        f'[process.logship]\nbundle = "b"\naccount = "{account}"\n'
        'command = ["python3", "-c", "import signal; signal.pause()"]\n'
        '[assign]\nmachines = ["node-1"]\n'
    )
    ok(subprocess.run([*MESH, "push", str(folder), "--nats-url", nats_url, "--timeout", "120"],
                      capture_output=True, text=True, timeout=180))  # fmt: skip

    async def running() -> dict | None:
        status = await ask(nc, "mesh.host.node-1.status")
        found = [p for p in (status or {}).get("processes", []) if p["name"] == "logship"]
        return found[0] if found and found[0]["pid"] else None

    p = await await_until(running, within=60, what="logship running")
    status = Path(f"/proc/{p['pid']}/status").read_text()
    groups = next(line for line in status.splitlines() if line.startswith("Groups:")).split()
    assert str(grp.getgrnam("adm").gr_gid) in groups

    # A declaration that did not come through the gate (put in the bucket straight) is held to
    # the same rules by the host: a privileged group in `groups` is refused, with the reason,
    # before any account is made.
    events = await nc.subscribe("mesh.event.node-1.applied")
    await nc.flush()
    kv = await js(nc).key_value("mesh-declarations")
    current = json.loads((await kv.get("node-1")).value)
    forged = {**current, "digest": "sha256:" + "2" * 64}
    intruder = f"intr-{tag}"
    forged["declaration"] = {
        **current["declaration"],
        "accounts": {intruder: {"home": None, "groups": ["disk"], "shell": "/bin/sh"}},
    }
    await kv.put("node-1", json.dumps(forged).encode())
    event = await next_failure(events, within=30)
    assert event["step"] == f"account {intruder}", event
    assert event["error"].startswith(f"account {intruder}.groups: 'disk' is a privileged group")
    found = subprocess.run(["getent", "passwd", intruder], capture_output=True)
    assert found.returncode == 2, "the host made the account anyway"


def test_privileged_groups_pass_the_gate_into_the_declaration_and_nothing_else_changes() -> None:
    manifest = gate.parse(_manifest(account='privileged_groups = ["adm", "adm"]\n'))
    mv = compose.ModuleVersion(name="attack", version="sha256:" + "1" * 64, manifest=manifest,
                               bundles={"b": "sha256:" + "2" * 64})  # fmt: skip
    decl = compose.compose("node-1", [mv])
    assert decl.accounts["app"].privileged_groups == ["adm"]
    # An account without them has no such key: its bytes, and every digest, are as before.
    plain = gate.parse(_manifest())
    bytes_ = compose.canonical(
        compose.compose("node-1", [msgspec.structs.replace(mv, manifest=plain)])
    )
    assert b'"app":{"groups":[],"home":null,"shell":"/usr/sbin/nologin"}' in bytes_


# --- bounded growth ---
# Row 6: one host grew the store and the holder's log without bound (5,000 registrations with a
# changed body were 5,000 `machine.registered` rows and 5,000 log lines; nothing pruned events).

FLOOD = 5000
# What one machine may make the holder write or log, as docs/operations.md says (services/
# controller/fleet.py and reports.py): so many at once, then one each so many seconds.
REGISTER_BURST, REGISTER_EVERY = 3, 10.0  # registrations written
CHANGE_BURST, CHANGE_EVERY = 4, 10.0  # changes between up and down written
FAILURES_SAID, FAILURES_EVERY = 3, 10.0  # failed applies logged
HOST_FACTS = Facts(os="linux", arch="x86_64", cpus=1, memory=1 << 30, mesh_version="test")


def _log_since(path: Path, start: int) -> list[str]:
    return path.read_bytes()[start:].decode(errors="replace").splitlines()


async def _events(database_url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def _holding(nc) -> dict | None:
    s = await ask(nc, "mesh.ctl.status")
    return s if s and s.get("seat") else None


async def _registered_as(nc, req: Register) -> dict:
    msg = await nc.request(f"mesh.ctl.host.{req.name}.register", wire.encode(req), timeout=10)
    return json.loads(msg.data)


@pytest.mark.slow
async def test_a_host_registering_in_a_loop_adds_a_row_and_a_line_per_window(
    nc, procs, start_controller, start_host, database_url
) -> None:
    """node-1's own host runs; its name then registers 5,000 times, each with another pid (as a
    host restarting in a loop would, so none is the remembered registration). The store gets
    at most REGISTER_BURST (3) rows at once and one each REGISTER_EVERY (10 s) after: here at
    most 3 + 1 + one per 10 s the test took. The log says it in one line per window with the
    count; every registration is answered (from memory), `status` is answered throughout, and
    node-1 stays registered and up, its beats still taken."""
    start_controller("ctl-a")
    start_host("node-1", "--tier", "0")

    async def up():
        n = await node_named(nc, "node-1")
        return n if n and n["up"] else None

    await await_until(up, within=30, what="node-1 up")
    log_path = procs.folder / "ctl-a.log"
    log_start = log_path.stat().st_size
    count = "SELECT count(*) AS n FROM events WHERE machine = 'node-1'"
    before = (await _events(database_url, count))[0]["n"]
    base = Register(name="node-1", tier=0, labels={}, facts=HOST_FACTS, beat_interval=1.0, pid=1)

    started = time.monotonic()
    answers: dict[str, int] = {}
    statuses: list[bool] = []
    sent = iter(range(FLOOD))

    async def attacker() -> None:
        for i in sent:
            reply = await _registered_as(nc, msgspec.structs.replace(base, pid=100_000 + i))
            code = reply["error"]["code"] if "error" in reply else "ok"
            answers[code] = answers.get(code, 0) + 1
            if i % 500 == 0:
                statuses.append(await _holding(nc) is not None)

    async with anyio.create_task_group() as tg:
        for _ in range(4):  # a few in flight, as a tight loop with retries keeps them
            tg.start_soon(attacker)
    flooded = time.monotonic()
    print(f"{FLOOD} registrations in {flooded - started:.1f}s: {answers}")
    assert answers == {"ok": FLOOD}  # an honest host restarting is answered, not refused
    assert statuses and all(statuses), statuses

    rows = (await _events(database_url, count))[0]["n"] - before
    windows = int((time.monotonic() - started) // REGISTER_EVERY) + 1
    bound = REGISTER_BURST + 1 + windows
    assert rows <= bound, f"{rows} events for node-1 from {FLOOD} registrations (at most {bound})"

    said = re.compile(r".*machine node-1: (\d+) registration\(s\) in the last \S+ answered from")

    def counted() -> int:
        return sum(int(m.group(1)) for m in map(said.match, _log_since(log_path, log_start)) if m)

    async def all_counted():
        # Each one not written is said in a count, but for those that joined a write in
        # flight (a few: the attacker's requests in flight as its allowance ran out).
        return counted() >= FLOOD - bound - 20

    await await_until(all_counted, within=3 * REGISTER_EVERY,
                      what="the held-back registrations counted in the log")  # fmt: skip
    lines = [line for line in _log_since(log_path, log_start) if "regist" in line]
    windows = int((time.monotonic() - started) // REGISTER_EVERY) + 1
    # A line for each row written ("registered again"), and one count per window.
    assert len(lines) <= REGISTER_BURST + 2 * windows, "\n".join(lines)

    async def beating_after_the_flood():
        n = await node_named(nc, "node-1")
        seen = n and n["up"] and n["last_seen"]
        return n if seen and _at(seen) > time.time() - (time.monotonic() - flooded) else None

    node = await await_until(beating_after_the_flood, within=20, what="node-1's beats taken")
    assert node["tier"] == 0
    status = await ask(nc, "mesh.ctl.status")
    assert status["nodes"] == {"total": 1, "up": 1, "down": 0}
    host_log = (procs.folder / "node-1.log").read_text()
    assert "registration refused" not in host_log


def _at(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


@pytest.mark.slow
async def test_a_machine_flapping_on_purpose_is_written_a_bounded_number_of_times(
    nc, start_controller, database_url
) -> None:
    """A machine that beats with a tiny interval, then falls silent, then beats again, as fast
    as the holder judges it (it judges up to its last NATS round trip, one a second): up and
    down at most CHANGE_BURST (4) times at once, then once each CHANGE_EVERY (10 s); once it
    beats steadily it is up again, in memory and the store."""
    start_controller("ctl-a")
    await await_until(lambda: _holding(nc), within=30, what="ctl-a to hold the seat")
    reply = await _registered_as(nc, Register(name="node-9", tier=None, labels={}, facts=HOST_FACTS,
                                         beat_interval=0.01, pid=9))  # fmt: skip
    assert reply.get("name") == "node-9", reply
    changes = (
        "SELECT count(*) AS n FROM events WHERE machine = 'node-9' "
        "AND kind IN ('machine.up', 'machine.down')"
    )
    started = time.monotonic()
    seq = 0

    async def beat(interval: float) -> None:
        nonlocal seq
        seq += 1
        await nc.publish("mesh.host.node-9.beat",
                         wire.encode(Beat(name="node-9", seq=seq, interval=interval)))  # fmt: skip
        await nc.flush()

    while time.monotonic() - started < 15:
        await beat(0.01)
        await anyio.sleep(1.2)  # ok: the attack's own rhythm, silent past a round trip
    flapped = (await _events(database_url, changes))[0]["n"]
    windows = int((time.monotonic() - started) // CHANGE_EVERY) + 1
    bound = CHANGE_BURST + windows
    assert flapped <= bound, f"{flapped} up/down events in 15 s (at most {bound})"

    async def steadily_up():
        await beat(1.0)
        n = await node_named(nc, "node-9")
        return n if n and n["up"] else None

    await await_until(steadily_up, within=3 * CHANGE_EVERY, what="node-9 up again")
    rows = await _events(database_url, "SELECT up FROM machines WHERE name = 'node-9'")
    assert rows[0]["up"] is True


@pytest.mark.slow
async def test_failed_apply_reports_in_a_flood_are_logged_a_few_times_with_a_count(
    nc, procs, start_controller
) -> None:
    """5,000 failed `applied` reports from one machine: the holder keeps the last (`nodes`
    shows it) and logs FAILURES_SAID (3) at once, then one each FAILURES_EVERY with a count."""
    start_controller("ctl-a")
    await await_until(lambda: _holding(nc), within=30, what="ctl-a to hold the seat")
    await _registered_as(nc, Register(name="node-8", tier=None, labels={}, facts=HOST_FACTS,
                                 beat_interval=3600, pid=8))  # fmt: skip
    log_path = procs.folder / "ctl-a.log"
    log_start = log_path.stat().st_size
    started = time.monotonic()
    for i in range(FLOOD):
        failure = Applied(name="node-8", digest="sha256:" + "0" * 64, epoch=1, ok=False,
                          step="prepare", error=f"boom {i}")  # fmt: skip
        await nc.publish("mesh.event.node-8.applied", wire.encode(failure))
    await nc.flush()

    async def last_heard():
        n = await node_named(nc, "node-8")
        return n if n and n.get("apply_error") == f"prepare: boom {FLOOD - 1}" else None

    await await_until(last_heard, within=30, what="the last report heard")
    lines = [line for line in _log_since(log_path, log_start) if "could not apply" in line]
    windows = int((time.monotonic() - started) // FAILURES_EVERY) + 1
    assert 1 <= len(lines) <= FAILURES_SAID + windows, "\n".join(lines)


@pytest.mark.slow
async def test_the_holder_prunes_events_by_age_and_by_count(
    nc, procs, nats_url, database_url
) -> None:
    """With MESH_EVENTS_MAX_AGE=1h, MESH_EVENTS_MAX_COUNT=50 and a prune each 0.5 s: rows put
    in the store two hours in the past are gone after the holder's next prune, as is all but
    the newest 50; the newest rows stay."""
    procs.start(
        "ctl-a",
        [*MESH, "controller", "run", "--instance", "ctl-a"],
        env={"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": database_url,
             "MESH_EVENTS_MAX_AGE": "1h", "MESH_EVENTS_MAX_COUNT": "50",
             "MESH_EVENTS_PRUNE_EVERY": "0.5s"},
    )  # fmt: skip
    await await_until(lambda: _holding(nc), within=30, what="ctl-a to hold the seat")
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO events (at, kind, machine) SELECT now() - interval '2 hours', "
            "'test.old', 'old-' || n FROM generate_series(1, 20) AS n"
        )
        await conn.execute(
            "INSERT INTO events (kind, machine) SELECT 'test.new', 'new-' || n "
            "FROM generate_series(1, 120) AS n"
        )
        newest = await conn.fetchval("SELECT max(id) FROM events")

        async def pruned():
            old = await conn.fetchval("SELECT count(*) FROM events WHERE kind = 'test.old'")
            total = await conn.fetchval("SELECT count(*) FROM events")
            return (old, total) if old == 0 and total <= 50 else None

        await await_until(pruned, within=30, what="old events and all but the newest 50 gone")
        kept = await conn.fetch("SELECT id FROM events ORDER BY id")
        assert kept[-1]["id"] == newest  # the newest stay
        assert len(kept) >= 40  # only the oldest went (ids of one insert have no gaps)
    finally:
        await conn.close()
    log = (procs.folder / "ctl-a.log").read_text()
    assert re.search(r"pruned \d+ event\(s\): 20 older than 1h, \d+ beyond the newest 50", log)


def test_a_bad_pruning_setting_is_one_line_naming_it() -> None:
    """Refused before anything is reached (the store's URL goes nowhere)."""
    cases = [
        (["--events-max-age", "3x"], {}, "--events-max-age: '3x' is not a duration"),
        (["--events-max-count", "-5"], {}, "--events-max-count: '-5' is not a number of events"),
        (["--events-prune-every", "0"], {}, "--events-prune-every: '0' is shorter than 0.1s"),
        ([], {"MESH_EVENTS_MAX_AGE": "forever"}, "MESH_EVENTS_MAX_AGE: 'forever' is not a"),
    ]
    for flags, env, says in cases:
        done = subprocess.run(
            [*MESH, "controller", "run", *flags, "--database-url", "postgresql://127.0.0.1:9/x"],
            capture_output=True, text=True, timeout=60, env={**os.environ, **env},
        )  # fmt: skip
        assert says in one_line_error(done)


# --- the store ----------------------------------------------------------------------------------
# Row 5: the embedded PostgreSQL trusted loopback, so any account on the control machine (every
# module's account is one) connected as the superuser, read every secret and ran programs as
# `mesh-postgres` (`COPY … TO PROGRAM`).

READ_SECRETS = "select name, convert_from(value, 'UTF8') from secrets"  # what the attack read


def _port(url: str) -> int:
    return int(url.rsplit("@", 1)[1].split("/")[0].rsplit(":", 1)[1])


async def _refused(url: str) -> str:
    """The server's refusal of a connection to `url` (the test fails if it lets it in)."""
    try:
        conn = await asyncpg.connect(url, timeout=10)
    except asyncpg.InvalidAuthorizationSpecificationError as e:  # 28000, 28P01
        return str(e)
    await conn.close()
    pytest.fail(f"PostgreSQL let {db._where(url)} in")


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True,
                          text=True, timeout=60, cwd="/")  # fmt: skip


@pytest.mark.slow
async def test_the_store_refuses_local_accounts_and_its_role_is_no_superuser(
    open_dir: Path,
) -> None:
    store_dir = open_dir / "dev"
    dev = DevUp(store_dir, hosts=0)
    try:
        url = dev.ready()
        done = mesh_cli("secret", "set", "hello-token", "--from-file", "/etc/hostname",
                        nats_url=url, creds=str(store_dir / "creds" / "admin.creds"))  # fmt: skip
        assert done.returncode == 0, done.stderr
        controllers = env_file(store_dir)["MESH_DATABASE_URL"]
        port = _port(controllers)

        # What the attack did: the superuser, and the controllers' role, without a password
        # or with a wrong one.
        for user in ("postgres", "mesh"):
            said = await _refused(f"postgresql://{user}@127.0.0.1:{port}/mesh")
            assert "password authentication failed" in said, said
            await _refused(f"postgresql://{user}:not-the-password@127.0.0.1:{port}/mesh")

        # The controllers' role, with its real password (the credential file, as DIR/env and
        # the controllers have it): it owns the mesh's tables and nothing more.
        password = (store_dir / "creds" / "store" / "mesh.password").read_text().strip()
        ca = store_dir.resolve() / "tls" / "ca.pem"
        assert controllers == (
            f"postgresql://mesh:{password}@127.0.0.1:{port}/mesh?sslmode=verify-full&sslrootcert={ca}"
        )
        marker = store_dir.parent / "copy-to-program-ran"
        conn = await asyncpg.connect(controllers)
        try:
            assert await conn.fetchval("select count(*) from secrets") == 1
            assert await conn.fetchval(
                "select rolsuper or rolcreaterole or rolcreatedb or rolreplication "
                "from pg_roles where rolname = current_user"
            ) is False  # fmt: skip
            for sql in (
                f"COPY (select 1) TO PROGRAM 'touch {marker}'",
                "select * from pg_authid",
                "CREATE ROLE intruder SUPERUSER LOGIN PASSWORD 'x'",
                "ALTER ROLE mesh SUPERUSER",
                "select pg_read_file('postgresql.conf')",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await conn.execute(sql)
        finally:
            await conn.close()
        assert not marker.exists()

        # The files that hold the passwords are their owner's alone.
        for path in (store_dir / "env", *(store_dir / "creds" / "store").iterdir()):
            assert os.stat(path).st_mode & 0o777 == 0o600, path
        assert os.stat(store_dir / "creds" / "store").st_mode & 0o777 == 0o700

        if os.geteuid() == 0:
            # As the issue showed it: another account of the machine, with psql: the wheel's
            # (no SSL) is refused by the store's TLS front before any password; one with SSL
            # (Debian's, where installed) gets through TLS and is asked for a password.
            psqls = {postgres.bin("psql"): "TLS connections only"}
            if Path("/usr/bin/psql").exists():
                psqls["/usr/bin/psql"] = "no password supplied"
            for psql, why in psqls.items():
                for user in ("postgres", "mesh"):
                    read = _as_nobody(psql, "-w", f"postgresql://{user}@127.0.0.1:{port}/mesh",
                                      "-Atc", READ_SECRETS)  # fmt: skip
                    assert read.returncode != 0 and "hello-token" not in read.stdout, read
                    assert why in read.stderr, (psql, read.stderr)
            for path in (store_dir / "env", store_dir / "creds" / "store" / "postgres.password"):
                peek = _as_nobody("cat", str(path))
                assert peek.returncode != 0 and "Permission denied" in peek.stderr, peek

        dev.stop()
    finally:
        dev.kill()


@pytest.mark.slow
async def test_a_store_an_older_mesh_made_with_trust_is_converted_not_broken(
    open_dir: Path,
) -> None:
    """What an older mesh left in DIR/pg: a cluster that trusts loopback, the schema made by
    the superuser, a secret in it. `mesh dev up` on that folder says it converts it, and then
    the superuser is refused without a password while the controllers (a role of their own
    now) hold the seat and read what was there."""
    store_dir = open_dir / "dev"
    data = store_dir / "pg"
    postgres.init_folder(data)
    made = subprocess.run(
        [postgres.bin("initdb"), "-D", str(data), "--auth=trust", "--username=postgres",
         "--encoding=UTF8", "--no-instructions"],
        capture_output=True, text=True, cwd=data, **postgres.run_as(),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    port = ports.free_port()
    server = subprocess.Popen(
        postgres.argv(data, port=port), cwd=data, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True, **postgres.run_as(),
    )  # fmt: skip
    trusted = f"postgresql://postgres@127.0.0.1:{port}"
    try:

        async def answers() -> bool:
            assert server.poll() is None, "the old cluster's server exited"
            try:
                conn = await asyncpg.connect(f"{trusted}/postgres", timeout=2)
            except (OSError, asyncpg.PostgresError, TimeoutError):
                return False
            await conn.close()
            return True

        await await_until(answers, within=30, what="the old cluster to answer")
        conn = await asyncpg.connect(f"{trusted}/postgres")
        await conn.execute('CREATE DATABASE "mesh"')
        await conn.close()
        conn = await asyncpg.connect(f"{trusted}/mesh")  # no password: what trust allowed
        try:
            await migrate(conn)
            await conn.execute(
                "INSERT INTO secrets (name, value, version) VALUES ('hello-token', 's3cret', 1)"
            )
        finally:
            await conn.close()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)

    dev = DevUp(store_dir, hosts=0)
    try:
        url = dev.ready()
        said = [line for line in dev.seen if "converted to passwords only" in line]
        assert len(said) == 1 and str(data) in said[0], dev.seen
        port = _port(env_file(store_dir)["MESH_DATABASE_URL"])
        await _refused(f"postgresql://postgres@127.0.0.1:{port}/mesh")
        status = mesh_cli("status", nats_url=url, creds=str(store_dir / "creds" / "admin.creds"))
        assert status.returncode == 0 and "held by ctl-" in status.stdout, status
        conn = await asyncpg.connect(env_file(store_dir)["MESH_DATABASE_URL"])
        try:
            # The data carried on, the plaintext secret sealed by the holder's takeover: its
            # row no longer holds the value, which the mesh's key file opens.
            row = await conn.fetchrow("SELECT value, key_id FROM secrets")
            assert b"s3cret" not in bytes(row["value"]) and row["key_id"].startswith("k-")
            ring = secretkeys.read(store_dir / "keys" / "secrets.key")
            assert await secrets.secret(conn, "hello-token", ring=ring) == (1, b"s3cret")
            owners = await conn.fetch(
                "select distinct tableowner from pg_tables where schemaname = 'public'"
            )
            assert [r[0] for r in owners] == ["mesh"]
        finally:
            await conn.close()
        dev.stop()
    finally:
        dev.kill()


# --- a scoped operator (issue 39): a deployer scoped to web-* was an admin in all but name -----
# bob, `--role deployer --modules 'web-*'`, pushed modules of his own that ran as root, joined
# shadow and disk, ran as another module's account, named the controller's secrets and other
# modules' as files, and purged the bundle store with his own credentials. Each is refused now,
# naming the field; an admin (or an admin's grant) still may.

_SLEEP = 'command = ["sleep", "3600"]\nbundle = "sys"\n'
_SYS = '[bundle.sys]\nkind = "system"\npath = "/usr/bin"\n'


def _scoped(secured: Secured, name: str, *extra: str) -> str:
    """An operator `name`, deployer of `web-*` (and what `extra` grants): its credentials."""
    added = ok_json(secured.cli(None, "operator", "add", name, "--role", "deployer",
                                "--modules", "web-*", *extra, "--dir", str(secured.dir.root),
                                "--json"))  # fmt: skip
    return added["creds"]


def _mod(tmp_path: Path, name: str, tables: str) -> Path:
    folder = tmp_path / "modules" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "module.toml").write_text(f'[module]\nname = "{name}"\n{_SYS}{tables}')
    return folder


def _forbidden(secured: Secured, creds: str, folder: Path, *fields: str) -> str:
    line = one_line_error(secured.cli(creds, "push", str(folder), "--timeout", "60"))
    assert line.startswith("forbidden:") or "forbidden: " in line, line
    for field in fields:
        assert field in line, (field, line)
    return line


async def test_a_deployer_gets_no_root_no_privileged_group_and_no_other_modules_account(
    secured_fleet, secured: Secured, tmp_path: Path
):
    # The account another module declared first: the `files` tool server's, in the attack.
    ok(secured.cli(secured.admin, "push", str(_mod(tmp_path, "shop", "[account.shop]\n")),
                   "--timeout", "60"))  # fmt: skip
    bob = _scoped(secured, "bob")

    root = _mod(tmp_path, "web-root", f"[process.web-root]\n{_SLEEP}root = true\n")
    _forbidden(secured, bob, root, "module web-root", "process.web-root.root")
    groups = _mod(tmp_path, "web-groups",
                  '[account.web-groups]\nprivileged_groups = ["shadow", "disk"]\n'
                  f'[process.web-groups]\n{_SLEEP}account = "web-groups"\n')  # fmt: skip
    _forbidden(secured, bob, groups, "account.web-groups.privileged_groups", "'disk'")
    taken = _mod(tmp_path, "web-acct", f'[account.shop]\n[process.web-acct]\n{_SLEEP}'
                 'account = "shop"\n')  # fmt: skip
    _forbidden(secured, bob, taken, "account.shop", "module shop's")
    joined = _mod(tmp_path, "web-join", '[account.web-join]\ngroups = ["shop"]\n'
                  f'[process.web-join]\n{_SLEEP}account = "web-join"\n')  # fmt: skip
    _forbidden(secured, bob, joined, "account.web-join.groups", "'shop'")
    tool = _mod(tmp_path, "web-tool", f"[tool.t]\n{_SLEEP}root = true\n")
    _forbidden(secured, bob, tool, "tool.t.root")

    listed = {m["name"] for m in ok_json(secured.cli(secured.viewer, "--json", "modules"))[
        "modules"]}  # fmt: skip
    assert not listed & {"web-root", "web-groups", "web-acct", "web-join", "web-tool"}, listed
    refusals = [e for e in ok_json(secured.cli(secured.viewer, "audit", "--json", "--who", "bob"))[
        "entries"] if e["outcome"] == "forbidden"]  # fmt: skip
    assert {e["subject"] for e in refusals} >= {"web-root", "web-groups", "web-acct"}, refusals

    # An admin grants what a scoped operator may ask for, by name; an admin pushes it anyway.
    carl = _scoped(secured, "carl", "--allow", "root", "--allow", "groups:disk,shadow",
                   "--allow", "accounts:shop")  # fmt: skip
    listed_ops = ok_json(secured.cli(secured.viewer, "--json", "operator", "list"))["operators"]
    assert next(o for o in listed_ops if o["name"] == "carl")["allow"] == [
        "accounts:shop", "groups:disk,shadow", "root"]  # fmt: skip
    for folder in (root, groups, taken):
        ok(secured.cli(carl, "push", str(folder), "--timeout", "60"))
    ok(secured.cli(secured.admin, "push", str(joined), "--timeout", "60"))
    # A grant is a deployer's: another role is refused it, in one line.
    vera = ["operator", "add", "vera", "--role", "viewer", "--allow", "root"]
    line = one_line_error(secured.cli(None, *vera, "--dir", str(secured.dir.root)))
    assert line.endswith("--allow: 'root' is for a deployer, not a viewer"), line


async def test_a_deployer_cannot_purge_write_or_consume_the_mesh_s_streams(
    secured_fleet, secured: Secured, as_identity, tmp_path: Path
):
    """Row 4 of the attack: bob purged the bundle store (`{"success":true,"purged":10}`), wrote
    into it and made consumers with any deliver subject. Now the server refuses each; his push
    goes through the uploads' bucket, which the controller adopts and empties."""
    admin = secured_fleet
    obs = await blobs.store(admin)
    kept = await blobs.put(obs, b"a bundle that must stay")
    before = await admin.jsm().stream_info("OBJ_mesh-bundles")
    bob_creds = _scoped(secured, "bob")
    bob = await as_identity(bob_creds)
    for subject in (
        "$JS.API.STREAM.PURGE.OBJ_mesh-bundles", "$JS.API.STREAM.DELETE.OBJ_mesh-bundles",
        "$O.mesh-bundles.M.x", "$O.mesh-bundles.C.x",
        "$JS.API.CONSUMER.CREATE.OBJ_mesh-bundles", "$JS.API.CONSUMER.CREATE.OBJ_mesh-bundles.x",
        "$JS.API.DIRECT.GET.OBJ_mesh-bundles.$O.mesh-bundles.M.x",
        "$JS.API.CONSUMER.CREATE.KV_mesh-declarations", "$JS.API.STREAM.PURGE.KV_mesh-declarations",
        "$KV.mesh-declarations.node-1", "$JS.API.STREAM.PURGE.OBJ_mesh-uploads",
        "$JS.API.STREAM.DELETE.OBJ_mesh-uploads", "$JS.API.CONSUMER.CREATE.OBJ_mesh-uploads",
        "$JS.API.STREAM.PURGE.OBJ_mesh-builds", "$JS.API.STREAM.UPDATE.OBJ_mesh-bundles",
    ):  # fmt: skip
        assert await bob.publish_refused(subject), subject
    made = await _consumer(
        bob.nc,
        "OBJ_mesh-bundles",
        name="x",
        deliver_subject="mesh.op.admin.push",
        ack_policy=AckPolicy.NONE,
    )
    assert made == "refused"
    after = await admin.jsm().stream_info("OBJ_mesh-bundles")
    assert after.state.messages == before.state.messages
    assert await blobs.get(admin, kept) == b"a bundle that must stay"

    # What he may do with JetStream is what his push needs: it works, and leaves nothing staged.
    web = _mod(tmp_path, "web-a", "[account.web-a]\n")
    pushed = ok_json(secured.cli(bob_creds, "--json", "push", str(web), "--timeout", "60"))
    assert pushed["version"].startswith("sha256:"), pushed
    assert await blobs.get(admin, pushed["version"])  # adopted into the bundle store

    async def emptied() -> bool:
        staged = await admin.jsm().stream_info("OBJ_mesh-uploads", subjects_filter=">")
        return not any(s.startswith("$O.mesh-uploads.C.") for s in staged.state.subjects or {})

    await await_until(emptied, within=30, what="the upload adopted and its chunks purged")


async def test_a_deployer_names_only_secrets_its_modules_may_use_and_the_holder_checks_again(
    secured_fleet, secured: Secured, as_identity, tmp_path: Path
):
    """Row 1 of the attack: bob's `web-steal` named `mesh-secrets-key`, `hello-token` and
    `mesh-database-url` as files and read them in `mesh logs`. Now the push is refused; a
    secret an admin set for `web-*` is his modules' to use; the holder checks again when a host
    asks for one, so a secret taken from his modules stops being served at once."""
    admin = secured_fleet
    ok(secured.cli(secured.admin, "secret", "set", "hello-token", stdin=SECRET))
    bob = _scoped(secured, "bob")
    for secret in ("mesh-secrets-key", "hello-token", "mesh-database-url", "mesh-controller-creds"):
        files = f'files = {{ "f" = {{ secret = "{secret}" }} }}\n'
        steal = _mod(tmp_path, "web-steal", f'[account.web-steal]\n[process.steal]\n{_SLEEP}'
                     f'account = "web-steal"\n{files}')  # fmt: skip
        _forbidden(secured, bob, steal, "process.steal.files.f.secret", secret)
    # Not even an admin names the controller's own secrets in another module.
    line = one_line_error(secured.cli(secured.admin, "push", str(steal), "--timeout", "60"))
    assert "forbidden" in line and "the controller's own secret" in line, line

    ok(secured.cli(secured.admin, "secret", "set", "web-token", "--modules", "web-*",
                   stdin="web-value-1"))  # fmt: skip
    web = _mod(tmp_path, "web-ok", f'[account.web-ok]\n[process.web-ok]\n{_SLEEP}'
               'account = "web-ok"\nfiles = { "token" = { secret = "web-token" } }\n')  # fmt: skip
    ok(secured.cli(bob, "push", str(web), "--timeout", "60"))
    ok(secured.cli(bob, "assign", "web-ok", "node-2", "--wait", "--timeout", "120"))

    host = await as_identity(secured.creds("host", "node-2"))

    async def served(name: str) -> dict:
        answer = await ask(host.nc, "mesh.ctl.host.node-2.secret", {"name": name}, timeout=10)
        assert answer is not None, name
        return answer

    assert base64.b64decode((await served("web-token"))["value"]) == b"web-value-1"
    for name in ("mesh-secrets-key", "hello-token", "mesh-database-url"):
        assert (await served(name))["error"]["code"] == "forbidden", name
    # The admin gives the secret to other modules: bob's module, already on node-2, is served
    # it no more (the gate let it through when it was pushed; the holder asks again).
    ok(secured.cli(secured.admin, "secret", "set", "web-token", "--modules", "other-*",
                   stdin="web-value-2"))  # fmt: skip
    refused = (await served("web-token"))["error"]
    assert refused["code"] == "forbidden" and "module web-ok" in refused["message"], refused

    # Removing bob says what he brought in; --revert takes his module off its machines.
    removed = ok_json(secured.cli(None, "operator", "remove", "bob", "--revert", "--json",
                                  "--dir", str(secured.dir.root)))  # fmt: skip
    brought = removed["brought"]
    assert brought["modules"] == ["web-ok"] and brought["machines"] == ["node-2"], removed
    assert brought["processes"] == ["web-ok.web-ok"], removed
    assert len(removed["reverted"]) == 1, removed
    unassigned = str(removed["reverted"][0])

    async def ended() -> dict | None:
        plan = ok_json(secured.cli(secured.viewer, "--json", "plan", unassigned))
        return plan if plan["state"] not in ("pending", "rolling") else None

    done = await await_until(ended, within=120, what=f"plan {unassigned} to end")
    assert done["state"] == "done", done

    async def gone() -> bool:
        node = await node_named(admin, "node-2")
        return node is not None and not any(p["name"] == "web-ok" for p in node["processes"])

    await await_until(gone, within=60, what="web-ok off node-2")
    entries = ok_json(secured.cli(secured.viewer, "audit", "--json"))["entries"]
    said = {(e["who"], e["verb"], e["subject"], e["outcome"]) for e in entries}
    assert {
        ("admin", "operator-remove", "bob", "ok"),
        ("admin", "unassign", "web-ok", "ok"),
    } <= said


# --- the console and `mesh mcp`'s names (issue 39, items 6 and 7) -------------------------------
# Attacks from this machine on `mesh console` and `mesh mcp` (issue 39).
#
# The console: `runuser -u nobody -- curl http://127.0.0.1:PORT/api/logs/node-3/steal` read a
# process's log (root's, 0600 on disk) through `mesh dev up`'s console, which answered anyone who
# knew its port. Now it asks who you are: a request without its token (or the cookie the token
# sets), or with a wrong one, gets 401, the page, the API and the events alike, from this account
# or another; its unix socket (`--socket`) is 0600; `mesh dev up` gives the token to its console
# where no other account reads it (never its command line or log) and prints it with the URL.
#
# `mesh mcp` took a tool's name apart and put its machine in a subject: `*.files.read` called
# `mesh.host.*.tool`. A machine, server or tool that is not a name is an MCP tool error naming
# the field and the value, before anything is sent on the bus, and the server goes on serving.

AS_ROOT = os.geteuid() == 0
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
@pytest.mark.skipif(not AS_ROOT, reason=NOT_ROOT)
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
@pytest.mark.skipif(not AS_ROOT, reason=NOT_ROOT)
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
                listed = (await session.list_tools()).tools  # the fleet's verbs alone
                assert [t.name for t in listed if "." in t.name] == [], listed

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


# --- a host flooding its own subjects (issue 39, item 5) -----------------------------------------
# A host flooding its own subjects must not stall the seat's holder (issue 39, item 5).
#
# The attack on `mesh dev up`: node-3, with its own real credentials, published registrations
# (each with another pid), beats and reports as fast as it could. The holder's log grew by 137 MB
# in 70 s (a line per permissions violation of a reply sent minutes late, a line per message
# nats-py dropped), `status` asked by an operator went from 1 ms to seconds, then to nothing, and
# nats-server dropped the holder as a slow consumer 13 times.
#
# Here node-2's real credentials flood each kind for FLOOD_FOR seconds from a process of its own
# (tests/flooding.py) while the admin asks `status` every STATUS_EVERY: every one is answered within
# ANSWER_WITHIN, the holder's log grows by at most LOG_GROWTH, and `mesh nodes --json` names node-2
# noisy. docs/security.md's threat table has the row; docs/architecture.md says how (the hosts'
# own connection, pending limits, budgets per host before decoding).

FLOODER = Path(__file__).parent / "flooding.py"
FLOOD_FOR = 20.0  # seconds of flood, each kind
STATUS_EVERY = 0.1  # seconds between the admin's `status` requests
ANSWER_WITHIN = 3.0  # each `status` is sent once, with this timeout
LOG_GROWTH = 256 * 1024  # bytes the holder's log may grow by, flood and its aftermath
AFTER = 5.0  # seconds after the flood in which `status` must still be answered (a backlog)


class Asked:
    """`status` every STATUS_EVERY, each sent once with ANSWER_WITHIN: what was not answered,
    and how long the answered ones took."""

    def __init__(self) -> None:
        self.sent = 0
        self.unanswered: list[str] = []
        self.took: list[float] = []

    async def run(self, nc: Client, stop: anyio.Event) -> None:
        async def one() -> None:
            sent = time.monotonic()
            try:
                msg = await nc.request("mesh.ctl.status", b"{}", timeout=ANSWER_WITHIN)
            except (NoRespondersError, NatsTimeout) as e:
                self.unanswered.append(f"{type(e).__name__} at +{sent - started:.1f}s")
                return
            reply = json.loads(msg.data)
            if "error" in reply or not reply.get("seat"):
                self.unanswered.append(f"{reply.get('error')} at +{sent - started:.1f}s")
                return
            self.took.append(time.monotonic() - sent)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                self.sent += 1
                tg.start_soon(one)
                await anyio.sleep(STATUS_EVERY)  # ok: the client's sending rate

    def percentile(self, p: float) -> float:
        took = sorted(self.took)
        return took[min(len(took) - 1, int(p * len(took)))] * 1000 if took else float("nan")


async def _flood(secured: Secured, kind: str) -> dict:
    """node-2's credentials, flooding `kind` for FLOOD_FOR seconds from a process of its own."""
    argv = [sys.executable, str(FLOODER), "--url", secured.url, "--name", "node-2",
            "--creds", secured.creds("host", "node-2"), "--kind", kind,
            "--seconds", str(FLOOD_FOR)]  # fmt: skip
    done = await anyio.run_process(argv, check=False)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout.decode().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.parametrize("kind", ["registrations", "beats", "events"])
async def test_a_host_flooding_its_subjects_stalls_no_verb_and_is_named_noisy(
    kind: str, secured_fleet: Client, secured: Secured, procs
) -> None:
    """node-2's credentials flood `kind` for 20 s (node-2's own host runs on): the admin's
    `status`, every 100 ms, is answered every time within 3 s, through the flood and 5 s after
    it; the holder's log grows by at most 256 KiB and names node-2 noisy, never node-1 down;
    `mesh nodes --json` shows node-2 noisy (and node-1 not); node-2 is up once it is over."""
    admin = secured_fleet
    log_path: Path = procs.folder / "ctl-a.log"
    log_start = log_path.stat().st_size
    asked = Asked()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(asked.run, admin, stop)
        flooded = await _flood(secured, kind)
        await anyio.sleep(AFTER)  # ok: `status` asked on through the aftermath, not a wait
        stop.set()
    grown = log_path.stat().st_size - log_start
    print(f"{kind}: {flooded['sent']} sent in {FLOOD_FOR:g}s; status {asked.sent} asked, "
          f"{len(asked.unanswered)} unanswered, p50 {asked.percentile(0.5):.1f} ms, "
          f"p95 {asked.percentile(0.95):.1f} ms, max {asked.percentile(1.0):.1f} ms; "
          f"log +{grown} bytes")  # fmt: skip
    assert not asked.unanswered, f"{len(asked.unanswered)} of {asked.sent}: {asked.unanswered[:10]}"
    assert grown <= LOG_GROWTH, f"the holder's log grew by {grown} bytes"

    nodes = {n["name"]: n for n in ok_json(secured.cli(secured.admin, "nodes", "--json"))["nodes"]}
    assert nodes["node-2"]["noisy"] is True, nodes["node-2"]
    assert nodes["node-1"]["noisy"] is False, nodes["node-1"]
    said = log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "machine node-2 is noisy" in said, said[-2000:]
    # Another host's beats still reached the holder: a flood must not make its neighbours down.
    assert "machine node-1 is down" not in said, said[-2000:]

    async def beating_again() -> dict | None:
        reply = await admin.request("mesh.ctl.nodes", b"{}", timeout=ANSWER_WITHIN)
        node = next(n for n in json.loads(reply.data)["nodes"] if n["name"] == "node-2")
        return node if node["up"] else None

    await await_until(beating_again, within=30, what="node-2 up after the flood")


# --- the pieces: budgets on a clock the test moves, and a check as nats-py parses --------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_beats_past_a_machines_budget_are_dropped_and_it_is_noisy_for_a_minute(caplog) -> None:
    clock = Clock()
    budgets = Budgets(clock=clock)
    beats = budgets.admits("beats")
    taken = [beats("mesh.host.node-2.beat", b"{}") for _ in range(1000)]
    assert taken.count(True) == noisy.BEAT_BURST
    assert beats("mesh.host.node-1.beat", b"{}")  # each machine its own
    assert beats("mesh.nothing", b"{}")  # a stray is the subscription's to refuse (origin.py)
    clock.now += noisy.BEAT_EVERY * 1.01  # (floats: a hair past the interval)
    assert beats("mesh.host.node-2.beat", b"{}")  # 25 a second again
    assert budgets.noisy("node-2") and not budgets.noisy("node-1")
    with caplog.at_level(logging.WARNING, logger="mesh.controller"):
        budgets.say()  # not a whole window yet
        clock.now += noisy.SAY_EVERY
        budgets.say()
        budgets.say()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "machine node-2 is noisy: dropped 950 beats" in lines[0], lines
    clock.now += noisy.NOISY_FOR
    assert not budgets.noisy("node-2")


def test_requests_are_bounded_in_flight_not_by_rate() -> None:
    clock = Clock()
    budgets = Budgets(clock=clock)
    asks = budgets.admits("requests")
    subject = "mesh.ctl.host.node-2.register"
    # A caller that waits for its answers is never held back, however many it asks...
    for _ in range(10 * noisy.REQUESTS_IN_FLIGHT):
        assert asks(subject, b"{}")
        budgets.answered("node-2")
    # ...one that does not has REQUESTS_IN_FLIGHT, and one more as each is answered.
    assert [asks(subject, b"{}") for _ in range(100)].count(True) == noisy.REQUESTS_IN_FLIGHT
    budgets.answered("node-2")
    assert asks(subject, b"{}") and not asks(subject, b"{}")
    clock.now += noisy.ASKING_BACK  # one never answered (a stray, dropped) stops counting
    assert asks(subject, b"{}") and not asks(subject, b"{}")


def test_reports_past_the_budget_keep_the_newest_of_each_kind_in_order() -> None:
    clock = Clock()
    budgets = Budgets(clock=clock)
    reports = budgets.admits("reports")
    taken = [reports(f"mesh.event.node-2.{k}", b"old") for k in ["applied"] * noisy.REPORT_BURST]
    assert all(taken)
    assert not reports("mesh.event.node-2.applied", b"a1")
    assert not reports("mesh.event.node-2.processes", b"p1")
    assert not reports("mesh.event.node-2.applied", b"a2")  # newer: it goes after p1
    assert not reports("mesh.event.node-2.whatever", b"?")  # not a report's kind: not kept
    assert budgets.due() == []  # no turn yet
    clock.now += noisy.REPORT_EVERY * 1.01  # (floats: a hair past the interval)
    # One turn: the oldest kept first; while some are kept, what comes joins them.
    assert budgets.due() == [("mesh.event.node-2.processes", b"p1")]
    assert not reports("mesh.event.node-2.processes", b"p2")
    clock.now += 2.01 * noisy.REPORT_EVERY
    assert budgets.due() == [
        ("mesh.event.node-2.applied", b"a2"), ("mesh.event.node-2.processes", b"p2"),
    ]  # fmt: skip
    clock.now += 1.01 * noisy.REPORT_EVERY
    assert reports("mesh.event.node-2.applied", b"a3")  # none kept: taken at once again


async def test_admit_drops_what_it_refuses_as_nats_py_parses_it(nats_url: str) -> None:
    """mesh.bus.admit on a real connection: what the check refuses never reaches the
    subscription (nor its queue), yet counts as received; a check that raises lets it in."""
    nc = await bus.connect(nats_url, name="admitting", reconnect=False)
    other = await nats.connect(nats_url)
    got: list[bytes] = []

    async def cb(msg: Msg) -> None:
        got.append(msg.data)

    def admits(subject: str, body: bytes) -> bool:
        if body == b"raise":
            raise ValueError(body)
        return subject == "t.in"

    try:
        sub = await nc.subscribe("t.*", cb=cb)
        bus.admit(sub, admits)
        await nc.flush()
        for subject, body in [("t.out", b"1"), ("t.in", b"2"), ("t.out", b"3"),
                              ("t.x", b"raise"), ("t.in", b"4")]:  # fmt: skip
            await other.publish(subject, body)
        await other.flush()

        async def all_in() -> bool:
            return nc.stats["in_msgs"] >= 5 and len(got) >= 3

        await await_until(all_in, within=30, what="the messages received")  # a loaded machine
        assert got == [b"2", b"raise", b"4"]
        assert nc.stats["in_msgs"] == 5
        assert sub.pending_msgs == 0 and sub.delivered == 3
    finally:
        await other.close()
        await nc.close()
