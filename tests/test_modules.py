"""Modules end to end, as a user drives them with the `mesh` command against a real controller,
real hosts (node-1 the builder), NATS with JetStream and PostgreSQL."""

import json
import shutil
import subprocess
from pathlib import Path

import asyncpg
import pytest
from helpers import MESH, ask, await_until, js, kv_keys, kv_read, ok, ok_json, one_line_error
from module_folders import HELLO, HELLO_TOKEN, built_module


async def declarations(nc) -> dict[str, dict]:
    async def read(kv) -> dict[str, dict]:
        return {key: json.loads((await kv.get(key)).value) for key in await kv_keys(kv)}

    return await kv_read(nc, "mesh-declarations", read, what="the declarations")


async def _hello_on_node_2(start_fleet, cli) -> None:
    """Three hosts up (node-1 the builder) and the example assigned to node-2, its secret set."""
    await start_fleet(hosts=3, builder=True)
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "node-2", "--wait"))


async def test_push_and_assign_reach_exactly_the_assigned_machines(start_fleet, nc, cli) -> None:
    await start_fleet(hosts=3, builder=True)
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    pushed = ok_json(cli("push", str(HELLO), "--json"))
    assert pushed["plan"] is None  # assigned to no machine yet: nothing changes
    again = ok_json(cli("--json", "push", str(HELLO)))
    assert again["plan"] is None and again["message"] == "no change"

    assigned = ok_json(cli("--json", "assign", "hello", "node-2", "node-3", "--wait"))
    assert isinstance(assigned["plan"], int)
    assert assigned["machines"] == ["node-2", "node-3"]
    assert assigned["outcome"]["state"] == "done"

    kv = await declarations(nc)
    assert set(kv) == {"node-2", "node-3"}
    for machine in ("node-2", "node-3"):
        decl = kv[machine]
        assert decl["machine"] == machine and decl["epoch"] >= 1
        process = decl["declaration"]["processes"]["hello"]
        assert process["command"] == ["python3", "hello.py", "--port", "8080"]
        assert process["account"] == "hello"
        assert decl["declaration"]["accounts"]["hello"]["home"] == "/var/lib/hello"

    nodes = {n["name"]: n for n in ok_json(cli("--json", "nodes"))["nodes"]}
    assert nodes["node-1"]["digest_wanted"] is None
    assert nodes["node-2"]["digest_wanted"] == kv["node-2"]["digest"]
    shown = ok_json(cli("--json", "declaration", "node-3"))
    assert shown["digest"] == kv["node-3"]["digest"]

    modules = ok_json(cli("--json", "modules"))["modules"]
    assert [(m["name"], m["assigned"], m["processes"]) for m in modules] == [
        ("hello", ["node-2", "node-3"], ["hello"])
    ]

    ok(cli("unassign", "hello", "node-3", "--wait"))
    kv = await declarations(nc)
    assert kv["node-3"]["declaration"]["processes"] == {}
    assert "hello" in kv["node-2"]["declaration"]["processes"]


async def test_assign_by_tier_and_label(start_fleet, nc, cli) -> None:
    await start_fleet(hosts=3, builder=True)
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "--tier", "2", "--wait"))
    assert set(await declarations(nc)) == {"node-3"}
    ok(cli("assign", "hello", "--label", "builder=true", "--wait"))
    assert set(await declarations(nc)) == {"node-1", "node-3"}
    line = one_line_error(cli("assign", "hello", "node-9"))
    assert "node-9 is not registered" in line


async def test_a_conflicting_module_is_refused_naming_both(start_fleet, nc, tmp_path, cli) -> None:
    await _hello_on_node_2(start_fleet, cli)
    before = await declarations(nc)

    clash = tmp_path / "clash"
    (clash / "src").mkdir(parents=True)
    (clash / "src" / "x.txt").write_text("x")
    (clash / "module.toml").write_text(
        '[module]\nname = "hello-clash"\n'
        '[bundle.b]\nkind = "files"\nsource = "src"\n'
        "[account.clash]\n"
        '[process.hello]\nbundle = "b"\ncommand = ["true"]\naccount = "clash"\n'
        '[assign]\nmachines = ["node-2"]\n'
    )
    line = one_line_error(cli("push", str(clash)))
    assert "process hello is declared by modules hello and hello-clash" in line
    assert await declarations(nc) == before  # nothing half-applied
    modules = ok_json(cli("--json", "modules"))["modules"]
    assert [m["name"] for m in modules] == ["hello"]

    # A first push whose [assign] names a machine that never registered: refused, naming it,
    # rather than placed on the others only.
    (clash / "module.toml").write_text(
        (clash / "module.toml").read_text()
        .replace('name = "hello-clash"', 'name = "typo"').replace("process.hello", "process.typo")
        .replace('machines = ["node-2"]', 'machines = ["node-2", "nod-3", "node-9"]')
    )  # fmt: skip
    line = one_line_error(cli("push", str(clash)))
    assert line == (
        "mesh: error: push: assign.machines: nod-3, node-9: no such machine has registered "
        "(mesh nodes lists those that have; assign one later with mesh assign)"
    ), line
    assert [m["name"] for m in ok_json(cli("--json", "modules"))["modules"]] == ["hello"]


@pytest.mark.parametrize(
    ("toml", "field"),
    [
        ('[module]\nname = "m"\ncolour = "red"\n', "module.colour"),
        ('[module]\nname = "m"\n[container.c]\nbuild = "."\n', "container.c.build"),
        ('[module]\nname = "m"\n[bundle.b]\nkind = "files"\nsource = "../x"\n', "bundle.b.source"),
        ('[module]\nname = "m"\n[bundle.b]\nkind = "system"\n[process.p]\nbundle = "b"\n'
         'command = "run --fast"\nroot = true\n', "process.p.command"),
        ('[module]\nname = "m"\n[bundle.b]\nkind = "system"\n[process.p]\nbundle = "nope"\n'
         'command = ["x"]\nroot = true\n', "process.p.bundle"),
        ('[module]\nname = "a.b"\n', "module.name"),
    ],
)  # fmt: skip
async def test_bad_manifests_get_one_line_naming_the_field(start_fleet, tmp_path, toml, field, cli):
    await start_fleet(hosts=3, builder=True)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "module.toml").write_text(toml)
    line = one_line_error(cli("push", str(tmp_path / "m")))
    assert f": {field}:" in line


async def test_the_controller_gates_what_it_is_sent(start_fleet, nc) -> None:
    # A client that skips the local gate meets the same rules at the controller.
    await start_fleet(hosts=3, builder=True)
    body = {"manifest": '[module]\nname = "m"\ncolour = 1\n', "source": "sha256:" + "0" * 64}
    reply = await ask(nc, "mesh.ctl.push", body)
    assert reply["error"]["code"] == "refused"
    assert "module.colour: unknown field" in reply["error"]["message"]
    assert (await ask(nc, "mesh.ctl.status"))["seat"]["holder"] == "ctl-a"


async def test_the_manifest_must_be_the_one_in_the_source(start_fleet, nc) -> None:
    await start_fleet(hosts=3, builder=True)
    from mesh import blobs
    from mesh.modules.load import load

    module = load(HELLO)
    await blobs.put(await blobs.store(nc), module.source)
    other = module.manifest_text.replace('"--port", "8080"', '"--port", "9999"')
    reply = await ask(nc, "mesh.ctl.push", {"manifest": other, "source": module.version})
    assert reply["error"]["code"] == "refused"
    assert "differs from the module.toml in the source archive" in reply["error"]["message"]


def _push_in_background(nats_url: str, module: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*MESH, "--json", "push", str(module), "--nats-url", nats_url, "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finished(push: subprocess.Popen) -> dict:
    out, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    return json.loads(out)


ON_NODE_3 = '[assign]\nmachines = ["node-3"]\n'  # the built modules' machine


def _gated_build(gate: Path) -> str:
    """A build that runs until the test opens the gate (in `open_dir`, a folder the builder's
    account can look into); `sleep` is the script's own polling."""
    return (
        f"set -e\necho waiting for {gate}/open\n"
        f"while [ ! -e {gate}/open ]; do sleep 0.05; done\n"
        "mkdir -p out\nprintf '#!/bin/sh\\necho hi\\n' > out/app\n"
    )


GOOD_BUILD = "set -e\necho building\nmkdir -p out\nprintf '#!/bin/sh\\necho hi\\n' > out/app\n"


async def _builds(database_url: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT bundle, state, builder FROM builds ORDER BY started")
    finally:
        await conn.close()
    return [(r["bundle"], r["state"], r["builder"]) for r in rows]


async def test_builds_run_on_the_builder_are_cached_and_fail_clearly(
    start_fleet, nc, tmp_path, database_url, cli
) -> None:
    await start_fleet(hosts=3, builder=True)
    module = built_module(tmp_path / "built", GOOD_BUILD, extra=ON_NODE_3)
    pushed = ok_json(cli("--json", "push", str(module)))
    assert pushed["machines"] == ["node-3"]
    assert await _builds(database_url) == [("app", "done", "node-1")]
    decl = (await declarations(nc))["node-3"]["declaration"]
    bundle = decl["processes"]["app"]["bundle"]
    assert bundle.startswith("binary:sha256:")
    digest = decl["bundles"][bundle]["digest"]
    store = await js(nc).object_store("mesh-bundles")
    assert (await store.get(digest.replace(":", "-"))).data  # the built bundle is stored

    # Same source folder and argv: the cached bundle is used, nothing is built again.
    built_module(module, GOOD_BUILD, description="only the manifest changed", extra=ON_NODE_3)
    ok(cli("push", str(module)))
    assert len(await _builds(database_url)) == 1

    built_module(module, "echo about to fail\necho 'missing thing' >&2\nexit 3\n", extra=ON_NODE_3)
    failed = cli("push", str(module))
    assert failed.returncode == 1
    assert "failed: exit code 3" in failed.stderr
    assert "missing thing" in failed.stderr  # the build's last lines
    assert "Traceback" not in failed.stderr
    newest = ok_json(cli("--json", "plan"))["plans"][0]
    assert (newest["subject"], newest["state"]) == ("built", "failed")  # its plan says why
    assert "failed: exit code 3" in newest["failure"] and newest["machines"] == 0
    logs = cli("build", "logs", "built")
    assert "about to fail" in ok(logs) and "missing thing" in logs.stdout
    assert "failed" in logs.stderr
    # the failed push changed nothing
    assert (await declarations(nc))["node-3"]["declaration"]["processes"]["app"]["bundle"] == bundle


async def _query(database_url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def _build_state(database_url: str, module: str) -> str | None:
    rows = await _query(database_url, "SELECT state FROM builds WHERE module = $1", module)
    return rows[0]["state"] if rows else None


async def test_a_build_holds_up_no_other_change_and_its_plan_shows_it_building(
    start_fleet, nc, nats_url, tmp_path, database_url, open_dir, cli
) -> None:
    await start_fleet(hosts=3, builder=True)
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    module = built_module(tmp_path / "built", _gated_build(open_dir), extra=ON_NODE_3)
    push = _push_in_background(nats_url, module)
    try:

        async def running() -> bool:
            return await _build_state(database_url, "built") == "running"

        await await_until(running, within=60, what="the build to run on node-1")
        # While the build runs, other changes are answered (the gate is still closed).
        assigned = cli("--json", "assign", "hello", "node-2", answer=10, timeout=30)
        assert ok_json(assigned)["machines"] == ["node-2"]
        ok(cli("secret", "set", "other-secret", stdin="x", answer=10, timeout=30))
        assert push.poll() is None and await _build_state(database_url, "built") == "running"
        # The push's plan is recorded as building, with no steps until the build is done.
        [shown] = [p for p in ok_json(cli("--json", "plan"))["plans"]
                   if p["subject"] == "built"]  # fmt: skip
        assert (shown["state"], shown["trigger"], shown["machines"]) == ("building", "push", 0)

        (open_dir / "open").touch()
        pushed = _finished(push)
    finally:
        (open_dir / "open").touch()
        if push.poll() is None:
            push.kill()
    assert pushed["plan"] == shown["id"] and pushed["machines"] == ["node-3"]
    [build] = await _query(database_url, "SELECT state, digest FROM builds")
    assert build["state"] == "done"
    plan = ok_json(cli("--json", "plan", str(pushed["plan"])))
    assert plan["state"] != "building"
    assert plan["builds"] == [{"bundle": "app", "digest": build["digest"], "built": True}]
    [step] = await _query(
        database_url, "SELECT machine, after_body FROM plan_steps WHERE plan_id = $1", plan["id"]
    )
    decl = json.loads(bytes(step["after_body"]))
    assert step["machine"] == "node-3"
    assert [b["digest"] for b in decl["bundles"].values()] == [build["digest"]]


async def test_a_build_with_no_builder_up_is_refused_and_records_no_plan(
    host, tmp_path, cli
) -> None:
    line = one_line_error(cli("push", str(built_module(tmp_path / "b", "", extra=ON_NODE_3))))
    assert "no machine is up with the label builder=true" in line
    assert ok_json(cli("--json", "plan"))["plans"] == []


async def test_pushes_of_one_module_register_in_the_order_they_came(
    start_fleet, nats_url, tmp_path, database_url, open_dir, procs, cli
) -> None:
    await start_fleet(hosts=3, builder=True)
    first = built_module(
        tmp_path / "first", _gated_build(open_dir), description="1", extra=ON_NODE_3
    )
    second = built_module(
        tmp_path / "second", _gated_build(open_dir), description="2", extra=ON_NODE_3
    )
    early = _push_in_background(nats_url, first)
    late = None
    try:

        async def running() -> bool:
            return await _build_state(database_url, "built") == "running"

        await await_until(running, within=60, what="the first push's build to run")
        late = _push_in_background(nats_url, second)  # the same build: cached once done
        log = procs.folder / "ctl-a.log"

        async def waiting() -> bool:
            return "a push of built waits for an earlier push of built" in log.read_text()

        await await_until(waiting, within=30, what="the second push to wait for the first")
        (open_dir / "open").touch()
        one, two = _finished(early), _finished(late)
    finally:
        (open_dir / "open").touch()
        for p in (early, late):
            if p is not None and p.poll() is None:
                p.kill()
    assert len(await _query(database_url, "SELECT key FROM builds")) == 1
    assert one["plan"] < two["plan"]
    [module] = ok_json(cli("--json", "modules"))["modules"]
    assert module["version"] == two["version"] != one["version"]


async def test_plan_diff_shows_the_change_and_stores_nothing(
    start_fleet, nc, tmp_path, cli
) -> None:
    await _hello_on_node_2(start_fleet, cli)
    before = await declarations(nc)
    changed = tmp_path / "hello"
    shutil.copytree(HELLO, changed)
    toml = (changed / "module.toml").read_text()
    (changed / "module.toml").write_text(toml.replace('"--port", "8080"', '"--port", "8090"'))

    human = ok(cli("plan", "diff", str(changed)))
    assert "node-2" in human
    assert "~ process hello" in human
    assert '"8080"' in human and '"8090"' in human
    as_json = ok_json(cli("--json", "plan", "diff", str(changed)))
    [machine] = as_json["machines"]
    assert machine["machine"] == "node-2"
    assert {(c["op"], c["kind"], c["name"]) for c in machine["changes"]} >= {
        ("~", "process", "hello")
    }
    assert await declarations(nc) == before
    modules = ok_json(cli("--json", "modules"))["modules"]
    assert modules[0]["version"] == before["node-2"]["declaration"]["modules"]["hello"]


async def test_secrets_never_appear_in_answers_logs_or_declarations(
    start_fleet, nc, procs, cli
) -> None:
    await _hello_on_node_2(start_fleet, cli)
    ok(cli("secret", "set", "hello-token", "--wait", stdin=HELLO_TOKEN + "-2"))  # v2
    seen = [
        ok(cli(*args))
        for args in (("status",), ("--json", "status"), ("nodes",), ("--json", "nodes"),
                     ("declaration", "node-2"), ("--json", "modules"),
                     ("plan", "diff", str(HELLO)), ("--json", "plan", "diff", str(HELLO)))
    ]  # fmt: skip
    seen.append(json.dumps(await declarations(nc)))
    seen += [p.log_path.read_text() for p in procs.started if hasattr(p, "log_path")]
    for text in seen:
        assert HELLO_TOKEN not in text
    token = (await declarations(nc))["node-2"]["declaration"]["processes"]["hello"]["files"][
        "token"
    ]
    assert token == {"mode": "0400", "secret": "hello-token", "secret_version": 2, "text": None}
