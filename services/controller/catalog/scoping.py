"""Scoped operators with what the store knows: whether a push is within its pusher's scope, and
whether a secret may be served to the machine that asks for it (the rules are
mesh/auth/scopes.py's; this brings them the operator, the secrets' scopes and the accounts other
modules declare).

The check at serve time is the one that holds whatever the declaration went through: a version
pushed before these rules, or a rollback to it, gets no secret its pusher could not name now.
"""

import logging

import asyncpg

from mesh import wire
from mesh.auth import scopes
from mesh.auth.scopes import Pusher
from mesh.modules.compose import Declaration, tools_of
from mesh.modules.manifest import Manifest
from mesh.ratelimit import PerKey
from mesh.store import audit, modules, secrets
from services.controller.fleet.publishing import Manifests

log = logging.getLogger(__name__)
_refusals: PerKey[str] = PerKey(burst=1, every=60.0)  # a host asking again: a line a minute


async def pusher(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> Pusher:
    """The operator `name` as the store knows it. One it does not know pushed on a bus where
    nobody is verified (`anonymous`), or is an older mesh's name: an admin's, as then."""
    row = await audit.operator(conn, name)
    if row is None:
        return Pusher(name=name, admin=True)
    return Pusher(name=name, admin=row.role == "admin", grants=scopes.Grants.parse(row.allow))


def _named_secrets(m: Manifest) -> list[str]:
    runs = [*m.process.values(), *m.tool.values()]
    return sorted({f.secret for r in runs for f in r.files.values() if f.secret is not None})


def _naming(m: Manifest, secret: str) -> str:
    """The first field of `m` that names `secret`, as a refusal names it."""
    for kind, runs in (("process", m.process), ("tool", m.tool)):
        for name, r in sorted(runs.items()):
            for path, f in sorted(r.files.items()):
                if f.secret == secret:
                    return f"{kind}.{name}.files.{path}.secret"
    return "secret"


async def in_use(conn: asyncpg.Connection, manifests: Manifests) -> dict[str, list[str]]:
    """Each secret some module's current version names: those modules, by name."""
    using: dict[str, list[str]] = {}
    for name, v in sorted((await modules.current_modules(conn)).items()):
        for secret in _named_secrets(manifests.of(v)):
            using.setdefault(secret, []).append(name)
    return using


async def check_push(
    conn: asyncpg.Connection, *, manifests: Manifests, manifest: Manifest, by: str
) -> None:
    """Refuse (`forbidden`, naming the field) a push beyond its pusher's scope."""
    who = await pusher(conn, by)
    others: dict[str, str] = {}
    if not who.admin:  # an admin may take another module's account: its push says so
        current = sorted((await modules.current_modules(conn)).values(), key=lambda v: v.id)
        for v in current:
            if v.module != manifest.module.name:
                for account in manifests.of(v).account:
                    others.setdefault(account, v.module)  # the first to declare it
    named = _named_secrets(manifest)
    set_ = await secrets.scopes(conn, named)
    try:  # first: what the pusher may not name is refused as such, set or not
        scopes.check_push(manifest, pusher=who, secrets=set_, accounts_of_others=others)
    except scopes.Beyond as e:
        raise wire.BadRequest(str(e), code="forbidden") from None
    unset = [s for s in named if s not in set_ and s != scopes.KEY_SECRET]
    if unset:  # refused now, not found missing by each host at the rollout's deadline
        raise wire.BadRequest(
            f"{_naming(manifest, unset[0])}: secret {unset[0]} is not set: set it first "
            f"(mesh secret set {unset[0]}; mesh secret list shows those set)"
            + (f"; nor are {', '.join(unset[1:])}" if unset[1:] else ""),
            code="not_found",
        )


async def check_serve(
    conn: asyncpg.Connection, *, machine: str, labels: dict[str, str], decl: Declaration,
    secret: str,
) -> None:  # fmt: skip
    """Refuse (`forbidden`) a secret to `machine` unless every module of its declaration that
    names it may have it: each file of it lands where that module's process reads it."""
    naming = sorted({
        r.module for r in [*decl.processes.values(), *tools_of(decl).values()]
        for f in r.files.values() if f.secret == secret
    })  # fmt: skip
    if not naming:
        raise wire.BadRequest(
            f"machine {machine}'s declaration names no secret {secret}", code="forbidden"
        )
    scope = (await secrets.scopes(conn, [secret])).get(secret)
    for module in naming:
        by = await modules.pushed_by(conn, module=module, version=decl.modules.get(module, ""))
        why = scopes.may_serve(
            pusher=await pusher(conn, by if by is not None else ""), module=module,
            secret=secret, scope=scope, labels=labels,
        )  # fmt: skip
        if why is not None:
            if _refusals.take(f"{machine} {secret}"):
                log.warning("secret %s refused to machine %s for module %s: %s",
                            secret, machine, module, why)  # fmt: skip
            raise wire.BadRequest(f"forbidden: module {module}: {why}", code="forbidden")
