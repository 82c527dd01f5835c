"""Attacks on a running mesh, each made as the attack on `mesh dev up` made it: with that piece's
own credentials, its raw subjects and the JetStream API, against a real nats-server, real
controllers, hosts and PostgreSQL. Each shows the hole closed: the server refuses the action, or
the piece it was aimed at refuses what arrived (and says so in its log), and nothing moved.

docs/security.md, "Threat model", lists what each compromised piece can and cannot do.
"""

import json
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from helpers import await_until, ok
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from secured import Secured, ask, cli

from mesh import blobs, wire
from mesh.auth import creds as credentials
from mesh.auth import registry
from mesh.auth.signing import Signing
from mesh.model import SeatAnnounce
from mesh.modules import archive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
HELLO = ROOT / "docs" / "examples" / "hello"
SECRET = "s3cr3t-attack-51f0"


# --- the bus: deliveries, reflections, the seat and the bundle store ---------------------------


async def _logged(path: Path, *words: str, within: float, what: str) -> None:
    """Wait until a line of `path` has all `words` (the event loop runs meanwhile: what we
    published goes out)."""

    async def said() -> bool:
        return any(all(w in line for w in words) for line in path.read_text().splitlines())

    await await_until(said, within=within, what=what)


async def _applied(admin: Client, machine: str) -> dict | None:
    reply = await ask(admin, "mesh.ctl.nodes")
    node = next((n for n in (reply or {}).get("nodes", []) if n["name"] == machine), None)
    if node and node["digest_wanted"] and node["digest_applied"] == node["digest_wanted"]:
        return node
    return None


async def _hello_on(secured: Secured, admin: Client, machine: str) -> None:
    """node-1 with a declaration in the bucket: what its own watch consumer can deliver."""
    ok(cli(secured, secured.admin, "push", str(HELLO), "--timeout", "120"))
    ok(cli(secured, secured.admin, "secret", "set", "hello-token", stdin=SECRET))
    ok(cli(secured, secured.admin, "assign", "hello", machine, "--timeout", "120"))
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
    fleet, secured, as_identity, tmp_path, marker_dir
):
    """Rows 1 and 2: a build request stored in the bundle store by the builder (node-1) and
    delivered to node-2's `build` verb by a push consumer whose deliver subject the server does
    not check; and a host's own watch consumer aimed at another host's verbs."""
    admin = fleet
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


async def test_a_forged_seat_announcement_moves_no_host(fleet, secured, as_identity):
    """Row 3: a forged `held` of epoch 99 sent every host registering again and again, its
    loop stuck waiting for a holder of that epoch. The builder can no longer store one where a
    consumer would deliver it; and one that reaches the subject unsigned (here: published with
    the controllers' own credentials, without their signature) is refused by every host."""
    admin = fleet
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


async def test_a_reflected_answer_is_no_hosts_report(fleet, secured, as_identity, tmp_path):
    """Reflection into the controller's reports: node-2 asks the JetStream API to make a
    consumer named `node-1`, with node-1's tools report as the reply subject; the answer (its
    top level has `"name": "node-1"`) would read as node-1 reporting no tool servers."""
    admin = fleet
    ok(cli(secured, secured.admin, "push", str(ROOT / "docs" / "examples" / "files"),
           "--timeout", "120"))  # fmt: skip
    ok(cli(secured, secured.admin, "assign", "files", "node-1", "--timeout", "120"))

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


async def test_no_host_purges_or_overwrites_the_bundle_store(fleet, secured, as_identity):
    """Row 4: the builder purged the bundle store (302 objects gone, plans reverted). Now
    neither a builder nor another host may purge, roll up or write it; hosts still read it,
    one message per request."""
    admin = fleet
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


async def test_the_bundle_store_heals_from_a_push(fleet, secured, tmp_path):
    """Row 4, after a purge (JetStream's data lost, or purged by the one identity that still
    may): plans reverted one by one (`sha256:… is not in mesh-bundles`) and a push answered
    `no change`. Now a plan that would need a missing bundle stops before any machine, saying
    what to run, and a push of the same folder stores (and builds) what is missing again."""
    admin = fleet
    built = tmp_path / "built"
    (built / "src").mkdir(parents=True)
    (built / "src" / "build.sh").write_text(
        "set -e\nmkdir -p out\nprintf '#!/bin/sh\\necho built\\n' > out/app\n"
    )
    (built / "module.toml").write_text(
        '[module]\nname = "built"\n'
        '[bundle.app]\nkind = "binary"\nsource = "src"\nbuild = ["sh", "build.sh"]\n'
        'output = "out/app"\ntimeout = "60s"\n'
    )
    await _hello_on(secured, admin, "node-2")
    ok(cli(secured, secured.admin, "push", str(built), "--timeout", "120"))
    await admin.jsm().purge_stream("OBJ_mesh-bundles")

    assigned = cli(secured, secured.admin, "--json", "assign", "hello", "node-1", "--wait",
                   "--timeout", "120")  # fmt: skip
    assert assigned.returncode != 0
    plan = json.loads(ok(cli(secured, secured.viewer, "--json", "plan",
                             str(json.loads(assigned.stdout)["plan"]))))  # fmt: skip
    assert plan["state"] == "reverted", plan
    assert "not in the bundle store" in plan["failure"] and "mesh push" in plan["failure"], plan
    assert all(s["state"] == "pending" for s in plan["steps"]), plan  # no machine touched

    for folder in (HELLO, built):
        pushed = json.loads(ok(cli(secured, secured.admin, "--json", "push", str(folder),
                                   "--timeout", "120")))  # fmt: skip
        assert "restored" in pushed["message"] and pushed["plan"] is None, pushed
    ok(cli(secured, secured.admin, "assign", "hello", "node-1", "--wait", "--timeout", "120"))
    await await_until(lambda: _applied(admin, "node-1"), within=60, what="node-1 to apply")
    again = json.loads(ok(cli(secured, secured.admin, "--json", "push", str(HELLO))))
    assert again["plan"] is None and again["message"] == "no change", again
