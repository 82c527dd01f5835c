"""Modules end to end, as a user drives them with the `mesh` command against a real controller,
real hosts (node-1 the builder), NATS with JetStream and PostgreSQL."""

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from helpers import MESH, ask, await_until, kv_keys, ok, one_line_error

EXAMPLE = Path(__file__).parent.parent / "docs" / "examples" / "hello"
SECRET = "s3cr3t-VALUE-7f1c"


def run(nats_url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MESH, *args, "--nats-url", nats_url, "--timeout", "120"],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=180,
    )


@pytest.fixture
async def fleet(nc, start_controller, start_host):
    start_controller("ctl-a")
    start_host("node-1", "--tier", "0", "--label", "builder=true")
    start_host("node-2", "--tier", "1")
    start_host("node-3", "--tier", "2")

    async def ready():
        s = await ask(nc, "mesh.ctl.status")
        return s if s and s["nodes"]["up"] == 3 else None

    await await_until(ready, within=30, what="three hosts up")


async def declarations(nc) -> dict[str, dict]:
    kv = await nc.jetstream().key_value("mesh-declarations")
    found = {}
    for key in await kv_keys(kv):
        found[key] = json.loads((await kv.get(key)).value)
    return found


async def test_push_and_assign_reach_exactly_the_assigned_machines(fleet, nc, nats_url) -> None:
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    pushed = json.loads(ok(run(nats_url, "push", str(EXAMPLE), "--json")))
    assert pushed["plan"] is None  # assigned to no machine yet: nothing changes
    again = json.loads(ok(run(nats_url, "--json", "push", str(EXAMPLE))))
    assert again["plan"] is None and again["message"] == "no change"

    assigned = json.loads(
        ok(run(nats_url, "--json", "assign", "hello", "node-2", "node-3", "--wait"))
    )
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

    nodes = {n["name"]: n for n in json.loads(ok(run(nats_url, "--json", "nodes")))["nodes"]}
    assert nodes["node-1"]["digest_wanted"] is None
    assert nodes["node-2"]["digest_wanted"] == kv["node-2"]["digest"]
    shown = json.loads(ok(run(nats_url, "--json", "declaration", "node-3")))
    assert shown["digest"] == kv["node-3"]["digest"]

    modules = json.loads(ok(run(nats_url, "--json", "modules")))["modules"]
    assert [(m["name"], m["assigned"], m["processes"]) for m in modules] == [
        ("hello", ["node-2", "node-3"], ["hello"])
    ]

    ok(run(nats_url, "unassign", "hello", "node-3", "--wait"))
    kv = await declarations(nc)
    assert kv["node-3"]["declaration"]["processes"] == {}
    assert "hello" in kv["node-2"]["declaration"]["processes"]


async def test_assign_by_tier_and_label(fleet, nc, nats_url) -> None:
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    ok(run(nats_url, "assign", "hello", "--tier", "2", "--wait"))
    assert set(await declarations(nc)) == {"node-3"}
    ok(run(nats_url, "assign", "hello", "--label", "builder=true", "--wait"))
    assert set(await declarations(nc)) == {"node-1", "node-3"}
    line = one_line_error(run(nats_url, "assign", "hello", "node-9"))
    assert "node-9 is not registered" in line


async def test_a_conflicting_module_is_refused_naming_both(fleet, nc, nats_url, tmp_path) -> None:
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    ok(run(nats_url, "assign", "hello", "node-2", "--wait"))
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
    line = one_line_error(run(nats_url, "push", str(clash)))
    assert "process hello is declared by modules hello and hello-clash" in line
    assert await declarations(nc) == before  # nothing half-applied
    modules = json.loads(ok(run(nats_url, "--json", "modules")))["modules"]
    assert [m["name"] for m in modules] == ["hello"]


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
async def test_bad_manifests_get_one_line_naming_the_field(fleet, nats_url, tmp_path, toml, field):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "module.toml").write_text(toml)
    line = one_line_error(run(nats_url, "push", str(tmp_path / "m")))
    assert f": {field}:" in line


async def test_the_controller_gates_what_it_is_sent(fleet, nc) -> None:
    # A client that skips the local gate meets the same rules at the controller.
    body = {"manifest": '[module]\nname = "m"\ncolour = 1\n', "source": "sha256:" + "0" * 64}
    reply = await ask(nc, "mesh.ctl.push", body)
    assert reply["error"]["code"] == "refused"
    assert "module.colour: unknown field" in reply["error"]["message"]
    assert (await ask(nc, "mesh.ctl.status"))["seat"]["holder"] == "ctl-a"


async def test_the_manifest_must_be_the_one_in_the_source(fleet, nc) -> None:
    from mesh import blobs
    from mesh.modules.load import load

    module = load(EXAMPLE)
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


@pytest.fixture
def gate_dir() -> Iterator[Path]:
    """A folder the builder's account can look into (pytest's own folders are 0700): a build
    script there waits for the test to create `open` in it."""
    folder = Path(tempfile.mkdtemp(prefix="mesh-test-gate-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _gated_build(gate: Path) -> str:
    """A build that runs until the test opens the gate; `sleep` is the script's own polling."""
    return (
        f"set -e\necho waiting for {gate}/open\n"
        f"while [ ! -e {gate}/open ]; do sleep 0.05; done\n"
        "mkdir -p out\nprintf '#!/bin/sh\\necho hi\\n' > out/app\n"
    )


def _built_module(folder: Path, *, script: str, description: str = "") -> Path:
    (folder / "src").mkdir(parents=True, exist_ok=True)
    (folder / "src" / "build.sh").write_text(script)
    (folder / "module.toml").write_text(
        f'[module]\nname = "built"\ndescription = "{description}"\n'
        '[bundle.app]\nkind = "binary"\nsource = "src"\nbuild = ["sh", "build.sh"]\n'
        'output = "out/app"\ntimeout = "60s"\n'
        "[account.app]\n"
        '[process.app]\nbundle = "app"\ncommand = ["./app"]\naccount = "app"\n'
        '[assign]\nmachines = ["node-3"]\n'
    )
    return folder


GOOD_BUILD = "set -e\necho building\nmkdir -p out\nprintf '#!/bin/sh\\necho hi\\n' > out/app\n"


async def _builds(database_url: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT bundle, state, builder FROM builds ORDER BY started")
    finally:
        await conn.close()
    return [(r["bundle"], r["state"], r["builder"]) for r in rows]


async def test_builds_run_on_the_builder_are_cached_and_fail_clearly(
    fleet, nc, nats_url, tmp_path, database_url
) -> None:
    module = _built_module(tmp_path / "built", script=GOOD_BUILD)
    pushed = json.loads(ok(run(nats_url, "--json", "push", str(module))))
    assert pushed["machines"] == ["node-3"]
    assert await _builds(database_url) == [("app", "done", "node-1")]
    decl = (await declarations(nc))["node-3"]["declaration"]
    bundle = decl["processes"]["app"]["bundle"]
    assert bundle.startswith("binary:sha256:")
    digest = decl["bundles"][bundle]["digest"]
    store = await nc.jetstream().object_store("mesh-bundles")
    assert (await store.get(digest.replace(":", "-"))).data  # the built bundle is stored

    # Same source folder and argv: the cached bundle is used, nothing is built again.
    _built_module(module, script=GOOD_BUILD, description="only the manifest changed")
    ok(run(nats_url, "push", str(module)))
    assert len(await _builds(database_url)) == 1

    _built_module(module, script="echo about to fail\necho 'missing thing' >&2\nexit 3\n")
    failed = run(nats_url, "push", str(module))
    assert failed.returncode == 1
    assert "failed: exit code 3" in failed.stderr
    assert "missing thing" in failed.stderr  # the build's last lines
    assert "Traceback" not in failed.stderr
    newest = json.loads(ok(run(nats_url, "--json", "plan")))["plans"][0]
    assert (newest["subject"], newest["state"]) == ("built", "failed")  # its plan says why
    assert "failed: exit code 3" in newest["failure"] and newest["machines"] == 0
    logs = run(nats_url, "build", "logs", "built")
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
    fleet, nc, nats_url, tmp_path, database_url, gate_dir
) -> None:
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    module = _built_module(tmp_path / "built", script=_gated_build(gate_dir))
    push = _push_in_background(nats_url, module)
    try:

        async def running() -> bool:
            return await _build_state(database_url, "built") == "running"

        await await_until(running, within=60, what="the build to run on node-1")
        # While the build runs, other changes are answered (the gate is still closed).
        quick = [*MESH, "--nats-url", nats_url, "--timeout", "10"]
        assigned = subprocess.run(
            [*quick, "--json", "assign", "hello", "node-2"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert json.loads(ok(assigned))["machines"] == ["node-2"]
        secret = subprocess.run(
            [*quick, "secret", "set", "other-secret"],
            input="x", capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        ok(secret)
        assert push.poll() is None and await _build_state(database_url, "built") == "running"
        # The push's plan is recorded as building, with no steps until the build is done.
        [shown] = [p for p in json.loads(ok(run(nats_url, "--json", "plan")))["plans"]
                   if p["subject"] == "built"]  # fmt: skip
        assert (shown["state"], shown["trigger"], shown["machines"]) == ("building", "push", 0)

        (gate_dir / "open").touch()
        pushed = _finished(push)
    finally:
        (gate_dir / "open").touch()
        if push.poll() is None:
            push.kill()
    assert pushed["plan"] == shown["id"] and pushed["machines"] == ["node-3"]
    [build] = await _query(database_url, "SELECT state, digest FROM builds")
    assert build["state"] == "done"
    plan = json.loads(ok(run(nats_url, "--json", "plan", str(pushed["plan"]))))
    assert plan["state"] != "building"
    assert plan["builds"] == [{"bundle": "app", "digest": build["digest"], "built": True}]
    [step] = await _query(
        database_url, "SELECT machine, after_body FROM plan_steps WHERE plan_id = $1", plan["id"]
    )
    decl = json.loads(bytes(step["after_body"]))
    assert step["machine"] == "node-3"
    assert [b["digest"] for b in decl["bundles"].values()] == [build["digest"]]


async def test_a_build_with_no_builder_up_is_refused_and_records_no_plan(
    host, nats_url, tmp_path
) -> None:
    line = one_line_error(run(nats_url, "push", str(_built_module(tmp_path / "b", script=""))))
    assert "no machine is up with the label builder=true" in line
    assert json.loads(ok(run(nats_url, "--json", "plan")))["plans"] == []


async def test_pushes_of_one_module_register_in_the_order_they_came(
    fleet, nats_url, tmp_path, database_url, gate_dir, procs
) -> None:
    first = _built_module(tmp_path / "first", script=_gated_build(gate_dir), description="1")
    second = _built_module(tmp_path / "second", script=_gated_build(gate_dir), description="2")
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
        (gate_dir / "open").touch()
        one, two = _finished(early), _finished(late)
    finally:
        (gate_dir / "open").touch()
        for p in (early, late):
            if p is not None and p.poll() is None:
                p.kill()
    assert len(await _query(database_url, "SELECT key FROM builds")) == 1
    assert one["plan"] < two["plan"]
    [module] = json.loads(ok(run(nats_url, "--json", "modules")))["modules"]
    assert module["version"] == two["version"] != one["version"]


async def test_plan_diff_shows_the_change_and_stores_nothing(fleet, nc, nats_url, tmp_path) -> None:
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    ok(run(nats_url, "assign", "hello", "node-2", "--wait"))
    before = await declarations(nc)
    changed = tmp_path / "hello"
    shutil.copytree(EXAMPLE, changed)
    toml = (changed / "module.toml").read_text()
    (changed / "module.toml").write_text(toml.replace('"--port", "8080"', '"--port", "8090"'))

    human = ok(run(nats_url, "plan", "diff", str(changed)))
    assert "node-2" in human
    assert "~ process hello" in human
    assert '"8080"' in human and '"8090"' in human
    as_json = json.loads(ok(run(nats_url, "--json", "plan", "diff", str(changed))))
    [machine] = as_json["machines"]
    assert machine["machine"] == "node-2"
    assert {(c["op"], c["kind"], c["name"]) for c in machine["changes"]} >= {
        ("~", "process", "hello")
    }
    assert await declarations(nc) == before
    modules = json.loads(ok(run(nats_url, "--json", "modules")))["modules"]
    assert modules[0]["version"] == before["node-2"]["declaration"]["modules"]["hello"]


async def test_secrets_never_appear_in_answers_logs_or_declarations(
    fleet, nc, nats_url, procs
) -> None:
    ok(run(nats_url, "secret", "set", "hello-token", stdin=SECRET))
    ok(run(nats_url, "push", str(EXAMPLE)))
    ok(run(nats_url, "assign", "hello", "node-2", "--wait"))
    ok(run(nats_url, "secret", "set", "hello-token", "--wait", stdin=SECRET + "-2"))  # v2
    seen = [
        ok(run(nats_url, *args))
        for args in (("status",), ("--json", "status"), ("nodes",), ("--json", "nodes"),
                     ("declaration", "node-2"), ("--json", "modules"),
                     ("plan", "diff", str(EXAMPLE)), ("--json", "plan", "diff", str(EXAMPLE)))
    ]  # fmt: skip
    seen.append(json.dumps(await declarations(nc)))
    seen += [p.log_path.read_text() for p in procs.started if hasattr(p, "log_path")]
    for text in seen:
        assert SECRET not in text
    token = (await declarations(nc))["node-2"]["declaration"]["processes"]["hello"]["files"][
        "token"
    ]
    assert token == {"mode": "0400", "secret": "hello-token", "secret_version": 2, "text": None}
