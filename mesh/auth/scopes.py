"""What an operator may ask for through the modules it pushes: a scope is what an identity can
do, not only which modules it may name (docs/security.md, "A scoped operator").

A deployer's glob says which modules it may change; this says what those modules may ask of a
machine. Below admin, an operator may not push what makes a process more than an account of
its own module: `root = true`, `privileged_groups`, an account another module declares (or its
group), or a file from a secret that is not its module's to use. An admin grants more, by name
(`mesh operator add NAME --role deployer --modules GLOB --allow root|groups:LIST|secrets:GLOB|
accounts:LIST`). Kubernetes answers the same with Pod Security admission and RBAC on secrets.

The controller's own secrets (its store's URL, its NATS identity, the key of the secrets) are
nobody's to name but the controller's module, pushed by an admin, and they are served only to
machines labelled role=control. The holder checks the secrets again whenever it serves one
(`may_serve`): a declaration that came some other way (a version pushed before these rules, a
rollback to it) gets no secret its pusher could not name today.

Pure functions over the manifest and what the store says; the controller brings the facts.
"""

import fnmatch
import re
from collections.abc import Mapping

import msgspec

from mesh import osaccounts
from mesh.model import ALLOW_PATTERN
from mesh.modules.manifest import Manifest, Runs

CONTROLLER_MODULE = osaccounts.CONTROLLER  # services/controller/module.toml
CONTROL_LABEL = ("role", "control")  # the machines that run the controller
# The key of the secrets, as a file the controller's module is given: never a row of the store
# (mesh/store/secrets.py), its version the key's generation.
KEY_SECRET = "mesh-secrets-key"
# The controller's secrets (services/controller/module.toml): what they give is the whole mesh.
CONTROLLER_SECRETS = frozenset({
    KEY_SECRET,  # the key every secret is sealed under
    "mesh-database-url",  # the store, with its password
    "mesh-controller-creds",  # the controllers' NATS identity: every subject
    "mesh-system-creds",  # the NATS system account's kicker
    "mesh-nats-signer",  # signs NATS credentials: whoever has it admits anyone
    "mesh-store-ca",  # not secret, but the controller's to be given
})  # fmt: skip

_ALLOW = re.compile(ALLOW_PATTERN)  # `--allow` words


class Grants(msgspec.Struct, frozen=True):
    """What an admin granted a scoped operator beyond its modules' own accounts."""

    root: bool = False
    groups: frozenset[str] = frozenset()  # privileged groups its modules' accounts may join
    secrets: tuple[str, ...] = ()  # globs of secret names its modules may name
    accounts: frozenset[str] = frozenset()  # other modules' accounts its modules may take

    @classmethod
    def parse(cls, words: list[str]) -> "Grants":
        """From `--allow` words (as stored); ValueError naming the word that is not one."""
        root, groups, globs, accounts = False, set(), [], set()
        for word in words:
            if not _ALLOW.fullmatch(word):
                raise ValueError(
                    f"allow: {word!r} is not root, groups:LIST, secrets:GLOB or accounts:LIST"
                )
            kind, _, value = word.partition(":")
            if kind == "root":
                root = True
            elif kind == "groups":
                groups.update(value.split(","))
            elif kind == "secrets":
                globs.append(value)
            else:
                accounts.update(value.split(","))
        return cls(root=root, groups=frozenset(groups), secrets=tuple(globs),
                   accounts=frozenset(accounts))  # fmt: skip

    def secret(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in self.secrets)


class Pusher(msgspec.Struct, frozen=True):
    """Who pushed a module, as the store knows it. `admin` covers a bus where nobody is
    verified (no operators: everyone may do everything) and versions an older mesh recorded
    without a known operator."""

    name: str
    admin: bool
    grants: Grants = Grants()


class SecretScope(msgspec.Struct, frozen=True):
    """Who may use a secret: the modules its glob matches, and the operator that set it."""

    modules: str | None = None
    set_by: str = ""


class Beyond(Exception):
    """Refused: what the module asks is beyond its pusher's scope. str(): one line naming the
    module, the field and the value."""

    def __init__(self, module: str, field: str, why: str) -> None:
        super().__init__(f"forbidden: module {module}: {field}: {why}")
        self.field = field


def _runs(m: Manifest) -> list[tuple[str, Runs]]:
    return [
        *((f"process.{n}", p) for n, p in sorted(m.process.items())),
        *((f"tool.{n}", t) for n, t in sorted(m.tool.items())),
    ]


def secret_use(
    *, pusher: Pusher, module: str, secret: str, scope: SecretScope | None
) -> str | None:
    """Why `pusher`'s module may not name `secret` (None: it may). `scope` None: never set."""
    if secret in CONTROLLER_SECRETS:
        if module != CONTROLLER_MODULE:
            return f"{secret} is the controller's own secret: only its module may name it"
        return None if pusher.admin else f"{secret} is the controller's: an admin's to push"
    if pusher.admin or pusher.grants.secret(secret):
        return None
    if scope is not None and (
        scope.set_by == pusher.name
        or (scope.modules is not None and fnmatch.fnmatchcase(module, scope.modules))
    ):
        return None
    whose = (
        "it has not been set"
        if scope is None
        else f"it is for modules {scope.modules!r}"
        if scope.modules
        else f"it is {scope.set_by or 'an admin'}'s"
    )
    return (
        f"secret {secret} is not module {module}'s to use ({whose}): an admin sets it with "
        f"`mesh secret set {secret} --modules GLOB`, or grants --allow secrets:GLOB"
    )


def check_push(
    m: Manifest,
    *,
    pusher: Pusher,
    secrets: Mapping[str, SecretScope],
    accounts_of_others: Mapping[str, str],
) -> None:
    """Raise Beyond if `pusher` may not push `m`. `secrets`: the scopes of the secrets that
    are set; `accounts_of_others`: account -> another module that declares it."""
    mod = m.module.name
    for field, runs in _runs(m):
        for path, spec in sorted(runs.files.items()):
            if spec.secret is None:
                continue
            why = secret_use(pusher=pusher, module=mod, secret=spec.secret,
                             scope=secrets.get(spec.secret))  # fmt: skip
            if why is not None:
                raise Beyond(mod, f"{field}.files.{path}.secret", why)
    if pusher.admin:
        return  # an admin's push is the admin's say-so for the rest
    for field, runs in _runs(m):
        if runs.root and not pusher.grants.root:
            raise Beyond(mod, f"{field}.root", "root = true is an admin's to push "
                         "(or to grant: --allow root)")  # fmt: skip
    for name, account in sorted(m.account.items()):
        f = f"account.{name}"
        other = accounts_of_others.get(name)  # the gate refuses OWNED_ACCOUNTS already
        if other is not None and name not in pusher.grants.accounts:
            raise Beyond(mod, f, f"account {name} is module {other}'s: an admin pushes it, or "
                         f"grants --allow accounts:{name}")  # fmt: skip
        for group in sorted(account.privileged_groups):
            if group not in pusher.grants.groups:
                raise Beyond(mod, f"{f}.privileged_groups", f"{group!r} is an admin's to "
                             f"grant (--allow groups:{group})")  # fmt: skip
        for group in sorted(account.groups):
            owner = accounts_of_others.get(group)
            if owner is not None and group not in pusher.grants.accounts:
                raise Beyond(mod, f"{f}.groups", f"{group!r} is the group of module "
                             f"{owner}'s account: an admin's to grant")  # fmt: skip


def may_serve(
    *,
    pusher: Pusher,
    module: str,
    secret: str,
    scope: SecretScope | None,
    labels: Mapping[str, str],
) -> str | None:
    """Why the holder must not give `secret` to a machine (with `labels`) for `module`, whose
    version `pusher` pushed (None: it may)."""
    why = secret_use(pusher=pusher, module=module, secret=secret, scope=scope)
    if why is None and secret in CONTROLLER_SECRETS:
        key, value = CONTROL_LABEL
        if labels.get(key) != value:
            why = f"{secret} is served only to the control machines (labelled {key}={value})"
    return why
