"""A host applies its declaration: accounts (created by exit code, the seed's fault), bundles
(verified, read-only), files (atomic, owned by the account, secrets 0400); what it applied shows
in `mesh nodes`; an older epoch is ignored."""

import json
import os
import pwd
import signal
import stat
import uuid
from pathlib import Path

import pytest
from helpers import MESH, ask, await_until, hosts_up, js, node_named, ok, one_line_error
from module_folders import HELLO, HELLO_TOKEN, write_module

from mesh import osaccounts
from mesh.modules.compose import DAccount
from services.host import accounts

ROOT = os.geteuid() == 0


FAKE_GETENT = Path(__file__).parent / "fakes" / "fake_getent.py"


def _account_module(folder: Path, *, module: str, account: str) -> Path:
    """A module whose one process runs as `account`, with a file and a bundle of its own."""
    return write_module(
        folder,
        f'[module]\nname = "{module}"\n'
        '[bundle.b]\nkind = "files"\nsource = "src"\n'
        f"[account.{account}]\n"
        f'[process.{module}]\nbundle = "b"\ncommand = ["sleep", "600"]\naccount = "{account}"\n'
        f'[process.{module}.files]\n"app.conf" = {{ text = "x\\n" }}\n',
        files={"src/x.txt": "x"},
    )


@pytest.mark.skipif(not ROOT, reason="creating accounts needs root")
async def test_an_absent_account_is_created_not_taken_for_a_failing_user_database(
    nc, nats_url, cli, start_controller, procs, tmp_path
) -> None:
    # The seed: `getent` exit 2 (absent) was read from message text as "the user database did
    # not answer", and the first apply stopped. Exit codes decide here.
    name = f"mesh-t-{uuid.uuid4().hex[:8]}"
    assert osaccounts.exists(name) is False
    identity = accounts.ensure(name, DAccount(home=None, groups=[], shell="/usr/sbin/nologin"))
    assert osaccounts.exists(name) is True
    assert pwd.getpwnam(name).pw_uid == identity.uid
    again = accounts.ensure(name, DAccount(home=None, groups=[], shell="/usr/sbin/nologin"))
    assert again.uid == identity.uid  # idempotent

    # And the other way round: a user database that fails (getent exits 1, or crashes) is not
    # taken for an absent account. The apply stops at that account, and nothing is half-made.
    # A failing database cannot be had for real here: a fake getent comes first on the host's
    # PATH, failing for these two names only.
    failing = {f"mesh-t-{uuid.uuid4().hex[:8]}": how for how in ("1", "crash")}
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    (fake_bin / "getent").symlink_to(FAKE_GETENT)
    start_controller("ctl-a")
    procs.start(
        "node-1",
        [*MESH, "host", "run", "--name", "node-1", "--tier", "0",
         "--root", str(tmp_path / "hosts" / "node-1")],
        env={"MESH_NATS_URL": nats_url, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
             "FAKE_GETENT_FAIL": ",".join(f"{n}={how}" for n, how in failing.items())},
    )  # fmt: skip

    await hosts_up(nc, 1)
    root = tmp_path / "hosts" / "node-1"
    for i, (account, how) in enumerate(failing.items()):
        module = f"db-fails-{i}"
        ok(cli("push", str(_account_module(tmp_path / module, module=module, account=account))))
        failed = cli("assign", module, "node-1", "--wait")
        assert failed.returncode == 1, failed.stdout
        code = -signal.SIGSEGV if how == "crash" else int(how)
        assert (f"machine node-1: account {account}: getent passwd {account} failed with exit "
                f"code {code}") in failed.stderr, failed.stderr  # fmt: skip
        with pytest.raises(KeyError):
            pwd.getpwnam(account)  # not created: useradd never ran
        assert not (root / "processes" / module).exists()  # no files, no output
        assert not (root / "bundles").exists() or not any((root / "bundles").iterdir())
        status = await ask(nc, "mesh.host.node-1.status")
        assert status["processes"] == [], status["processes"]  # nothing started


async def test_the_example_is_applied_on_the_assigned_machine(start_fleet, nc, cli, tmp_path):
    await start_fleet(hosts=2, builder=True)
    # Its secret is not set yet: the push is refused at once, naming it (not found missing
    # by the host at the rollout).
    line = one_line_error(cli("push", str(HELLO)))
    assert "process.hello.files.token.secret: secret hello-token is not set" in line, line
    ok(cli("secret", "set", "hello-token", stdin=HELLO_TOKEN))
    ok(cli("push", str(HELLO)))
    ok(cli("assign", "hello", "node-2", "--wait"))

    async def applied():
        n = await node_named(nc, "node-2")
        return n if n and n["digest_wanted"] and n["digest_applied"] == n["digest_wanted"] else None

    node = await await_until(applied, within=60, what="node-2 to apply its declaration")
    assert node["apply_error"] is None
    assert (await node_named(nc, "node-1"))["digest_applied"] is None

    root = tmp_path / "hosts" / "node-2"
    token = root / "processes" / "hello" / "files" / "token"
    conf = root / "processes" / "hello" / "files" / "app.conf"
    assert token.read_text() == HELLO_TOKEN
    assert stat.S_IMODE(token.stat().st_mode) == 0o400
    assert conf.read_text() == "greeting = hello\n"
    [bundle] = list((root / "bundles").iterdir())
    assert (bundle / "hello.py").is_file()
    assert stat.S_IMODE(bundle.stat().st_mode) == 0o555  # read-only store
    assert stat.S_IMODE((bundle / "hello.py").stat().st_mode) & 0o222 == 0  # root or not

    # A declaration of an older epoch is ignored: a paused old controller cannot roll back.
    events = await nc.subscribe("mesh.event.node-2.applied")
    await nc.flush()
    kv = await js(nc).key_value("mesh-declarations")
    current = json.loads((await kv.get("node-2")).value)
    stale = {**current, "epoch": 0, "digest": "sha256:" + "1" * 64}
    stale["declaration"] = {**current["declaration"], "processes": {}}
    await kv.put("node-2", json.dumps(stale).encode())
    event = json.loads((await events.next_msg(timeout=10)).data)
    assert (event["ok"], event["step"], event["digest"]) == (False, "fence", stale["digest"])
    status = await ask(nc, "mesh.host.node-2.status")
    assert status["applied"] == current["digest"]
    assert token.read_text() == HELLO_TOKEN

    # The same epoch from another controller (two holders given one epoch by a store that
    # lost writes) is refused too: the first holder's declaration stays.
    assert current["holder"] == "ctl-a"
    twin = {**stale, "epoch": current["epoch"], "holder": "ctl-twin"}
    await kv.put("node-2", json.dumps(twin).encode())
    event = json.loads((await events.next_msg(timeout=10)).data)
    assert (event["ok"], event["step"]) == (False, "fence"), event
    assert "comes from ctl-twin, but ctl-a published it first" in event["error"]
    status = await ask(nc, "mesh.host.node-2.status")
    assert status["applied"] == current["digest"]

    # Last, so that everything above runs either way: files belong to the process's account,
    # which exists only as root (without root, accounts map to the user running the host).
    if not ROOT:
        pytest.skip("the files' owner is the account hello only as root: not checked")
    hello = pwd.getpwnam("hello")
    assert token.stat().st_uid == hello.pw_uid
    assert conf.stat().st_uid == hello.pw_uid


def test_files_are_never_written_through_a_link(tmp_path) -> None:
    from services.host import files

    folder = tmp_path / "files"
    outside = tmp_path / "outside"
    outside.mkdir()
    me = accounts.current()
    files.ensure_folder(folder, owner=me)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (folder / "conf").symlink_to(outside)  # what a process's account could do to its folder
    with pytest.raises(OSError):
        files.write(folder, "conf/app.conf", b"x", mode=0o400, owner=me)
    with pytest.raises(ValueError):
        files.write(folder, "../escape", b"x", mode=0o400, owner=me)
    assert list(outside.iterdir()) == []
    files.write(folder, "sub/ok.conf", b"fine", mode=0o440, owner=me)
    assert (folder / "sub" / "ok.conf").read_text() == "fine"
    assert stat.S_IMODE((folder / "sub" / "ok.conf").stat().st_mode) == 0o440
