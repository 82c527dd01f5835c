"""What a scoped operator may push (mesh/auth/scopes.py), rule by rule, on manifests as the gate
parses them: each refusal names the field, and an admin's grant (or an admin) lets it through.
The same rules against a running mesh, with a deployer's real credentials: tests/test_attacks.py."""

import pytest

from mesh.auth import scopes
from mesh.auth.scopes import Beyond, Grants, Pusher, SecretScope
from mesh.modules import gate

BOB = Pusher(name="bob", admin=False)
ADMIN = Pusher(name="admin", admin=True)


def _manifest(name: str, body: str):
    return gate.parse(
        f'[module]\nname = "{name}"\n[bundle.b]\nkind = "files"\nsource = "src"\n'
        f"[account.{name}]\n{body}"
    )


def _process(name: str, extra: str = "", account: str | None = None) -> str:
    runs_as = f'account = "{account or name}"' if extra.find("root") < 0 else ""
    return f'[process.p]\nbundle = "b"\ncommand = ["./p"]\n{runs_as}\n{extra}\n'


def _check(m, pusher=BOB, secrets=None, others=None) -> None:
    scopes.check_push(m, pusher=pusher, secrets=secrets or {}, accounts_of_others=others or {})


def test_root_is_an_admins_or_granted() -> None:
    m = _manifest("web-root", _process("web-root", "root = true"))
    with pytest.raises(Beyond) as refused:
        _check(m)
    assert refused.value.field == "process.p.root"
    assert "forbidden: module web-root: process.p.root" in str(refused.value)
    _check(m, pusher=ADMIN)
    _check(m, pusher=Pusher(name="bob", admin=False, grants=Grants(root=True)))


def test_a_tool_server_as_root_is_refused_too() -> None:
    m = gate.parse(
        '[module]\nname = "web-t"\n[bundle.b]\nkind = "files"\nsource = "src"\n'
        '[tool.t]\nbundle = "b"\ncommand = ["./t"]\nroot = true\n'
    )
    with pytest.raises(Beyond, match=r"tool\.t\.root"):
        _check(m)


def test_privileged_groups_each_need_their_grant() -> None:
    m = _manifest("web-g", 'privileged_groups = ["shadow", "disk"]\n' + _process("web-g"))
    with pytest.raises(Beyond, match=r"account\.web-g\.privileged_groups: 'disk'"):
        _check(m)
    with pytest.raises(Beyond, match="'shadow'"):
        _check(m, pusher=Pusher(name="bob", admin=False, grants=Grants.parse(["groups:disk"])))
    _check(m, pusher=Pusher(name="bob", admin=False,
                            grants=Grants.parse(["groups:disk,shadow"])))  # fmt: skip


def test_another_modules_account_or_its_group_is_its_own() -> None:
    m = gate.parse(
        '[module]\nname = "web-acct"\n[bundle.b]\nkind = "files"\nsource = "src"\n'
        '[account.files]\n[process.p]\nbundle = "b"\ncommand = ["./p"]\naccount = "files"\n'
    )
    with pytest.raises(Beyond, match=r"account\.files: account files is module files's"):
        _check(m, others={"files": "files"})
    _check(m, pusher=ADMIN, others={"files": "files"})  # an admin's push says so
    _check(m, pusher=Pusher(name="bob", admin=False, grants=Grants.parse(["accounts:files"])),
           others={"files": "files"})  # fmt: skip
    joins = _manifest("web-j", 'groups = ["files"]\n' + _process("web-j"))
    with pytest.raises(Beyond, match=r"account\.web-j\.groups: 'files'"):
        _check(joins, others={"files": "files"})


@pytest.mark.parametrize("secret", sorted(scopes.CONTROLLER_SECRETS))
def test_the_controllers_secrets_are_nobody_elses(secret: str) -> None:
    m = _manifest(
        "web-steal", _process("web-steal", f'files = {{ "x" = {{ secret = "{secret}" }} }}')
    )
    for pusher in (BOB, ADMIN, Pusher(name="bob", admin=False, grants=Grants.parse(["secrets:*"]))):
        with pytest.raises(Beyond, match=f"{secret} is the controller's own secret"):
            _check(m, pusher=pusher, secrets={secret: SecretScope(modules="*")})


def test_the_controllers_module_is_pushed_by_an_admin_and_served_to_control_machines() -> None:
    m = gate.parse(
        '[module]\nname = "mesh-controller"\n[bundle.mesh]\nkind = "mesh"\n'
        '[account.mesh-controller]\n[process.mesh-controller]\nbundle = "mesh"\n'
        'command = ["./mesh", "controller", "run"]\naccount = "mesh-controller"\n'
        'files = { "k" = { secret = "mesh-secrets-key" } }\n'
    )
    _check(m, pusher=ADMIN)
    with pytest.raises(Beyond, match="an admin's to push"):
        _check(m, pusher=Pusher(name="bob", admin=False, grants=Grants.parse(["secrets:*"])))
    serve = {"pusher": ADMIN, "module": "mesh-controller", "secret": "mesh-secrets-key",
             "scope": None}  # fmt: skip
    assert scopes.may_serve(**serve, labels={"role": "control"}) is None
    assert "labelled role=control" in (scopes.may_serve(**serve, labels={}) or "")


def test_a_secret_is_named_by_the_modules_it_is_for() -> None:
    m = _manifest("web-a", _process("web-a", 'files = { "t" = { secret = "hello-token" } }'))
    with pytest.raises(Beyond, match="it has not been set"):
        _check(m)
    with pytest.raises(Beyond, match=r"process\.p\.files\.t\.secret: secret hello-token"):
        _check(m, secrets={"hello-token": SecretScope(set_by="admin")})
    with pytest.raises(Beyond, match="it is for modules 'hello'"):
        _check(m, secrets={"hello-token": SecretScope(modules="hello", set_by="admin")})
    _check(m, secrets={"hello-token": SecretScope(modules="web-*", set_by="admin")})
    _check(m, secrets={"hello-token": SecretScope(set_by="bob")})  # it set it itself
    granted = Pusher(name="bob", admin=False, grants=Grants.parse(["secrets:hello-*"]))
    _check(m, pusher=granted)
    _check(m, pusher=ADMIN, secrets={"hello-token": SecretScope(modules="hello")})


def test_an_allow_word_that_is_not_one_names_itself() -> None:
    with pytest.raises(ValueError, match="allow: 'sudo' is not root"):
        Grants.parse(["sudo"])
