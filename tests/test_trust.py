"""Trust (issue 28), tried as an attacker would, with real credentials on a real nats-server,
a real controller and PostgreSQL: a change is recorded with the operator the mesh verified (the
subject the server let it publish on), never the name a client writes in its body; a deployer
changes only the modules its glob matches; a removed operator is cut off at once; `mesh audit`
shows who did what, refusals too."""

import os
import re
import signal
import subprocess
from pathlib import Path

import anyio
import pytest
from faults import query
from helpers import ask, await_until, ok, ok_json, one_line_error, standing_by
from module_folders import HELLO, write_module
from secured import Secured

from mesh import bus
from mesh.auth import creds as credentials
from mesh.auth import registry, tls
from mesh.auth.policy import AGENT_VERBS, DEPLOYER_VERBS, READ_VERBS
from mesh.meshdir import MeshDir
from services.controller.serving.verbs import TABLE
from services.controller.trust.operators import subject_of


def _web(folder: Path, name: str) -> Path:
    return write_module(
        folder / name,
        f'[module]\nname = "{name}"\n[bundle.site]\nkind = "files"\nsource = "src"\n',
        files={"src/index.html": f"{name}\n"},
    )


def _add(secured: Secured, name: str, *args: str) -> dict:
    return ok_json(secured.cli(None, "operator", "add", name, *args,
                               "--dir", str(secured.dir.root), "--json"))  # fmt: skip


def _audit(secured: Secured, *args: str) -> list[dict]:
    return ok_json(secured.cli(secured.viewer, "audit", "--json", *args))["entries"]


async def test_a_deployer_changes_only_its_modules_as_itself(
    secured_fleet, secured: Secured, as_identity, tmp_path: Path
):
    added = _add(secured, "dora", "--role", "deployer", "--modules", "web-*")
    assert added["name"] == "dora" and added["role"] == "deployer"
    dora = added["creds"]
    assert credentials.read(dora).operator == "dora"

    # Its own modules: pushed and assigned, recorded as dora.
    ok(secured.cli(dora, "push", str(_web(tmp_path, "web-a")), "--timeout", "60"))
    assigned = ok_json(secured.cli(dora, "--json", "assign", "web-a", "node-2", "--timeout", "60"))
    assert assigned["plan"] is not None
    plan = ok_json(secured.cli(secured.viewer, "--json", "plan"))["plans"][0]
    assert plan["id"] == assigned["plan"] and plan["by"] == "dora", plan

    # Another module: refused by the controller, naming it; nothing pushed.
    line = one_line_error(secured.cli(dora, "push", str(HELLO), "--timeout", "60"))
    assert "forbidden" in line and "module hello" in line and "web-*" in line
    line = one_line_error(secured.cli(dora, "assign", "hello", "node-2"))
    assert "forbidden" in line and "module hello" in line
    modules = ok_json(secured.cli(secured.viewer, "--json", "modules"))["modules"]
    assert "hello" not in {m["name"] for m in modules}

    # The raw bus, with dora's real credentials: another operator's subject, a verb a deployer
    # may not ask, and the old unverified subject are refused by the server itself.
    raw = await as_identity(dora)
    for subject in ("mesh.op.admin.push", "mesh.op.admin.assign", "mesh.op.dora.tier",
                    "mesh.op.dora.secret-rotate-key", "mesh.op.dora.operator-add", "mesh.ctl.push",
                    "mesh.ctl.assign"):  # fmt: skip
        assert await raw.publish_refused(subject), subject
    assert not await raw.publish_refused("mesh.op.dora.assign")  # the same kind, allowed

    # Another name in the body is ignored: the change is dora's.
    claim = {"module": "web-a", "machines": ["node-2"], "by": "admin"}
    reply = await ask(raw.nc, "mesh.op.dora.unassign", claim, timeout=30)
    assert reply is not None and "error" not in reply, reply
    recent = ok_json(secured.cli(secured.viewer, "--json", "plan"))["plans"][0]
    assert recent["id"] == reply["plan"] and recent["by"] == "dora", recent

    # The audit log: who did what, as verified; the refusal too; --who narrows it.
    entries = _audit(secured, "--who", "dora")
    assert {e["who"] for e in entries} == {"dora"}
    said = [(e["verb"], e["subject"], e["outcome"]) for e in reversed(entries)]
    assert said[:2] == [("push", "web-a", "ok"), ("assign", "web-a", "ok")], said
    assert ("push", "hello", "forbidden") in said and ("unassign", "web-a", "ok") in said
    everyone = _audit(secured)
    assert ("admin", "operator-add", "dora", "ok") in {
        (e["who"], e["verb"], e["subject"], e["outcome"]) for e in everyone
    }
    table = ok(secured.cli(secured.viewer, "audit", "--who", "dora"))
    assert "forbidden" in table and "web-a" in table


async def test_a_deployer_sets_and_deletes_only_its_own_modules_secrets(
    secured_fleet, secured: Secured, tmp_path: Path
):
    dora = _add(secured, "dora", "--role", "deployer", "--modules", "web-*")["creds"]
    admin = secured.admin

    def secret(creds: str, *args: str, value: str = "v") -> subprocess.CompletedProcess:
        return secured.cli(creds, "secret", *args, "--timeout", "60", stdin=value)

    # A new one: for its own modules, unless it names fewer.
    ok(secret(dora, "set", "web-token"))
    ok(secret(dora, "set", "web-a-key", "--modules", "web-a"))
    listed = {s["name"]: s for s in ok_json(secured.cli(secured.viewer, "secret", "list",
                                                        "--json"))["secrets"]}  # fmt: skip
    assert (listed["web-token"]["by"], listed["web-token"]["allowed"]) == ("dora", "web-*")
    assert listed["web-a-key"]["allowed"] == "web-a"
    pushed = write_module(
        tmp_path / "web-b",
        '[module]\nname = "web-b"\n[bundle.site]\nkind = "files"\nsource = "src"\n'
        '[account.web-b]\n[process.web-b]\nbundle = "site"\ncommand = ["sleep", "3600"]\n'
        'account = "web-b"\nfiles = { "t" = { secret = "web-token" } }\n',
        files={"src/x": "x"},
    )
    ok(secured.cli(dora, "push", str(pushed), "--timeout", "60"))

    # Beyond its modules: refused by the controller, naming why; nothing changed.
    for args, why in (
        (("set", "web-token", "--modules", "*"), "modules: '*' reaches beyond operator dora's"),
        (("set", "web-x", "--modules", "hello"), "modules: 'hello' reaches beyond"),
        (("set", "mesh-database-url"), "secret mesh-database-url is the controller's"),
    ):  # fmt: skip
        line = one_line_error(secret(dora, *args))
        assert "forbidden" in line and why in line, line
    ok(secret(admin, "set", "admins-token"))
    for args in (("set", "admins-token"), ("delete", "admins-token")):
        line = one_line_error(secret(dora, *args))
        assert "forbidden: secret admins-token is admin's" in line, line
    line = one_line_error(secret(dora, "delete", "web-token"))  # web-b names it
    assert "secret web-token is named by module(s) web-b" in line, line
    ok(secret(dora, "delete", "web-a-key"))
    # A viewer may list them, never set one: the server refuses its publish.
    refused = secret(secured.viewer, "set", "web-token")
    assert refused.returncode == 1 and "forbidden" in refused.stderr, refused.stderr
    said = {(e["verb"], e["subject"], e["outcome"]) for e in _audit(secured, "--who", "dora")}
    assert {("secret-set", "web-token", "ok"), ("secret-delete", "web-a-key", "ok"),
            ("secret-set", "admins-token", "forbidden")} <= said, said  # fmt: skip


async def test_an_agent_proposes_and_a_person_approves(
    secured_fleet, secured: Secured, as_identity, tmp_path: Path
):
    added = _add(secured, "ada", "--role", "agent", "--modules", "web-*")
    assert (added["role"], added["modules"]) == ("agent", "web-*")
    ada = added["creds"]

    # Whatever it asks, its change is held: nothing runs until a person approves.
    pushed = ok_json(secured.cli(ada, "--json", "push", str(_web(tmp_path, "web-a")),
                                 "--timeout", "60"))  # fmt: skip
    assert pushed["state"] == "held", pushed
    line = one_line_error(secured.cli(ada, "plan", "approve", str(pushed["plan"])))
    assert "forbidden" in line, line  # the server refuses its publish: it may not steer
    ok(secured.cli(secured.admin, "plan", "approve", str(pushed["plan"]), "--timeout", "60"))
    assigned = ok_json(secured.cli(ada, "--json", "assign", "web-a", "node-2", "--timeout", "60"))
    assert assigned["state"] == "held", assigned
    ok(secured.cli(secured.admin, "plan", "approve", str(assigned["plan"]), "--wait",
                   "--timeout", "60"))  # fmt: skip
    plan = ok_json(secured.cli(secured.viewer, "--json", "plan", str(assigned["plan"])))
    assert (plan["state"], plan["by"]) == ("done", "ada"), plan

    # Beyond its glob, and what only people do: refused, by the controller or the server.
    line = one_line_error(secured.cli(ada, "push", str(HELLO), "--timeout", "60"))
    assert "forbidden" in line and "module hello" in line, line
    raw = await as_identity(ada)
    for subject in ("mesh.op.ada.plan-approve", "mesh.op.ada.plan-cancel", "mesh.op.ada.rollback",
                    "mesh.op.ada.secret-set", "mesh.op.ada.drain", "mesh.op.ada.operator-add",
                    "mesh.op.ada.plan-reject", "mesh.op.ada.policy-set",
                    "mesh.ctl.push"):  # fmt: skip
        assert await raw.publish_refused(subject), subject
    assert not await raw.publish_refused("mesh.op.ada.unassign")

    # The audit log: the agent as the one who asked, the person as the one who approved.
    said = [(e["who"], e["verb"], e["subject"]) for e in reversed(_audit(secured))]
    asked = said.index(("ada", "push", "web-a"))
    assert ("admin", "plan-approve", f"plan {pushed['plan']}") in said[asked:], said


async def test_two_persons_approve_a_held_plan_and_a_rejected_one_changes_nothing(
    secured_fleet, secured: Secured, tmp_path: Path
):
    """`mesh policy set approvals 2`: a held plan runs only after two distinct operators, never
    its author, approve what it does now; an approval given before the catalog moved under it
    is void; `plan reject` ends a held plan with no machine touched. Every step audited."""
    admin, viewer = secured.admin, secured.viewer
    ann = _add(secured, "ann", "--role", "admin")["creds"]
    bea = _add(secured, "bea", "--role", "admin")["creds"]
    assert ok_json(secured.cli(viewer, "--json", "policy"))["approvals"] == 1  # the default
    assert "forbidden" in one_line_error(secured.cli(viewer, "policy", "set", "approvals", "2"))
    bad = secured.cli(admin, "policy", "set", "approvals", "12")  # refused as it is parsed
    assert bad.returncode == 2 and "is not a number of approvals (1 to 9)" in bad.stderr, bad
    assert "(was 1)" in ok(secured.cli(admin, "policy", "set", "approvals", "2"))
    policy = ok_json(secured.cli(viewer, "--json", "policy"))
    assert (policy["approvals"], policy["set_by"]) == (2, "admin"), policy

    ok(secured.cli(admin, "push", str(_web(tmp_path, "web-a")), "--timeout", "60"))
    held = ok_json(secured.cli(admin, "--json", "assign", "web-a", "node-2", "--hold"))["plan"]
    line = one_line_error(secured.cli(admin, "plan", "approve", str(held)))
    assert "forbidden" in line and "asked by admin" in line, line  # never its author
    said = " ".join(ok(secured.cli(ann, "plan", "approve", str(held), "--wait")).split())
    assert "1 of 2" in said and "stays held" in said, said
    line = one_line_error(secured.cli(ann, "plan", "approve", str(held)))
    assert "ann approved it already" in line, line
    plan = ok_json(secured.cli(viewer, "--json", "plan", str(held)))
    assert plan["state"] == "held" and plan["approvals_needed"] == 2, plan
    assert [(a["by"], a["void"]) for a in plan["approvals"]] == [("ann", False)], plan

    # The catalog moves under it (another module onto node-2, whose declaration it changes
    # too): ann's approval was for what it did before. (A change of web-a itself supersedes it.)
    ok(secured.cli(admin, "push", str(_web(tmp_path, "web-b")), "--timeout", "60"))
    ok(secured.cli(admin, "assign", "web-b", "node-2", "--wait", "--timeout", "60"))
    moved = ok_json(secured.cli(viewer, "--json", "plan", str(held)))  # composed again at once
    assert moved["digest"] != plan["digest"], moved
    assert [(a["by"], a["void"]) for a in moved["approvals"]] == [("ann", True)], moved
    said = " ".join(ok(secured.cli(bea, "plan", "approve", str(held))).split())  # unwrapped
    assert "1 of 2" in said and "1 approval(s) given before are void" in said, said
    plan = ok_json(secured.cli(viewer, "--json", "plan", str(held)))
    assert [(a["by"], a["void"]) for a in plan["approvals"]] == [("ann", True), ("bea", False)]
    assert "void: given for" in " ".join(ok(secured.cli(viewer, "plan", str(held))).split())
    ok(secured.cli(ann, "plan", "approve", str(held), "--wait", "--timeout", "60"))
    plan = ok_json(secured.cli(viewer, "--json", "plan", str(held)))
    assert (plan["state"], plan["by"]) == ("done", "admin"), plan

    # A reject: the plan ends `rejected`, node-1 never hears of web-a.
    before = _applied(secured, "node-1")
    other = ok_json(secured.cli(admin, "--json", "assign", "web-a", "node-1", "--hold"))["plan"]
    said = " ".join(ok(secured.cli(bea, "plan", "reject", str(other), "--reason",
                                   "not on node-1")).split())  # fmt: skip
    assert f"plan {other} rejected by bea: not on node-1: no machine changed" in said, said
    plan = ok_json(secured.cli(viewer, "--json", "plan", str(other)))
    assert plan["state"] == "rejected" and "not on node-1" in plan["cancelled"], plan
    assert [s["state"] for s in plan["steps"]] == ["pending"]
    assert _applied(secured, "node-1") == before
    for plan_id in (other, held):  # ended, and started: neither is rejected
        line = one_line_error(secured.cli(bea, "plan", "reject", str(plan_id)))
        assert "nothing to reject" in line, line
    line = one_line_error(secured.cli(bea, "plan", "approve", str(other)))
    assert "rejected: nothing to approve" in line, line

    entries = {(e["who"], e["verb"], e["subject"], e["outcome"]) for e in _audit(secured)}
    for wanted in [("admin", "policy-set", "approvals", "ok"),
                   ("admin", "plan-approve", f"plan {held}", "forbidden"),
                   ("ann", "plan-approve", f"plan {held}", "ok"),
                   ("bea", "plan-approve", f"plan {held}", "ok"),
                   ("bea", "plan-reject", f"plan {other}", "ok")]:  # fmt: skip
        assert wanted in entries, (wanted, entries)


def _applied(secured: Secured, machine: str) -> str | None:
    nodes = ok_json(secured.cli(secured.viewer, "--json", "nodes"))["nodes"]
    return next(n["digest_applied"] for n in nodes if n["name"] == machine)


async def test_a_removed_operator_is_cut_off_at_once(secured_fleet, secured: Secured, tmp_path):
    olga = _add(secured, "olga", "--role", "admin")["creds"]
    kept = tmp_path / "olga-kept.creds"
    kept.write_text(Path(olga).read_text())
    nc = await bus.connect(secured.url, name="olga", creds=olga, reconnect=False)
    try:
        assert (await ask(nc, "mesh.ctl.status")) is not None
        ok(secured.cli(olga, "tier", "node-2", "2"))

        removed = ok_json(secured.cli(None, "operator", "remove", "olga",
                                      "--dir", str(secured.dir.root), "--json"))  # fmt: skip
        assert removed["reloaded"] and not Path(olga).exists()

        async def closed() -> bool:
            return nc.is_closed or not nc.is_connected

        await await_until(closed, within=15, what="the removed operator's connection closed")
    finally:
        await nc.close()
    with pytest.raises(bus.Unauthorized):
        await secured.connect(str(kept))
    line = one_line_error(secured.cli(str(kept), "tier", "node-2", "1"))
    assert "refused the credentials" in line
    names = {o["name"] for o in ok_json(secured.cli(secured.viewer, "--json", "operator", "list"))[
        "operators"]}  # fmt: skip
    assert "olga" not in names and {"admin", "viewer", "tools"} <= names
    said = {(e["who"], e["verb"], e["subject"], e["outcome"]) for e in _audit(secured)}
    assert ("olga", "tier", "node-2", "ok") in said
    assert ("admin", "operator-remove", "olga", "ok") in said


async def test_every_change_verb_is_audited_with_its_operator(secured_fleet, secured: Secured):
    admin = secured.admin
    ok(secured.cli(admin, "secret", "set", "hello-token", stdin="s3cr3t"))
    ok(secured.cli(admin, "push", str(HELLO), "--timeout", "120"))
    held = ok_json(secured.cli(admin, "--json", "assign", "hello", "node-1", "--hold"))["plan"]
    ok(secured.cli(admin, "plan", "cancel", str(held)))
    one_line_error(secured.cli(admin, "plan", "pause", str(held)))  # refused: it has ended
    one_line_error(secured.cli(admin, "plan", "resume", str(held)))
    again = ok_json(secured.cli(admin, "--json", "unassign", "hello", "node-1", "--hold"))["plan"]
    line = one_line_error(secured.cli(admin, "plan", "approve", str(again)))  # its own: refused
    assert "forbidden" in line and "never approves its own plan" in line, line
    ok(secured.cli(_add(secured, "ann", "--role", "admin")["creds"], "plan", "approve", str(again)))
    ok(secured.cli(admin, "label", "node-2", "zone=a"))
    ok(secured.cli(admin, "tier", "node-2", "2"))
    ok(secured.cli(admin, "drain", "node-2"))
    ok(secured.cli(admin, "undrain", "node-2"))
    one_line_error(secured.cli(admin, "rollback", "hello"))  # one version: nothing to go back to
    one_line_error(secured.cli(admin, "handover"))  # no standby: refused, and recorded

    entries = _audit(secured, "--limit", "200")
    said = {(e["verb"], e["subject"]) for e in entries if e["who"] == "admin"}
    for wanted in [("secret-set", "hello-token"), ("push", "hello"), ("assign", "hello"),
                   ("plan-cancel", f"plan {held}"), ("plan-pause", f"plan {held}"),
                   ("plan-resume", f"plan {held}"), ("unassign", "hello"),
                   ("plan-approve", f"plan {again}"), ("label", "node-2"), ("tier", "node-2"),
                   ("drain", "node-2"), ("undrain", "node-2"), ("rollback", "hello"),
                   ("handover", "")]:  # fmt: skip
        assert wanted in said, (wanted, said)
    outcome = {(e["verb"], e["subject"]): e["outcome"] for e in entries}
    assert outcome[("plan-pause", f"plan {held}")] == "conflict"
    assert outcome[("handover", "")] == "no_standby"
    assert not [e for e in entries if "s3cr3t" in str(e)]  # a secret set names the secret alone
    # Pages: the newest first, each entry once, however small the pages.
    assert [e["id"] for e in _audit(secured, "--limit", "3")] == [e["id"] for e in entries[:3]]


async def test_a_holder_killed_amid_changes_loses_no_audit_entry(
    nc, database_url, start_controller, start_fleet
):
    """Labels set one after another while the holder is SIGKILLed three times: every label
    change the store holds (its event, written in the same transaction) has its audit entry,
    and every entry its change. On this bus without authentication, `who` is `anonymous`."""
    controllers = (await start_fleet(hosts=1, controllers=("ctl-1", "ctl-2"))).controllers
    sent = 0

    async def changing(stop: anyio.Event) -> None:
        nonlocal sent
        while not stop.is_set():
            sent += 1
            await ask(nc, "mesh.ctl.label", {"machine": "node-1", "set": {"seq": str(sent)}},
                      timeout=0.5)  # fmt: skip

    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(changing, stop)
        for kill in range(3):
            newest = f"ctl-{kill + 2}"
            s = await await_until(lambda n=newest: standing_by(nc, n), within=30,
                                  what=f"{newest} standing by")  # fmt: skip
            await anyio.sleep(0.3)  # ok: changes keep coming to this holder meanwhile
            os.kill(s["seat"]["pid"], signal.SIGKILL)
            assert controllers[s["seat"]["holder"]].wait(timeout=10) == -signal.SIGKILL
            controllers[f"ctl-{kill + 3}"] = start_controller(f"ctl-{kill + 3}")
        await await_until(lambda: standing_by(nc, "ctl-5"), within=30, what="ctl-5 standing by")
        stop.set()

    made = {r["seq"] for r in await query(database_url,
            "SELECT detail->'labels'->>'seq' AS seq FROM events WHERE kind = 'machine.labels'"
            " AND detail->'labels' ? 'seq'")}  # fmt: skip
    entries = await query(database_url, "SELECT who, detail FROM audit WHERE verb = 'label'"
                                        " AND outcome = 'ok' AND subject = 'node-1'")  # fmt: skip
    # "labels seq=12 (were seq=11)": the first is the change's
    audited = {m.group(1) for e in entries if (m := re.search(r"seq=(\d+)", e["detail"]))}
    assert len(made) > 10 and sent > len(made) // 2, (len(made), sent)
    assert made == audited, (sorted(made - audited), sorted(audited - made))
    assert {e["who"] for e in entries} == {"anonymous"}


def test_the_verb_tables_roles_are_the_bus_permissions() -> None:
    """Who may ask a verb is said twice: the controller's table (what it checks and audits) and
    the NATS permissions each operator's credentials carry (mesh/auth/policy.py). They agree:
    a verb the bus lets a viewer ask is a read, a deployer's a deployer's change, and the rest
    are an admin's."""
    roles = {name: served.role for name, served in TABLE.items()}
    assert {n for n, r in roles.items() if r == "reader"} == READ_VERBS
    assert {n for n, r in roles.items() if r == "deployer"} == set(DEPLOYER_VERBS)
    assert set(AGENT_VERBS) <= set(DEPLOYER_VERBS)  # what an agent proposes, a deployer may ask
    # every method is a part's, found by its class when the verb is served; a read, or a change
    # the audit keeps nothing of, is given no Audit to write
    assert all(isinstance(served.owner, type) for served in TABLE.values())
    given = {n for n, s in TABLE.items() if s.takes_audit}
    assert not given & {n for n, s in TABLE.items() if s.role == "reader" or not s.audited}
    assert given >= {"push", "assign", "plan-approve", "drain", "tier", "token-create"}


def test_what_a_change_is_about_comes_from_its_request() -> None:
    class Push:
        manifest = '[module]\nname = "web-a"\n'

    class Steer:
        id = 7

    assert subject_of("push", Push()) == "web-a"
    assert subject_of("plan-pause", Steer()) == "plan 7"


def test_an_operators_file_names_it_and_an_older_file_is_given_the_line(tmp_path: Path) -> None:
    folder = MeshDir(tmp_path / "mesh")
    with registry.locked(folder) as users:
        path = users.ensure("operator", "admin", role="admin")
        users.save()
    held = credentials.read(path)
    assert held.operator == "admin"
    path.write_text(path.read_text().replace("# mesh-operator: admin\n", ""))  # issued before
    assert credentials.read(path).operator is None
    with registry.locked(folder) as users:  # what `mesh dev up` and `mesh init` do at start
        users.ensure("operator", "admin", role="admin")
        users.save()
    again = credentials.read(path)
    assert again.operator == "admin" and again.seed == held.seed  # the same key


async def test_folder_changes_are_audited_as_the_operator_the_server_verified(
    secured_fleet, secured: Secured, as_identity
):
    """`mesh machine add/remove` and `mesh cert rotate` act on the mesh's folder, not through a
    controller; each then tells the controller on the operator's own subject, so its entry
    names the operator whose credentials nats-server authenticated."""
    folder = str(secured.dir.root)
    added = ok_json(secured.cli(None, "machine", "add", "node-7", "--dir", folder, "--json"))
    assert added["audited"] and Path(added["creds"]).exists()
    # Another admin, with credentials of its own: the entries are its.
    olga = _add(secured, "olga", "--role", "admin")["creds"]
    removed = ok_json(secured.cli(olga, "machine", "remove", "node-7", "--dir", folder, "--json"))
    assert removed["audited"] and not Path(added["creds"]).exists()
    tls.ensure_ca(secured.dir.tls)
    tls.issue_server(secured.dir.tls, secured.dir.server_cert("n1"),
                     secured.dir.server_key("n1"), name="n1", hosts=["127.0.0.1"])  # fmt: skip
    ok(secured.cli(olga, "cert", "rotate", "--dir", folder))
    said = {(e["who"], e["verb"], e["subject"], e["outcome"]) for e in _audit(secured)}
    assert {("admin", "machine-add", "node-7", "ok"), ("olga", "machine-remove", "node-7", "ok"),
            ("olga", "cert-rotate", "n1", "ok")} <= said, said  # fmt: skip

    # olga's real credentials on the raw bus: admin's subject is refused by the server, and a
    # name in the body is refused by the controller (no such field): nothing recorded.
    raw = await as_identity(olga)
    assert await raw.publish_refused("mesh.op.admin.folder-change")
    forged = {"change": "machine-add", "subject": "node-8", "who": "admin"}
    reply = await ask(raw.nc, "mesh.op.olga.folder-change", forged, timeout=30)
    assert reply is not None and reply["error"]["code"] == "bad_request", reply
    assert not [e for e in _audit(secured) if e["subject"] == "node-8"]
    # A viewer may not record one: the server refuses its publish; the command says the
    # change is done but not in the audit log.
    done = secured.cli(secured.viewer, "machine", "add", "node-8", "--dir", folder, "--json")
    assert done.returncode == 0 and "not in the audit log" in done.stderr, done.stderr
    assert not ok_json(done)["audited"]
