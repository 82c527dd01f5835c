"""A secret's life as an operator drives it: `secret list` (never a value), a push that names a
secret never set refused at once, naming it, and `secret delete` refused while a module names
the secret; a change of it rolled out as its module's rollout says, and taken back when that
fails. Against a real controller, hosts, NATS and PostgreSQL."""

import json

from helpers import ask, ok, ok_json, one_line_error, wait_until
from module_folders import HELLO, HELLO_TOKEN, write_module

USES = (
    '[module]\nname = "uses"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
    '[process.uses]\nbundle = "code"\ncommand = ["sleep", "3600"]\nroot = true\n'
    'files = {{ "token" = {{ secret = "{secret}" }}, "other" = {{ secret = "{other}" }} }}\n'
)


async def test_a_secret_is_listed_never_shown_required_by_push_and_deleted_once_unused(
    start_fleet, nc, cli, tmp_path
) -> None:
    await start_fleet(hosts=1, builder=True)
    [key] = ok_json(cli("secret", "list", "--json"))["secrets"]  # the key, as a file, only
    assert (key["name"], key["version"], key["allowed"]) == (
        "mesh-secrets-key",
        1,
        "mesh-controller",
    )

    # Named but never set: the push is refused at once, naming the field and every unset one.
    folder = write_module(tmp_path / "uses", USES.format(secret="api-key", other="db-pass"),
                          files={"src/x": "x"})  # fmt: skip
    line = one_line_error(cli("push", str(folder)))
    assert line.startswith("mesh: error: push: process.uses.files.") and ".secret: secret " in line
    assert "api-key is not set: set it first (mesh secret set api-key" in line, line
    assert "nor are db-pass" in line, line
    assert ok_json(cli("modules", "--json"))["modules"] == []  # nothing registered

    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("secret", "set", "hello-token", "--modules", "hel*", stdin=HELLO_TOKEN + "2"))
    ok(cli("secret", "set", "spare", stdin="unused"))
    ok(cli("push", str(HELLO)))

    listed = ok_json(cli("secret", "list", "--json"))
    rows = {s["name"]: s for s in listed["secrets"]}
    assert listed["total"] == len(rows) and {"hello-token", "spare"} <= set(rows)
    hello = rows["hello-token"]
    assert (hello["version"], hello["modules"], hello["allowed"]) == (2, ["hello"], "hel*")
    assert hello["by"] == "anonymous" and hello["at"]
    assert rows["spare"]["modules"] == [] and rows["spare"]["version"] == 1
    shown = ok(cli("secret", "list"))
    assert "hello-token" in shown and "hel*" in shown
    assert HELLO_TOKEN not in shown and HELLO_TOKEN not in str(listed) and "unused" not in shown
    page = await ask(nc, "mesh.ctl.secrets", {"limit": 1}, timeout=30)  # a loaded machine
    rest = await ask(nc, "mesh.ctl.secrets", {"limit": 10, "after": page["next"]}, timeout=30)
    assert [s["name"] for s in page["secrets"] + rest["secrets"]] == sorted(rows)

    # Deleting: refused while a module's current version names it; gone once none does.
    line = one_line_error(cli("secret", "delete", "hello-token"))
    assert line == (
        "mesh: error: secret-delete: secret hello-token is named by module(s) hello: push them "
        "without it first"
    ), line
    assert ok_json(cli("secret", "delete", "spare", "--json"))["name"] == "spare"
    assert "spare" not in {s["name"] for s in ok_json(cli("secret", "list", "--json"))["secrets"]}
    line = one_line_error(cli("secret", "delete", "spare"))
    assert line == "mesh: error: secret-delete: secret spare is not set", line
    line = one_line_error(cli("secret", "delete", "mesh-secrets-key"))
    assert "is the key of the secrets, never stored" in line, line
    entries = ok_json(cli("audit", "--json"))["entries"]
    assert any(e["verb"] == "secret-delete" and e["subject"] == "spare" for e in entries), entries


KEYED = (
    '[module]\nname = "keyed"\n[bundle.code]\nkind = "files"\nsource = "src"\n'
    '[process.keyed]\nbundle = "code"\ncommand = ["sleep", "3600"]\nroot = true\n'
    'files = { "token" = { secret = "api-key" } }\n'
    'check = { exec = ["python3", "check.py"], every = "200ms", timeout = "2s", passes = 1 }\n'
    '[rollout]\ndeadline = "6s"\n[assign]\ntiers = [0, 1]\n'
)
# Healthy unless its secret file says "bad".
CHECK = (
    "import os, sys\n"
    "token = open(os.path.join(os.environ['MESH_FILES'], 'token')).read()\n"
    "sys.exit(1 if token == 'bad' else 0)\n"
)


async def test_a_secret_change_rolls_out_tier_by_tier_and_a_failure_puts_the_old_one_back(
    start_fleet, cli, tmp_path
) -> None:
    await start_fleet(hosts=2)
    ok(cli("secret", "set", "api-key", stdin="good"))
    folder = write_module(tmp_path / "keyed", KEYED, files={"src/check.py": CHECK})
    assert ok_json(cli("push", str(folder), "--wait", "--json"))["outcome"]["state"] == "done"
    roots = tmp_path / "hosts"

    def tokens() -> dict[str, str]:
        return {
            m: (roots / m / "processes" / "keyed" / "files" / "token").read_text()
            for m in ("node-1", "node-2")
        }

    assert tokens() == {"node-1": "good", "node-2": "good"}

    # A value the module cannot use: tier 0 fails its check, the plan reverts, and tier 1
    # never gets it. The version before is current again, and served again.
    bad = cli("secret", "set", "api-key", "--wait", "--json", stdin="bad")
    assert bad.returncode == 1, bad.stderr
    plan = json.loads(bad.stdout)["outcome"]
    assert plan["state"] == "reverted" and plan["trigger"] == "secret", plan
    assert plan["settings"]["deadline"] == 6.0  # the module's own [rollout]
    steps = {s["machine"]: s for s in plan["steps"]}
    assert steps["node-1"]["state"] == "failed" and steps["node-2"]["state"] == "pending", steps
    assert "check" in plan["failure"], plan["failure"]

    def versions() -> dict[str, int]:
        return {
            s["name"]: s["version"] for s in ok_json(cli("secret", "list", "--json"))["secrets"]
        }

    assert versions()["api-key"] == 1
    wait_until(lambda: tokens() == {"node-1": "good", "node-2": "good"}, within=30,
               what="node-1 to have the version before again")  # fmt: skip

    # The next value gets a number of its own (2 was taken back) and goes everywhere.
    better = ok_json(cli("secret", "set", "api-key", "--wait", "--json", stdin="better"))
    assert better["outcome"]["state"] == "done", better
    assert versions()["api-key"] == 3
    assert tokens() == {"node-1": "better", "node-2": "better"}
