"""`mesh audit [--limit N] [--who NAME]`: who changed what, as the mesh verified it; and `mesh
operator add NAME --role ROLE [--modules GLOB] [--allow WHAT]...` / `operator list` / `operator
remove NAME [--revert]`: named operators, each with credentials of its own (docs/operations.md,
Operators; what a deployer's modules may ask for: docs/security.md, a scoped operator).

Adding and removing an operator happen on the machine that holds the mesh's folder (as `mesh
machine add` does): its credentials are issued into the folder and the mesh's nats-servers
reloaded. The controller records the operator first (`operator-add`, `operator-remove`, with
their audit entries), so an operator whose credentials work is one the controller knows; a
removed operator is refused by the controller from that moment, and by the servers once they
reload, which closes its connections.

`mesh policy` / `policy set approvals N`: what a held plan needs before it runs (the two-person
rule at 2)."""

import argparse
import getpass
from pathlib import Path
from typing import Any

import msgspec
from rich.markup import escape
from rich.table import Table

from mesh.auth import registry
from mesh.auth.policy import ROLES
from mesh.client.asking import VerbFailed
from mesh.meshdir import DEFAULT_DIR, MeshDir
from mesh.model import (
    MOST_APPROVALS,
    Allow,
    AuditReply,
    AuditRequest,
    Brought,
    OperatorAddRequest,
    OperatorRemoveRequest,
    OperatorReply,
    OperatorsReply,
    OperatorsRequest,
    PolicyReply,
    PolicyRequest,
    PolicySetRequest,
)
from mesh.names import check_name
from programs.cli.args import Parser, count, module_glob
from programs.cli.client import CliError, listed, verb
from programs.cli.folderaudit import ask_as_admin
from programs.cli.machines import _mesh, _reload
from programs.cli.output import console, print_json, whole

AUDIT_SHOWN = 50  # entries `mesh audit` shows without --limit: the newest


class Added(msgspec.Struct):
    name: str
    role: str
    creds: str  # the operator's credentials file, mode 0600: hand it to that operator alone
    modules: str | None = None
    reloaded: bool = False  # the running servers admit it now (else: at their next start)
    allow: list[str] = []  # what an admin granted it beyond its modules' own accounts


class Removed(msgspec.Struct):
    name: str
    revoked: str  # the credentials file that no longer works (deleted)
    reloaded: bool  # the running servers closed its connections
    brought: Brought | None = None  # what it brought in (None: the controller did not say)
    reverted: list[int] = []  # `--revert`: the plans that unassign its modules


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    audit = verbs.add_parser(
        "audit", parents=[common], help="who changed what (the operator the mesh verified)"
    )
    audit.add_argument(
        "--limit", type=count, metavar="N", default=AUDIT_SHOWN,
        help=f"show the newest N entries ({AUDIT_SHOWN})",
    )  # fmt: skip
    audit.add_argument("--who", metavar="NAME", help="one operator's entries only")

    operator = verbs.add_parser("operator", parents=[common], help="named operators")
    operator_verbs = operator.add_subparsers(
        dest="operator_command", metavar="COMMAND", parser_class=Parser
    )
    operator_verbs.required = True
    add = operator_verbs.add_parser(
        "add", parents=[common], help="issue a new operator's credentials"
    )
    add.add_argument("name", metavar="NAME")
    add.add_argument("--role", required=True, choices=ROLES)
    add.add_argument(
        "--modules", metavar="GLOB", type=module_glob,
        help="a deployer's modules (a glob: 'web-*'); every module without",
    )  # fmt: skip
    add.add_argument(
        "--allow", metavar="WHAT", action="append", default=[],
        help="what a deployer's modules may ask for beyond their own accounts (repeatable): "
        "root, groups:LIST (privileged groups), secrets:GLOB, accounts:LIST (other modules')",
    )  # fmt: skip
    remove = operator_verbs.add_parser(
        "remove", parents=[common], help="revoke an operator at once"
    )
    remove.add_argument("name", metavar="NAME")
    remove.add_argument(
        "--revert", action="store_true",
        help="also unassign the modules it pushed last, each through a plan",
    )  # fmt: skip
    for p in (add, remove):
        p.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"the mesh's folder ({DEFAULT_DIR})"
        )
    operator_verbs.add_parser("list", parents=[common], help="the operators the mesh knows")

    policy = verbs.add_parser(
        "policy", parents=[common],
        help="what a held plan needs before it runs; `policy set approvals N`: change it",
    )  # fmt: skip
    policy_verbs = policy.add_subparsers(
        dest="policy_command", metavar="COMMAND", parser_class=Parser
    )
    setting = policy_verbs.add_parser(
        "set", parents=[common],
        help="approvals N: distinct operators, none of them its author, approve a held plan",
    )  # fmt: skip
    setting.add_argument("what", choices=["approvals"])
    setting.add_argument("approvals", type=approvals, metavar="N")


async def cmd_audit(args: argparse.Namespace) -> None:
    who = check_name(args.who, field="--who") if args.who is not None else None
    reply = await listed(args, "audit", AuditReply, AuditRequest(who=who), want=args.limit)
    if args.json:
        print_json(whole(reply))
        return
    out = console()
    table = Table(box=None, header_style="bold")
    for column in ("AT", "WHO", "VERB", "SUBJECT", "OUTCOME", "DETAIL"):
        table.add_column(column)
    for e in reply.entries:
        table.add_row(
            e.at.strftime("%Y-%m-%d %H:%M:%S"), escape(e.who), e.verb, escape(e.subject),
            e.outcome if e.outcome == "ok" else f"[red]{e.outcome}[/]", escape(e.detail),
        )  # fmt: skip
    out.print(table)
    if len(reply.entries) >= args.limit:
        out.print(f"the newest {args.limit}; raise --limit to see older entries")


async def _ask_as_admin(
    args: argparse.Namespace, folder: MeshDir, name: str, reply: type[Any], body: Any
) -> Any:
    return await ask_as_admin(args, folder, name, reply, body,
                              what=f"operator {args.operator_command}")  # fmt: skip


async def cmd_operator_add(args: argparse.Namespace) -> None:
    name = check_name(args.name, field="NAME")
    glob = _glob(args.modules, role=args.role)
    allow = _allowed(args.allow, role=args.role)
    folder = _mesh(args)
    if registry.Registry.load(folder).get("operator", name) is not None:
        raise CliError(
            f"operator {name} already has credentials ({folder.creds_file('operator', name)}); "
            f"`mesh operator remove {name}` revokes them"
        )
    # Recorded by the controller first (with its audit entry): credentials that work are
    # always an operator the controller knows, and scopes.
    body = OperatorAddRequest(name=name, role=args.role, modules=glob, allow=allow)
    await _ask_as_admin(args, folder, "operator-add", OperatorReply, body)
    with registry.locked(folder) as users:
        path = users.issue("operator", name, role=args.role, modules=glob)
        users.save()
    reloaded = await _reload(folder, path.read_text(), admitted=True)
    added = Added(name=name, role=args.role, creds=str(path), modules=glob, reloaded=reloaded,
                  allow=allow)  # fmt: skip
    if args.json:
        print_json(added)
        return
    scope = f", modules {glob}" if glob else ""
    scope += f", allowed {' '.join(allow)}" if allow else ""
    print(f"operator {name} ({args.role}{scope}): credentials in {path} (mode 0600)")
    print(f"hand that file to {name} alone: `MESH_CREDS={path} mesh ...` acts as {name}")
    if not added.reloaded:
        print(f"no nats-server is running for {folder.root}: it admits {name} once started")


def _glob(modules: str | None, *, role: str) -> str | None:
    if modules is not None and role not in ("deployer", "agent"):
        raise CliError(f"--modules: {modules!r} is for a deployer or agent, not a {role}")
    return modules


def _allowed(words: list[str], *, role: str) -> list[str]:
    if words and role != "deployer":
        raise CliError(f"--allow: {words[0]!r} is for a deployer, not a {role}")
    for word in words:
        try:
            msgspec.convert(word, Allow)
        except msgspec.ValidationError:
            raise CliError(
                f"--allow: {word!r} is not root, groups:LIST, secrets:GLOB or accounts:LIST"
            ) from None
    return sorted(set(words))


async def cmd_operator_remove(args: argparse.Namespace) -> None:
    """The controller records the removal first (from then on it refuses the operator's
    changes); the credentials are revoked even when no controller answers (a revocation must
    not wait), and the command then says to record it again."""
    name = check_name(args.name, field="NAME")
    folder = _mesh(args)
    issued = registry.Registry.load(folder).get("operator", name) is not None
    unrecorded: VerbFailed | None = None
    answer: OperatorReply | None = None
    try:
        asked = OperatorRemoveRequest(name=name, revert=args.revert)
        answer = await _ask_as_admin(args, folder, "operator-remove", OperatorReply, asked)
    except VerbFailed as e:
        if e.code == "not_found" and not issued:
            raise CliError(
                f"no operator {name} (in {folder.root} or with the controller)"
            ) from None
        if e.code != "not_found":  # else: one the controller never knew, revoked all the same
            unrecorded = e
    path = folder.creds_file("operator", name)
    text = path.read_text() if issued and path.exists() else ""
    if issued:
        with registry.locked(folder) as users:
            path = users.revoke("operator", name)
            users.save()
    reloaded = issued and await _reload(folder, text or None, admitted=False)
    removed = Removed(name=name, revoked=str(path), reloaded=reloaded,
                      brought=answer.brought if answer else None,
                      reverted=answer.reverted if answer else [])  # fmt: skip
    if unrecorded is not None:
        raise CliError(
            f"operator {name}: credentials revoked, but the controller did not record the "
            f"removal ({unrecorded}); run `mesh operator remove {name}` again once one answers"
        )
    if args.json:
        print_json(removed)
        return
    print(f"operator {name}: removed; credentials revoked ({path} deleted)")
    print(
        "the mesh's nats-server reloaded: it has closed the operator's connections"
        if removed.reloaded
        else f"no nats-server is running for {folder.root}: it will not admit {name}"
    )
    if removed.brought is not None:
        for line in _brought(name, removed.brought, removed.reverted):
            print(line)


def _brought(name: str, b: Brought, reverted: list[int]) -> list[str]:
    """What the operator brought in, in words; what stays until someone takes it back."""
    if not (b.plans or b.modules or b.secrets):
        return [f"{name} brought in nothing that is still current"]
    lines = []
    if b.modules:
        where = f" on {', '.join(b.machines)}" if b.machines else " (assigned nowhere)"
        lines.append(f"modules whose current version {name} pushed: {', '.join(b.modules)}"
                     f"{where}; processes {', '.join(b.processes) or 'none'}")  # fmt: skip
    if b.plans:
        lines.append(f"plans {name} asked for that are not over: "
                     + ", ".join(str(p) for p in b.plans))  # fmt: skip
    if b.secrets:
        lines.append(f"secrets {name} set last: {', '.join(b.secrets)}")
    if reverted:
        lines.append("unassigned through plans " + ", ".join(str(p) for p in reverted))
    elif b.modules:
        lines.append("they keep running: `mesh operator remove --revert` (or `mesh unassign`) "
                     "takes them off their machines")  # fmt: skip
    return lines


async def cmd_operator_list(args: argparse.Namespace) -> None:
    reply = await verb(args, "operators", OperatorsReply, OperatorsRequest())
    if args.json:
        print_json(reply)
        return
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "ROLE", "MODULES", "ALLOWED"):
        table.add_column(column)
    for o in reply.operators:
        modules = o.modules or ("*" if o.role in ("deployer", "agent") else "-")
        table.add_row(escape(o.name), o.role, escape(modules), escape(" ".join(o.allow)) or "-")
    console().print(table)


def approvals(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MOST_APPROVALS:
        raise argparse.ArgumentTypeError(
            f"{text[:20]!r} is not a number of approvals (1 to {MOST_APPROVALS})"
        )
    return int(text)


async def cmd_policy(args: argparse.Namespace) -> None:
    reply = await verb(args, "policy", PolicyReply, PolicyRequest())
    if args.json:
        print_json(reply)
        return
    who = f" (set by {escape(reply.set_by)}" if reply.set_by else " (the default"
    when = f", {reply.set_at.strftime('%Y-%m-%d %H:%M:%S')})" if reply.set_at else ")"
    console().print(f"approvals {reply.approvals}{who}{when}: a held plan runs once "
                    f"{reply.approvals} distinct operator(s), none of them its author, "
                    "approve it")  # fmt: skip


async def cmd_policy_set(args: argparse.Namespace) -> None:
    body = PolicySetRequest(approvals=args.approvals, by=getpass.getuser())
    reply = await verb(args, "policy-set", PolicyReply, body, changes=True)
    print_json(reply) if args.json else console().print(reply.message)


COMMANDS = {
    ("audit",): cmd_audit,
    ("policy",): cmd_policy,
    ("policy", "set"): cmd_policy_set,
    ("operator", "add"): cmd_operator_add,
    ("operator", "remove"): cmd_operator_remove,
    ("operator", "list"): cmd_operator_list,
}
