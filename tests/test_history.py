"""A module's history and going back (docs/operations.md, Steering a change): `mesh history`
after pushes that ended done and reverted, `mesh rollback` restoring an earlier version's
processes (read from their own environment), by default to the version before the current one
that ran, by number or by digest; refusals in one line that list the versions there are; the
holder keeping only the newest versions' bundles (`--versions-kept`), never one a machine's
declaration still names, and a pruned version brought back by pushing its folder again.

Real controllers, hosts, NATS and PostgreSQL, the command line as a user runs it. Each version
of the module here carries its name in its process's environment (module_folders.versioned_module).
"""

import json

import httpx
import pytest
from faults import query
from helpers import MESH, ask, await_until, ok, ok_json, one_line_error, running, when
from module_folders import versioned_module
from prometheus_client.parser import text_string_to_metric_families

from mesh import blobs
from mesh.config import ConfigError, versions_kept
from mesh.embedded import ports


async def versions_running(nc) -> dict[str, str | None]:
    """machine -> the version its `versioned` process runs, from the process's environment."""
    return {m: v for m, (_, v) in (await running(nc, "versioned", "MODULE_VERSION")).items()}


async def all_run(nc, version: str, machines: int) -> dict[str, str | None]:
    async def there():
        found = await versions_running(nc)
        return found if list(found.values()) == [version] * machines else None

    return await await_until(there, within=30, what=f"every machine running {version}")


def history(cli) -> list[tuple]:
    """(number, current, plan, state, kept) of each version, newest first."""
    versions = ok_json(cli("history", "versioned", "--json"))["versions"]
    return [(v["version"], v["current"], v["plan"], v["state"], v["kept"]) for v in versions]


async def test_history_shows_each_push_its_plan_and_how_it_ended_and_rollback_goes_back(
    start_fleet, nc, cli, tmp_path
) -> None:
    await start_fleet(hosts=3)
    v1 = ok_json(cli("push", str(versioned_module(tmp_path / "1", version="v1")), "--wait",
                     "--json"))  # fmt: skip
    assert v1["outcome"]["state"] == "done"
    # Version 2 is never healthy on node-2 (tier 1): its plan is reverted.
    (tmp_path / "hosts" / "node-2" / "broken").write_text("")
    v2_folder = versioned_module(
        tmp_path / "2", version="v2", mode="fails-if", marker="broken", deadline="4s"
    )
    failed = cli("push", str(v2_folder), "--wait", "--json")
    assert failed.returncode == 1, failed.stderr
    v2 = json.loads(failed.stdout)
    assert v2["outcome"]["state"] == "reverted"
    v3 = ok_json(cli("push", str(versioned_module(tmp_path / "3", version="v3")), "--wait",
                     "--json"))  # fmt: skip
    await all_run(nc, "v3", 3)

    h = ok_json(cli("history", "versioned", "--json"))
    assert h["module"] == "versioned" and h["total"] == 3
    assert [(v["version"], v["digest"], v["plan"], v["state"], v["current"])
            for v in h["versions"]] == [
        (3, v3["version"], v3["plan"], "done", True),
        (2, v2["version"], v2["plan"], "reverted", False),
        (1, v1["version"], v1["plan"], "done", False),
    ]  # fmt: skip
    # A bus without authentication verifies nobody: the client's word is not taken.
    assert {v["by"] for v in h["versions"]} == {"anonymous"}
    pushed = [when(v["pushed"]) for v in h["versions"]]
    assert pushed == sorted(pushed, reverse=True)
    table = ok(cli("history", "versioned"))
    assert "3 (current)" in table and "reverted" in table and v2["version"][:19] in table

    # A page at a time, as every list verb: the cursor goes on where the page ended.
    page = await ask(nc, "mesh.ctl.history", {"module": "versioned", "limit": 2})
    assert [v["version"] for v in page["versions"]] == [3, 2] and page["total"] == 3
    rest = await ask(nc, "mesh.ctl.history",
                     {"module": "versioned", "limit": 2, "after": page["next"]})  # fmt: skip
    assert [v["version"] for v in rest["versions"]] == [1] and rest["next"] is None
    shown = ok(cli("history", "versioned", "--limit", "1"))
    assert "3 (current)" in shown and "2 more versions" in shown

    # Back to the version before the current one that ran: 1 (2 never did).
    back = ok_json(cli("rollback", "versioned", "--wait", "--json"))
    assert back["version"] == v1["version"] and "back from version 3" in back["message"]
    plan = back["outcome"]
    assert plan["state"] == "done" and plan["trigger"] == "rollback"
    assert [s["state"] for s in plan["steps"]] == ["done", "done", "done"]
    assert not plan["builds"]  # nothing built, nothing packed: the version's bundles were kept
    await all_run(nc, "v1", 3)
    assert ok_json(cli("modules", "--json"))["modules"][0]["version"] == v1["version"]

    # Forward again by a prefix of the digest, as `history` shows it.
    again = ok_json(cli("rollback", "versioned", "--to", v3["version"][:19], "--wait", "--json"))
    assert again["outcome"]["state"] == "done"
    await all_run(nc, "v3", 3)
    assert history(cli) == [
        (3, True, again["plan"], "done", True),
        (2, False, v2["plan"], "reverted", True),
        (1, False, back["plan"], "done", True),
    ]


async def test_rollback_refusals_name_what_was_asked_and_list_the_versions(
    start_fleet, nc, cli, tmp_path
) -> None:
    await start_fleet(hosts=1)
    # The bad words of a request itself: named by the field, as every verb's. Asked first: the
    # command line's calls below block this test's loop, and a loaded machine may let the
    # server drop the test's own connection meanwhile.
    bad = await ask(nc, "mesh.ctl.rollback", {"module": "versioned", "to": "1; rm"}, timeout=10)
    assert bad["error"]["code"] == "bad_request" and "`$.to`" in bad["error"]["message"]
    never = one_line_error(cli("history", "nothing"))
    assert never == "mesh: error: history: module nothing has never been pushed"
    never = one_line_error(cli("rollback", "nothing"))
    assert never == "mesh: error: rollback: module nothing has never been pushed"
    digests = [
        ok_json(cli("push", str(versioned_module(tmp_path / v, version=v, tiers="[0]")),
                    "--wait", "--json"))["version"]
        for v in ("v1", "v2")
    ]  # fmt: skip
    listed = f"2 ({digests[1][:19]}, current), 1 ({digests[0][:19]})"
    line = one_line_error(cli("rollback", "versioned", "--to", "7"))
    said = "mesh: error: rollback: module versioned has no version 7; its versions: "
    assert line == said + listed
    absent = next(p for p in ("0000", "ffff", "1234") if not any(d[7:].startswith(p)
                                                                 for d in digests))  # fmt: skip
    line = one_line_error(cli("rollback", "versioned", "--to", f"sha256:{absent}"))
    assert f"no version sha256:{absent};" in line and listed in line
    line = one_line_error(cli("rollback", "versioned", "--to", "zz"))
    assert "to: 'zz' is neither a version number nor a digest" in line and listed in line
    # What cannot name any version is refused before it is sent, naming the value.
    usage = cli("rollback", "versioned", "--to", "-1")  # exit 2, as every argument's
    assert usage.returncode == 2 and len(usage.stderr.strip().splitlines()) == 1, usage.stderr
    assert "--to: '-1' is neither a version number nor a digest" in usage.stderr
    line = one_line_error(cli("history", "no such"))
    assert line.startswith("mesh: error: MODULE: 'no such' is not a valid name"), line
    same = ok_json(cli("rollback", "versioned", "--to", "2", "--json"))
    assert same["plan"] is None and "is the current version: no change" in same["message"]
    ok(cli("rollback", "versioned", "--wait"))  # to 1
    first = one_line_error(cli("rollback", "versioned"))
    assert "no version before its current one (1) that ran" in first, first


async def test_a_rollback_supersedes_a_held_or_paused_push_and_each_change_is_an_event(
    start_fleet, nc, cli, tmp_path, database_url
) -> None:
    """A rollback is a newer change of its module: a held push of it is cancelled, naming the
    rollback's plan (history shows the held version, then cancelled); a paused one is taken
    back, its changed machines given their old declarations, and the rollback needs no plan
    of its own when that is already the version asked for."""
    await start_fleet(hosts=2)
    folder = {v: versioned_module(tmp_path / v, version=v, tiers="[0, 1]") for v in ("v1", "v2")}
    for v in ("v1", "v2"):
        ok(cli("push", str(folder[v]), "--wait"))
    v3 = versioned_module(tmp_path / "v3", version="v3", tiers="[0, 1]")
    held = ok_json(cli("push", str(v3), "--hold", "--json"))
    assert held["state"] == "held"
    assert history(cli)[0] == (3, False, held["plan"], "held", True)

    back = ok_json(cli("rollback", "versioned", "--wait", "--json"))
    assert back["outcome"]["state"] == "done"
    assert f"superseded plan {held['plan']}" in back["message"], back["message"]
    cancelled = ok_json(cli("plan", str(held["plan"]), "--json"))
    assert (cancelled["state"], cancelled["cancelled"]) == (
        "cancelled", f"superseded by plan {back['plan']}",
    )  # fmt: skip
    assert [(n, current, state) for n, current, _, state, _ in history(cli)] == [
        (3, False, "cancelled"), (2, False, "done"), (1, True, "done"),
    ]  # fmt: skip
    await all_run(nc, "v1", 2)

    # Version 4 pauses itself after tier 0 (node-1 has it); back to 1, its version before.
    v4 = versioned_module(tmp_path / "v4", version="v4", tiers="[0, 1]")
    manifest = v4 / "module.toml"
    manifest.write_text(
        manifest.read_text().replace("[rollout]\n", "[rollout]\npause_after = [0]\n")
    )
    paused = ok_json(cli("push", str(v4), "--json"))["plan"]

    async def is_paused():
        p = await ask(nc, "mesh.ctl.plan", {"id": paused})
        return p if p and p["state"] == "paused" else None

    await await_until(is_paused, within=60, what=f"plan {paused} paused after tier 0")
    assert (await versions_running(nc))["node-1"] == "v4"
    again = ok_json(cli("rollback", "versioned", "--to", "1", "--json"))
    assert again["plan"] is None, again  # taking version 4 back is the whole rollback
    assert f"is the current version again; superseded plan {paused}" in again["message"]
    followed = cli("plan", str(paused), "--follow", "--json")
    assert followed.returncode == 1, followed.stderr  # it did not end done
    final = json.loads(followed.stdout)
    assert final["state"] == "cancelled" and steps_reverted(final) == ["node-1"]
    await all_run(nc, "v1", 2)
    assert history(cli)[0][:4] == (4, False, paused, "cancelled")

    ok(cli("drain", "node-2"))
    ok(cli("undrain", "node-2"))
    rows = await query(
        database_url,
        "SELECT kind, machine, detail FROM events WHERE kind IN ('module.rollback', "
        "'plan.superseded', 'machine.drained', 'machine.undrained') ORDER BY id",
    )
    said = [(r["kind"], r["machine"], json.loads(r["detail"])) for r in rows]
    assert [(kind, machine) for kind, machine, _ in said] == [
        ("module.rollback", None), ("plan.superseded", None), ("plan.superseded", None),
        ("machine.drained", "node-2"), ("machine.undrained", "node-2"),
    ]  # fmt: skip
    rollback = said[0][2]
    assert (rollback["module"], rollback["to"], rollback["was"], rollback["plan"]) == (
        "versioned", 1, 2, back["plan"],
    )  # fmt: skip
    assert said[1][2]["plan"] == held["plan"] and said[2][2]["plan"] == paused
    assert {d["by"] for kind, _, d in said if kind != "plan.superseded"} == {
        "anonymous"
    }  # no credentials: the bus names no operator


async def scraped(port: int) -> dict[str, float]:
    """The holder's metrics without labels, by sample name."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


def steps_reverted(plan: dict) -> list[str]:
    return [s["machine"] for s in plan["steps"] if s["reverted"]]


async def test_only_the_newest_versions_keep_their_bundles_unless_a_machine_still_runs_one(
    start_controller, start_fleet, nc, cli, tmp_path
) -> None:
    """--versions-kept 1: the current version's bundles stay; an older one's go, except while
    a drained machine still runs it. A version whose bundles are gone comes back by a push."""
    port = ports.free_port()
    kept = ("--versions-kept", "1", "--versions-prune-every", "0.2s", "--metrics", str(port))
    await start_fleet(hosts=2, start_controller=lambda name: start_controller(name, *kept))
    plans = {}
    for v in ("v1", "v2", "v3"):
        if v == "v2":  # node-2 keeps running v1 through the pushes that follow
            ok(cli("drain", "node-2"))
        pushed = ok_json(cli("push", str(versioned_module(tmp_path / v, version=v, tiers="[0, 1]")),
                             "--wait", "--json"))  # fmt: skip
        plans[v] = pushed["outcome"]
    bundle = {v: p["builds"][0]["digest"] for v, p in plans.items()}
    assert len(set(bundle.values())) == 3  # a bundle of its own each
    store = await blobs.store(nc)

    async def pruned(*gone: int):
        h = history(cli)
        return h if [n for n, _, _, _, kept in h if not kept] == list(gone) else None

    # Version 2 goes (past the newest one, run nowhere); version 1 stays: node-2 runs it.
    await await_until(lambda: pruned(2), within=30, what="version 2 pruned")
    assert not await blobs.has(store, bundle["v2"])
    counted = await scraped(port)
    assert counted["mesh_bundles_pruned_total"] >= 2  # its bundle and its source archive
    assert counted["mesh_machines_drained"] == 1
    assert await blobs.has(store, bundle["v1"]) and await blobs.has(store, bundle["v3"])
    line = one_line_error(cli("rollback", "versioned", "--to", "2"))
    assert "version 2: bundle code" in line and "push that version's folder again" in line, line

    # Brought up to date, node-2 names version 1 no more: its bundles go too.
    assert ok_json(cli("undrain", "node-2", "--wait", "--json"))["outcome"]["state"] == "done"
    await await_until(lambda: pruned(2, 1), within=30, what="version 1 pruned")
    assert not await blobs.has(store, bundle["v1"])

    # Version 2's folder pushed again: the same version (its number kept), stored again.
    again = ok_json(cli("push", str(tmp_path / "v2"), "--wait", "--json"))
    assert again["outcome"]["state"] == "done"
    assert await blobs.has(store, bundle["v2"])
    await all_run(nc, "v2", 2)
    # 3 stays too: the newest version by number, whichever is current.
    assert [(n, current, kept) for n, current, _, _, kept in history(cli)] == [
        (3, False, True), (2, True, True), (1, False, False),
    ]  # fmt: skip


def test_how_many_versions_keep_their_bundles_is_configuration(monkeypatch) -> None:
    assert versions_kept() == versions_kept(count="10", every="10m")
    assert versions_kept(count="off").count is None
    monkeypatch.setenv("MESH_VERSIONS_KEPT", "3")
    assert versions_kept().count == 3
    assert versions_kept(count="5").count == 5  # the flag wins
    with pytest.raises(ConfigError, match=r"^MESH_VERSIONS_KEPT: '0' is not a number of versions"):
        monkeypatch.setenv("MESH_VERSIONS_KEPT", "0")
        versions_kept()
    with pytest.raises(ConfigError, match=r"^--versions-prune-every: '5x' is not a duration"):
        versions_kept(count="2", every="5x")


def test_a_bad_setting_stops_the_controller_in_one_line(tmp_path) -> None:
    import subprocess

    done = subprocess.run(
        [*MESH, "controller", "run", "--versions-kept", "ten"], capture_output=True, text=True,
        env={"MESH_DATABASE_URL": "postgresql://nowhere/mesh", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )  # fmt: skip
    assert one_line_error(done) == (
        "mesh: error: --versions-kept: 'ten' is not a number of versions (1 to 1000000, or off)"
    )


async def test_a_note_an_assign_and_what_changed_between_two_versions(
    start_fleet, nc, cli, tmp_path
) -> None:
    """`push --note` is kept with the version and its plan; a version that went live through
    an assign shows that plan; `history --diff A B` says what changed; `modules` numbers the
    version as `history` does."""
    await start_fleet(hosts=2)
    first = versioned_module(tmp_path / "1", version="v1", tiers="[]")  # assigned nowhere
    v1 = ok_json(cli("push", str(first), "--json"))
    assert v1["plan"] is None, v1
    went = ok_json(cli("assign", "versioned", "node-1", "node-2", "--wait", "--json"))
    assert went["outcome"]["state"] == "done"
    v2 = ok_json(cli("push", str(versioned_module(tmp_path / "2", version="v2", tiers="[]")),
                     "--note", "v2: the greeting fixed (#12)", "--wait", "--json"))  # fmt: skip
    assert (
        v2["outcome"]["state"] == "done" and v2["outcome"]["note"] == "v2: the greeting fixed (#12)"
    )
    await all_run(nc, "v2", 2)

    h = ok_json(cli("history", "versioned", "--json"))["versions"]
    assert [(v["version"], v["plan"], v["state"], v["note"]) for v in h] == [
        (2, v2["plan"], "done", "v2: the greeting fixed (#12)"),
        (1, went["plan"], "done", ""),  # it went live through the assign
    ]
    assert "v2: the greeting fixed (#12)" in ok(cli("history", "versioned"))
    assert "note: v2: the greeting fixed (#12)" in ok(cli("plan", str(v2["plan"])))
    modules = ok_json(cli("modules", "--json"))["modules"]
    assert [(m["name"], m["number"]) for m in modules] == [("versioned", 2)]
    assert f"2 ({v2['version'][:19]})" in ok(cli("modules"))

    diff = ok_json(cli("history", "versioned", "--diff", "1", v2["version"][:19], "--json"))
    assert (diff["a"], diff["b"], diff["a_digest"], diff["b_digest"]) == (
        1, 2, v1["version"], v2["version"]
    )  # fmt: skip
    assert '-env = { MODULE_VERSION = "v1" }' in diff["manifest"], diff["manifest"]
    assert '+env = { MODULE_VERSION = "v2" }' in diff["manifest"], diff["manifest"]
    assert [b["bundle"] for b in diff["bundles"]] == ["code"]  # src/VERSION changed
    said = ok(cli("history", "versioned", "--diff", "1", "2"))
    assert "version 1" in said and "version 2" in said and 'MODULE_VERSION = "v2"' in said
    same = ok(cli("history", "versioned", "--diff", "2", "2"))
    assert "the same module.toml and bundles" in same
    line = one_line_error(cli("history", "versioned", "--diff", "1", "7"))
    assert "module versioned has no version 7; its versions: 2 (" in line, line

    # A note is one line, as long as a line may be: refused before anything is sent.
    folder = str(versioned_module(tmp_path / "3", version="v3", tiers="[]"))
    for bad, why in (("two\nlines", "control character"), ("x" * 501, "at most 500")):
        usage = cli("push", folder, "--note", bad)
        assert usage.returncode == 2 and "--note: " in usage.stderr and why in usage.stderr
    refused = await ask(nc, "mesh.ctl.version-diff", {"module": "versioned", "a": "1", "b": "1;"})
    assert refused["error"]["code"] == "bad_request" and "`$.b`" in refused["error"]["message"]
