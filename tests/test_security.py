"""Credentials and permissions against a real nats-server running the generated configuration:
nobody connects without a known key; a host can touch only what is scoped by its own name; a
viewer cannot change the fleet, an admin can; `mesh machine add/remove` issue and revoke a host.

Each refusal is checked next to a permitted action of the same kind, so a test that could not
see a refusal (a misspelt subject, a silent server) fails instead of passing."""

import base64
import json
import os
import re
import shlex
import stat
from pathlib import Path

import anyio
import msgspec
import pytest
from helpers import MESH, ask, await_until, node_named, ok, ok_json, one_line_error
from module_folders import HELLO, built_module
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError
from secured import Secured

from mesh import blobs, bus
from mesh.auth import claims, registry
from mesh.auth import creds as credentials
from mesh.auth.keys import new_user
from mesh.auth.policy import OPERATOR_WATCH, READ_VERBS
from mesh.meshdir import MeshDir
from services.controller.serving.verbs import VERBS
from services.host.facts import gather

ROOT = Path(__file__).parent.parent
CONTROLLER_MODULE = ROOT / "services" / "controller"
SECRET = "s3cr3t-auth-2c9e"
# Verbs that change the fleet: never a viewer's, whatever the verb table holds today.
ADMIN_VERBS = ("push", "assign", "unassign", "secret-set", "tier", "label", "handover", "diff")
NODES = ("node-1", "node-2")  # the secured fleet's hosts (tests/secured.py)


# --- connecting --------------------------------------------------------------------------------


async def test_no_credentials_or_an_unknown_key_cannot_connect(secured: Secured, tmp_path):
    with pytest.raises(bus.Unauthorized, match="without credentials"):
        await secured.connect(None)

    stranger = tmp_path / "stranger.creds"
    key = new_user()  # a well-formed key the server has never heard of
    credentials.write(stranger, who="a stranger", seed=key.seed, inbox="_INBOX")
    with pytest.raises(bus.Unauthorized, match="refused the credentials"):
        await secured.connect(str(stranger))
    # A service, which reconnects forever, is told too instead of knocking forever.
    with anyio.fail_after(20):
        with pytest.raises(bus.Unauthorized):
            await bus.connect(secured.url, name="svc", creds=str(stranger), reconnect=True)

    nc = await secured.connect(secured.admin)  # the same server admits a key it knows
    assert nc.is_connected
    await nc.close()

    line = one_line_error(secured.cli(None, "status"))
    assert "refused a connection without credentials" in line and "MESH_CREDS" in line
    line = one_line_error(secured.cli(str(tmp_path / "missing.creds"), "status"))
    assert "missing.creds" in line


async def test_a_viewer_may_only_read_and_an_admin_may_call_every_verb(secured, as_identity):
    viewer = await as_identity(secured.viewer)
    admin = await as_identity(secured.admin)
    for verb in sorted({*VERBS, *ADMIN_VERBS, *READ_VERBS}):
        # Reads on mesh.ctl.<verb>, by both; changes only on the admin's own subjects.
        subject = f"mesh.ctl.{verb}"
        assert await viewer.publish_refused(subject) == (verb not in READ_VERBS), verb
        assert await admin.publish_refused(subject) == (verb not in READ_VERBS), verb
        assert not await admin.publish_refused(f"mesh.op.admin.{verb}"), verb
        assert await viewer.publish_refused(f"mesh.op.viewer.{verb}"), verb
        assert await viewer.publish_refused(f"mesh.op.admin.{verb}"), verb
    assert not set(ADMIN_VERBS) & READ_VERBS
    assert {"status", "nodes", "modules", "declaration"} <= READ_VERBS
    # Operators read hosts' status and logs; only an admin restarts a process.
    assert not await viewer.publish_refused("mesh.host.node-1.logs")
    assert await viewer.publish_refused("mesh.host.node-1.restart")
    assert not await admin.publish_refused("mesh.host.node-1.restart")
    # Both hear what the console shows: beats, hosts' reports, the seat, plans' progress.
    for who in (viewer, admin):
        for subject in OPERATOR_WATCH:
            assert not await who.subscribe_refused(subject), subject
    # Nobody reads other identities' replies or the fleet's traffic.
    for who in (viewer, admin):
        assert await who.subscribe_refused("_INBOX.>")
        assert await who.subscribe_refused("mesh.>")
        assert not await who.subscribe_refused(f"{who.nc._inbox_prefix.decode()}.x")


async def test_roles_and_a_host_applying_its_declaration_under_credentials(
    secured_fleet, secured, tmp_path
):
    # A viewer reads, and is refused a change at once, in one line that says so.
    assert ok_json(secured.cli(secured.viewer, "--json", "status"))["nodes"]["up"] == 2
    line = one_line_error(secured.cli(secured.viewer, "push", str(HELLO)))
    assert line.startswith("mesh: error: forbidden:") and "viewer.creds" in line
    line = one_line_error(secured.cli(secured.viewer, "assign", "hello", "node-2"))
    assert "forbidden" in line and "mesh.op.viewer.assign" in line
    line = one_line_error(secured.cli(secured.viewer, "secret", "set", "x", stdin="v"))
    assert "forbidden" in line and "mesh.op.viewer.secret-set" in line

    # An admin changes the fleet; the host, under its own credentials, watches its own key,
    # fetches the bundle, asks for its secret and applies.
    ok(secured.cli(secured.admin, "secret", "set", "hello-token", stdin=SECRET))
    ok(secured.cli(secured.admin, "push", str(HELLO), "--timeout", "120"))
    ok(secured.cli(secured.admin, "assign", "hello", "node-2", "--timeout", "120"))

    async def applied():
        n = await node_named(secured_fleet, "node-2")
        return n if n and n["digest_wanted"] and n["digest_applied"] == n["digest_wanted"] else None

    await await_until(applied, within=60, what="node-2 to apply under its credentials")
    token = tmp_path / "hosts" / "node-2" / "processes" / "hello" / "files" / "token"
    assert token.read_text() == SECRET
    declaration = ok_json(secured.cli(secured.viewer, "--json", "declaration", "node-2"))
    assert declaration["digest"] == (await node_named(secured_fleet, "node-2"))["digest_applied"]

    # A build runs on the builder host, which stores its output and log under its credentials.
    built = built_module(
        tmp_path / "built",
        "set -e\necho building under credentials\nmkdir -p out\n"
        "printf '#!/bin/sh\\necho hi\\n' > out/app\n",
    )
    ok(secured.cli(secured.admin, "push", str(built), "--timeout", "120"))
    logs = secured.cli(secured.viewer, "build", "logs", "built")
    assert "building under credentials" in ok(logs) and "node-1" in logs.stderr


async def test_viewers_list_tools_a_tools_operator_and_an_admin_call_them(
    secured_fleet, secured, as_identity, tmp_path
):
    """Who may list and call the fleet's tools is the server's to enforce, as every verb is."""
    viewer = await as_identity(secured.viewer)
    tooler = await as_identity(secured.tools)
    admin = await as_identity(secured.admin)
    host = await as_identity(secured.creds("host", "node-1"))
    assert not await viewer.publish_refused("mesh.ctl.tools")
    assert await viewer.publish_refused("mesh.host.node-2.tool")
    for subject in ("mesh.ctl.tools", "mesh.ctl.status", "mesh.ctl.nodes", "mesh.host.node-2.tool"):
        assert not await tooler.publish_refused(subject), subject
    for subject in ("mesh.ctl.push", "mesh.ctl.assign", "mesh.host.node-2.restart",
                    "mesh.host.node-2.logs", "mesh.ctl.declaration"):  # fmt: skip
        assert await tooler.publish_refused(subject), subject
    assert not await admin.publish_refused("mesh.host.node-2.tool")
    assert await host.publish_refused("mesh.host.node-2.tool")  # a host calls no one's tools
    assert await host.subscribe_refused("mesh.host.node-2.tool")  # nor hears another's calls
    assert await tooler.subscribe_refused("mesh.host.node-2.tool")

    example = ROOT / "docs" / "examples" / "files"
    ok(secured.cli(secured.admin, "push", str(example), "--timeout", "120"))
    ok(secured.cli(secured.admin, "assign", "files", "node-2", "--timeout", "120"))

    async def ready():
        done = secured.cli(secured.viewer, "tools", "--json")
        tools = json.loads(done.stdout)["tools"] if done.returncode == 0 else []
        return tools if any(t["state"] == "ready" for t in tools) else None

    tools = await await_until(ready, within=60, what="the viewer to list node-2's tools")
    assert {t["machine"] for t in tools} == {"node-2"}
    call = ("tool", "call", "node-2", "files", "echo", "--args", '{"text": "hi"}')
    line = one_line_error(secured.cli(secured.viewer, *call))
    assert "forbidden" in line and "mesh.host.node-2.tool" in line
    assert ok(secured.cli(secured.tools, *call)) == "hi\n"
    assert ok(secured.cli(secured.admin, *call)) == "hi\n"
    line = one_line_error(secured.cli(secured.tools, "push", str(example)))
    assert line.startswith("mesh: error: forbidden:") and "tools.creds" in line


async def test_a_host_can_touch_only_what_is_its_own(secured_fleet, secured, as_identity):
    ok(secured.cli(secured.admin, "secret", "set", "hello-token", stdin=SECRET))
    ok(secured.cli(secured.admin, "push", str(HELLO), "--timeout", "120"))
    ok(secured.cli(secured.admin, "assign", "hello", "node-2", "--timeout", "120"))
    a = await as_identity(secured.creds("host", "node-1"))  # host A; B is node-2

    # It speaks for itself only.
    assert not await a.publish_refused("mesh.host.node-1.beat")
    assert not await a.publish_refused("mesh.event.node-1.applied")
    for subject in (
        "mesh.host.node-2.beat",
        "mesh.event.node-2.applied",
        "mesh.event.node-2.processes",
        "mesh.ctl.host.node-2.register",
        "mesh.ctl.host.node-2.secret",
        "mesh.host.node-2.status",  # B's own verbs, even a read
        "mesh.ctl.push",
        "mesh.ctl.assign",
        "mesh.ctl.declaration",
        "mesh.ctl.secret-set",
        "$KV.mesh-declarations.node-2",  # writing declarations is the controller's alone
        "$KV.mesh-declarations.node-1",
        "mesh.seat.mesh-controller.held",
    ):
        assert await a.publish_refused(subject), subject
    # It hears its own verbs, the seat and its own inbox; nothing of B's.
    assert not await a.subscribe_refused("mesh.host.node-1.status")
    assert not await a.subscribe_refused("_INBOX_node-1.x")
    for subject in (
        "mesh.host.node-2.status",
        "mesh.host.*.status",
        "_INBOX_node-2.>",
        "_INBOX.>",
        "mesh.event.>",
        "mesh.ctl.>",
        "$KV.mesh-declarations.node-2",
    ):
        assert await a.subscribe_refused(subject), subject

    # B's secret is not A's to have: by B's subject it is refused (above); asked as itself, the
    # request reaches the controller and the answer reaches A's own inbox, and it is no.
    reply = await ask(a.nc, "mesh.ctl.host.node-1.secret", {"name": "hello-token"})
    assert reply is not None and reply["error"]["code"] == "forbidden", reply

    # B's declaration is in the bucket (the controller and an admin can read it) ...
    ctl = await secured.connect(secured.creds("controller", registry.CONTROLLER))
    try:
        kv = await ctl.jetstream().key_value(blobs.DECLARATIONS)

        async def stored():
            try:
                return await kv.get("node-2")
            except Exception:
                return None

        entry = await await_until(stored, within=30, what="node-2's declaration in the bucket")
        assert json.loads(entry.value)["machine"] == "node-2"
    finally:
        await ctl.close()
    # ... and no way of reading it is open to A.
    js = a.nc.jetstream(timeout=2)
    kv = await js.key_value(blobs.DECLARATIONS)  # the bucket's info: allowed
    before = len(a.seen)
    with pytest.raises(NatsTimeout):
        await kv.get("node-2")  # a direct or stream get: refused, never answered
    with pytest.raises(NatsTimeout):
        await kv.watch("node-2")  # a consumer without a name: the filter is not checkable
    with pytest.raises(NatsTimeout):
        await a.nc.jsm().add_consumer(
            "KV_mesh-declarations",
            config=ConsumerConfig(name="peek", filter_subject="$KV.mesh-declarations.node-2",
                                  deliver_policy=DeliverPolicy.LAST_PER_SUBJECT),
        )  # fmt: skip
    assert len(a.seen) >= before + 3, a.seen
    # Its own key in the subject and B's in the body: the server compares them.
    with pytest.raises(APIError, match="filter"):
        await _create_with_mismatched_filter(a.nc)
    # The way the host watches its own key is open (the positive control of the above).
    own = await a.nc.jsm().add_consumer(
        "KV_mesh-declarations",
        config=ConsumerConfig(name="own", filter_subject="$KV.mesh-declarations.node-1",
                              deliver_subject=a.nc.new_inbox(), inactive_threshold=5.0,
                              deliver_policy=DeliverPolicy.LAST_PER_SUBJECT),
    )  # fmt: skip
    assert own.name == "own"


async def _admitted(secured: Secured, creds: str) -> Client:
    """A connection with credentials just issued: the server's reload (SIGHUP) is not instant."""
    got: list[Client] = []

    async def connect() -> bool:
        try:
            got.append(await secured.connect(creds))
        except bus.Unauthorized:
            return False
        return True

    await await_until(connect, within=10, what=f"the server to admit {creds}")
    return got[0]


async def test_a_host_cannot_choose_its_own_tier_or_labels(secured_fleet, secured):
    """NodeRestriction: with its own credentials, a host asks for tier 0 and builder=true in
    its registration, and gets what the operator decided: tier 2 and no labels for a machine
    added without --builder, the operator's tier 1 for node-2. Assignment by label reaches only
    the machine the operator labelled."""
    folder = str(secured.dir.root)
    ok(secured.cli(None, "machine", "add", "node-3", "--dir", folder))  # not a builder
    claim = {"tier": 0, "labels": {"builder": "true"}, "facts": msgspec.to_builtins(gather()),
             "beat_interval": 1, "pid": 1}  # fmt: skip
    for name, kept in (("node-3", 2), ("node-2", 1)):  # a first registration; a placed machine
        nc = await _admitted(secured, secured.creds("host", name))
        try:
            reply = await ask(nc, f"mesh.ctl.host.{name}.register", {"name": name, **claim})
        finally:
            await nc.close()
        assert reply is not None and "error" not in reply, reply
        assert (reply["tier"], reply["labels"]) == (kept, {}), reply
    nodes = {n["name"]: n for n in (await ask(secured_fleet, "mesh.ctl.nodes"))["nodes"]}
    assert [(nodes[n]["tier"], nodes[n]["labels"]) for n in ("node-1", "node-2", "node-3")] == [
        (0, {"builder": "true"}), (1, {}), (2, {}),
    ]  # fmt: skip

    ok(secured.cli(secured.admin, "secret", "set", "hello-token", stdin=SECRET))
    ok(secured.cli(secured.admin, "push", str(HELLO), "--timeout", "120"))
    assigned = ok_json(secured.cli(secured.admin, "--json", "assign", "hello", "--label",
                                 "builder=true", "--timeout", "120"))  # fmt: skip
    assert assigned["machines"] == ["node-1"], assigned

    # The operator's way: an admin labels a machine; a viewer may not.
    line = one_line_error(secured.cli(secured.viewer, "label", "node-3", "builder=true"))
    assert "forbidden" in line and "mesh.op.viewer.label" in line
    labelled = ok_json(secured.cli(secured.admin, "--json", "label", "node-3", "zone=b"))
    assert labelled == {"machine": "node-3", "labels": {"zone": "b"}, "was": {},
                        "registered": True}  # fmt: skip
    removed = ok_json(secured.cli(secured.admin, "--json", "label", "node-3", "--remove", "zone"))
    assert (removed["labels"], removed["was"]) == ({}, {"zone": "b"})
    line = one_line_error(secured.cli(secured.admin, "label", "node-3", "a=1", "--remove", "a"))
    assert "label a: both set and removed" in line

    # A machine added with its place takes it at its first registration, whatever it asks.
    added = ok_json(secured.cli(None, "--json", "machine", "add", "node-4", "--dir",
                              folder, "--tier", "1", "--label", "zone=a"))  # fmt: skip
    assert (added["tier"], added["labels"]) == (1, {"zone": "a"}), added
    assert "--label" not in added["command"] and "--tier" not in added["command"]
    nc = await _admitted(secured, secured.creds("host", "node-4"))
    try:
        reply = await ask(nc, "mesh.ctl.host.node-4.register", {"name": "node-4", **claim})
    finally:
        await nc.close()
    assert (reply["tier"], reply["labels"]) == (1, {"zone": "a"}), reply
    # `mesh dev place` (compose.dev.yaml's) places only the machines never seen: node-5 here.
    placed = ok_json(secured.cli(secured.admin, "--json", "dev", "place", "--hosts", "5"))
    assert placed == {"placed": ["machine node-5 placed: tier 2, labels none"]}, placed


async def test_the_controllers_secrets_reach_no_machine_outside_the_control_set(
    secured_fleet, secured
):
    """services/controller names the controllers' NATS identity and the store's connection as
    secrets; it runs on the machines labelled role=control (none here), so no host can have
    them, while the same verb hands a host a secret its declaration names."""
    admin = secured.admin
    ok(secured.cli(admin, "secret", "set", "mesh-controller-creds", stdin="controller seed"))
    ok(secured.cli(admin, "secret", "set", "mesh-database-url", stdin="postgresql://db/mesh"))
    ok(secured.cli(admin, "secret", "set", "mesh-store-ca", stdin="the store's CA"))
    ok(secured.cli(admin, "secret", "set", "mesh-system-creds", stdin="the system kicker"))
    ok(secured.cli(admin, "secret", "set", "mesh-nats-signer", stdin="the signing key"))
    ok(secured.cli(admin, "secret", "set", "hello-token", stdin=SECRET))
    pushed = ok_json(
        secured.cli(admin, "--json", "push", str(CONTROLLER_MODULE), "--timeout", "120")
    )
    # Assigned by label, not by tier: no machine here is a control machine, so no declaration
    # names the controller's secrets (by tiers, node-1 and node-2 would run it and have them).
    assert pushed["machines"] == [], pushed
    ok(secured.cli(admin, "push", str(HELLO), "--timeout", "120"))
    ok(secured.cli(admin, "assign", "hello", "node-2", "--timeout", "120"))

    hosts = {name: await secured.connect(secured.creds("host", name)) for name in NODES}
    try:
        for name, nc in hosts.items():
            for secret in ("mesh-controller-creds", "mesh-database-url", "mesh-store-ca",
                           "mesh-secrets-key", "mesh-system-creds",
                           "mesh-nats-signer"):  # fmt: skip
                reply = await ask(nc, f"mesh.ctl.host.{name}.secret", {"name": secret})
                assert reply is not None and reply["error"]["code"] == "forbidden", (name, reply)

        async def granted():
            r = await ask(hosts["node-2"], "mesh.ctl.host.node-2.secret", {"name": "hello-token"})
            return r if r and "value" in r else None

        reply = await await_until(granted, within=30, what="node-2's own secret")
        assert base64.b64decode(reply["value"]).decode() == SECRET
    finally:
        for nc in hosts.values():
            await nc.close()


async def _create_with_mismatched_filter(nc: Client) -> None:
    """A consumer-create request on the subject of node-1's key whose body asks for node-2's."""
    body = {
        "stream_name": "KV_mesh-declarations",
        "config": {
            "name": "peek2",
            "filter_subject": "$KV.mesh-declarations.node-2",
            "deliver_policy": "last_per_subject",
            "ack_policy": "none",
        },
    }
    subject = "$JS.API.CONSUMER.CREATE.KV_mesh-declarations.peek2.$KV.mesh-declarations.node-1"
    reply = json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=2)).data)
    if "error" in reply:
        raise APIError(description=reply["error"].get("description"))
    raise AssertionError(f"the server created a consumer on another machine's key: {reply}")


# --- mesh machine add / remove ------------------------------------------------------------------


class _Added(msgspec.Struct):
    name: str
    creds: str
    command: str
    reloaded: bool
    servers: str | None = None


async def test_machine_add_issues_a_working_host_and_remove_revokes_it(
    secured_fleet, secured, procs, tmp_path
):
    folder = str(secured.dir.root)
    added = msgspec.json.decode(
        ok(secured.cli(None, "machine", "add", "node-9", "--dir", folder, "--json")), type=_Added
    )
    assert added.name == "node-9" and added.reloaded
    assert stat.S_IMODE(os.stat(added.creds).st_mode) == 0o600
    argv = shlex.split(added.command)
    assert argv[:3] == ["mesh", "host", "run"] and "--nats-url" not in argv
    assert added.servers == secured.url  # the one file names the server: the command need not
    again = one_line_error(secured.cli(None, "machine", "add", "node-9", "--dir", folder))
    assert "already has credentials" in again

    # The printed command, as a user on the new machine runs it (confined to a folder here).
    procs.start(
        "node-9",
        [*MESH, *argv[1:], "--root", str(tmp_path / "hosts" / "node-9")],
        env={"MESH_CREDS": ""},  # nothing but the command and its file
    )

    async def state(up: bool):
        n = await node_named(secured_fleet, "node-9")
        return n if n and n["up"] is up else None

    await await_until(lambda: state(True), within=30, what="node-9 up with its new credentials")
    seed = Path(added.creds).read_text()

    removed = ok_json(secured.cli(None, "machine", "remove", "node-9", "--dir", folder, "--json"))
    assert removed["reloaded"] and not Path(added.creds).exists()
    # The server closed the revoked host's connection: its beats stop and it goes down.
    await await_until(lambda: state(False), within=30, what="node-9 down after revocation")
    kept = tmp_path / "kept.creds"
    kept.write_text(seed)
    with pytest.raises(bus.Unauthorized):
        await secured.connect(str(kept))
    assert "node-9" not in secured.dir.auth_conf.read_text()
    line = one_line_error(secured.cli(None, "machine", "remove", "node-9", "--dir", folder))
    assert "no credentials" in line


# --- the files ----------------------------------------------------------------------------------


def test_a_credentials_file_is_private_and_reads_back(tmp_path: Path) -> None:
    key = new_user()
    path = tmp_path / "sub" / "node-1.creds"
    credentials.write(path, who="host node-1", seed=key.seed, inbox="_INBOX_node-1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    held = credentials.read(path)
    assert (held.seed, held.inbox, held.jwt) == (key.seed, "_INBOX_node-1", False)
    # The seed line is the only one starting "SU": NATS tools (`nats --nkey`) find it too.
    assert [line for line in path.read_text().splitlines() if line.startswith("SU")] == [key.seed]

    bare = tmp_path / "bare.seed"
    bare.write_text(key.seed + "\n")  # a seed file from another tool: the default inbox
    assert credentials.read(bare).inbox == "_INBOX"
    for text, why in (("nothing here\n", "no NATS user seed"), ("SUAAAA\n", "not a valid")):
        bad = tmp_path / "bad.creds"
        bad.write_text(text)
        with pytest.raises(credentials.CredsError, match=why):
            credentials.read(bad)
    with pytest.raises(credentials.CredsError, match="No such file"):
        credentials.read(tmp_path / "absent.creds")


def _preloaded(conf: str, name: str) -> dict:
    """The claims of the account `name` the servers' configuration preloads."""
    found = [
        claims.decode(jwt)
        for jwt in re.findall(r'^  A[A-Z2-7]+: "([^"]+)"$', conf, re.MULTILINE)
        if claims.decode(jwt)["name"] == name
    ]
    assert len(found) == 1, conf
    return found[0]


def test_the_registry_keeps_credentials_and_revokes_a_key_issued_anew(tmp_path: Path) -> None:
    folder = MeshDir(tmp_path / "mesh")
    with registry.locked(folder) as users:
        admin = users.ensure("operator", "admin", role="admin")
        host = users.ensure("host", "node-1")
        users.save()
    first = (admin.read_text(), host.read_text())
    lost = registry.Registry.load(folder).get("host", "node-1").public
    with registry.locked(folder) as users:  # as `mesh dev up` started again
        assert users.ensure("operator", "admin", role="admin") == admin
        host.unlink()  # a lost file is issued anew, with a new key
        users.ensure("host", "node-1")
        users.save()
    assert admin.read_text() == first[0] and host.read_text() != first[1]
    # The servers know no user: the new file's JWT is signed by the mesh's signer, the lost
    # key is in the account's revocations, and every user's key is absent from the file.
    conf = folder.auth_conf.read_text()
    held = registry.Registry.load(folder)
    new = held.get("host", "node-1").public
    assert new not in conf and held.get("operator", "admin").public not in conf
    account = _preloaded(conf, "MESH")
    assert lost in account["nats"]["revocations"] and new not in account["nats"]["revocations"]
    assert held.trust.signer.public in account["nats"]["signing_keys"]
    user = claims.decode(credentials.read(host).user_jwt)
    assert (user["sub"], user["iss"]) == (new, held.trust.signer.public)
    assert user["nats"]["issuer_account"] == held.trust.account.public
    with pytest.raises(registry.AuthError):
        registry.Registry.load(folder).issue("operator", registry.CONTROLLER, role="admin")


async def test_a_hosts_watch_of_its_own_key_outlives_a_server_restart(secured: Secured):
    from services.host import watch

    ctl = await bus.connect(
        secured.url, name="ctl", creds=secured.creds("controller", registry.CONTROLLER)
    )
    host = await bus.connect(secured.url, name="node-1", creds=secured.creds("host", "node-1"))
    try:
        kv, _ = await blobs.ensure(ctl)
        await kv.put("node-1", b"one")
        await kv.put("node-2", b"not yours")
        values = watch.values(host, "node-1")
        with anyio.fail_after(10):
            assert await anext(values) == b"one"
        await kv.put("node-1", b"two")
        with anyio.fail_after(10):
            assert await anext(values) == b"two"

        # The server restarts (its file store keeps the bucket, not the consumer in memory).
        secured.proc.terminate()
        secured.proc.wait(timeout=10)
        secured.proc = secured.start()

        async def put_three() -> bool:
            try:
                await kv.put("node-1", b"three")
            except Exception:  # not reconnected yet
                return False
            return True

        await await_until(put_three, within=20, what="the controller back on the server")
        with anyio.fail_after(30):  # the new value, and not "two" again
            assert await anext(values) == b"three"
        await values.aclose()
    finally:
        await host.close()
        await ctl.close()
