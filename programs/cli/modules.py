"""`mesh push`, `plan diff`, `assign`, `unassign`, `modules`, `declaration`, `secret set`,
`secret rotate-key`, `build logs`: the module verbs from the command line."""

import argparse
import base64
import getpass
import json
import os
import sys
from pathlib import Path
from typing import Any

from mesh import blobs
from mesh.auth import secretkeys
from mesh.client import changes
from mesh.client.asking import VerbFailed, ask, connected
from mesh.meshdir import DEFAULT_DIR, MeshDir
from mesh.model import (
    MACHINES_NAMED,
    AssignRequest,
    BuildLogsReply,
    BuildLogsRequest,
    ChangeReply,
    DeclarationReply,
    DeclarationRequest,
    DiffReply,
    DiffRequest,
    ModulesReply,
    ModulesRequest,
    PushRequest,
    RestartPlanRequest,
    RotateKeyReply,
    RotateKeyRequest,
    SecretDeleteReply,
    SecretDeleteRequest,
    SecretsReply,
    SecretsRequest,
)
from mesh.modules import gate
from mesh.modules.load import load
from mesh.names import check_name
from mesh.wire import encode
from programs.cli import plans, render, steering
from programs.cli.args import LIMIT_HELP, Parser, count, label, module_glob, note, tier
from programs.cli.client import CHANGE_TIMEOUT, CliError, listed, verb, where
from programs.cli.output import console, print_json, whole


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    push = verbs.add_parser("push", parents=[common], help="validate and upload a module")
    push.add_argument("dir", type=Path, metavar="DIR", help="the module's folder")
    _wait_flag(push)
    steering.hold_flag(push)
    push.add_argument(
        "--note", type=note, default="", metavar="TEXT",
        help="why, in a line: shown in `mesh history`, `mesh plan` and the console",
    )  # fmt: skip

    plan = verbs.add_parser(
        "plan", parents=[common],
        help="recent plans; `plan ID`: one; `plan diff DIR`: a dry run; "
        "`plan approve|pause|resume|cancel|reject ID`: steer one",
    )  # fmt: skip
    plan.add_argument(
        "what", nargs="*", metavar="ID | diff DIR | approve|pause|resume|cancel|reject ID"
    )
    plan.add_argument("--follow", action="store_true", help="show progress until the plan ends")
    plan.add_argument(
        "--changes", action="store_true",
        help="`plan ID`: what each step changes in its machine's declaration (a held plan's "
        "review needs nothing but its id)",
    )  # fmt: skip
    steering.wait_flag(plan)
    steering.digest_flag(plan)
    steering.reason_flag(plan)
    plan.add_argument(
        "--limit", type=count, default=None, metavar="N",
        help="show at most N recent plans (20), steps of a plan, machines of a diff (all)",
    )  # fmt: skip

    move = verbs.add_parser("tier", parents=[common], help="move a machine to another tier")
    move.add_argument("machine")
    move.add_argument("tier", type=tier, metavar="T")

    for name, what in (("assign", "assign a module to machines"),
                       ("unassign", "take a module off machines")):  # fmt: skip
        p = verbs.add_parser(name, parents=[common], help=what)
        p.add_argument("module")
        p.add_argument("machines", nargs="*", metavar="MACHINE")
        p.add_argument("--tier", type=tier, default=None, help="every machine in tier T")
        p.add_argument(
            "--label", type=label, action="append", default=[], metavar="K=V",
            help="every machine with these labels (repeatable)",
        )  # fmt: skip
        _wait_flag(p)
        steering.hold_flag(p)

    again = verbs.add_parser(
        "restart", parents=[common],
        help="restart a module's processes, tier by tier, through its health gates (a plan)",
    )  # fmt: skip
    again.add_argument("module")
    again.add_argument(
        "machines", nargs="*", metavar="MACHINE", help="only these (each must run it); else all"
    )  # fmt: skip
    _wait_flag(again)
    steering.hold_flag(again)

    mods = verbs.add_parser("modules", parents=[common], help="modules, versions, assignments")
    mods.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)
    decl = verbs.add_parser("declaration", parents=[common], help="a machine's declaration")
    decl.add_argument("machine")

    _secret_parsers(verbs, common)

    build = verbs.add_parser("build", parents=[common], help="builds")
    build_verbs = build.add_subparsers(dest="build_command", metavar="COMMAND", parser_class=Parser)
    build_verbs.required = True
    logs = build_verbs.add_parser("logs", parents=[common], help="the last build's whole log")
    logs.add_argument("module")
    logs.add_argument("bundle", nargs="?")


def _secret_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    secret = verbs.add_parser("secret", parents=[common], help="secrets")
    secret_verbs = secret.add_subparsers(
        dest="secret_command", metavar="COMMAND", parser_class=Parser
    )
    secret_verbs.required = True
    secret_set = secret_verbs.add_parser("set", parents=[common], help="store a secret")
    secret_set.add_argument("name")
    secret_set.add_argument("--from-file", type=Path, metavar="F", help="read the value from F")
    secret_set.add_argument(
        "--modules", metavar="GLOB", type=module_glob,
        help="the modules that may name it (a glob: 'web-*'); besides them, only admins' "
        "modules do (it keeps the one it had without)",
    )  # fmt: skip
    _wait_flag(secret_set)
    secret_list = secret_verbs.add_parser(
        "list", parents=[common], help="the secrets that are set (never a value)"
    )
    secret_list.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)
    secret_delete = secret_verbs.add_parser(
        "delete", parents=[common], help="delete a secret no module names"
    )
    secret_delete.add_argument("name")
    rotate = secret_verbs.add_parser(
        "rotate-key", parents=[common],
        help="re-encrypt every secret under a new key (run where the mesh's key file is)",
    )  # fmt: skip
    rotate.add_argument(
        "--key-file", type=Path, metavar="F",
        help="the mesh's key file (env MESH_SECRETS_KEY_FILE; else DIR/keys/secrets.key of "
        "MESH_DIR or .mesh/dev)",
    )  # fmt: skip
    _wait_flag(rotate)


def _wait_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait", action="store_true",
        help="follow the plan to its end; exit non-zero if it fails or is reverted",
    )  # fmt: skip


def _local(folder: Path) -> Any:
    try:
        return load(folder)
    except gate.Refused as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"{folder}: {e.strerror or e}") from None


async def _upload_and_ask(
    args: argparse.Namespace, name: str, body_of: Any, reply: type, *, pages: bool = False
) -> Any:
    """Upload the module's archive, then ask `name` (every page of it, with `pages`):
    `body_of(module, upload)` is the request, `upload` the name the archive was staged under."""
    module = _local(args.dir)
    url, creds = where(args)
    async with connected(url=url, creds=creds, what=name) as nc:
        try:
            staged = await changes.upload(nc, module)
        except blobs.BlobMissing as e:
            raise CliError(f"{e}; {url}") from None
        timeout = getattr(args, "timeout", CHANGE_TIMEOUT)
        body = body_of(module, staged)
        if pages:
            args.timeout = timeout
            return await listed(args, name, reply, body, want=args.limit,
                                connection=nc, attempt=timeout)  # fmt: skip
        return await ask(
            nc, url=url, verb=name, reply=reply, timeout=timeout,
            body=encode(body), attempt=timeout,
        )  # fmt: skip


async def cmd_push(args: argparse.Namespace) -> None:
    def body(m: Any, upload: str | None) -> PushRequest:
        return changes.push_request(m, hold=args.hold, upload=upload, note=args.note)

    reply: ChangeReply = await _upload_and_ask(args, "push", body, ChangeReply)
    await plans.wait_for(args, reply)


async def cmd_plan_diff(args: argparse.Namespace) -> None:
    reply: DiffReply = await _upload_and_ask(
        args, "diff",
        lambda m, upload: DiffRequest(manifest=m.manifest_text, source=m.version, upload=upload),
        DiffReply, pages=True,
    )  # fmt: skip
    if args.json:
        print_json(whole(reply))
    else:
        render.diff(console(), reply, want=args.limit)


async def cmd_plan(args: argparse.Namespace) -> None:
    what = args.what
    if what and what[0] == "diff":
        if len(what) != 2:
            raise CliError("usage: mesh plan diff DIR")
        args.dir = Path(what[1])
        await cmd_plan_diff(args)
    elif what[:1] and what[0] in steering.VERBS:
        await steering.cmd_steer(args, what)
    elif not what:
        await plans.listing(args)
    elif len(what) == 1 and what[0].isdigit():
        await plans.show(args, int(what[0]))
    else:
        raise CliError(f"plan: {' '.join(what)!r} is not a plan id (nor `diff DIR`)")


async def _assign(args: argparse.Namespace, name: str) -> None:
    if not args.machines and args.tier is None and not args.label:
        raise CliError(f"{name}: name machines, or select them with --tier or --label")
    if len(args.machines) > MACHINES_NAMED:
        raise CliError(
            f"{name}: {len(args.machines)} machines named, at most {MACHINES_NAMED} at once; "
            "select many with --tier or --label"
        )
    body = AssignRequest(
        module=args.module, machines=args.machines, tier=args.tier, labels=dict(args.label),
        by=getpass.getuser(), hold=args.hold,
    )  # fmt: skip
    reply = await verb(args, name, ChangeReply, body, changes=True)
    await plans.wait_for(args, reply)


async def cmd_assign(args: argparse.Namespace) -> None:
    await _assign(args, "assign")


async def cmd_unassign(args: argparse.Namespace) -> None:
    await _assign(args, "unassign")


async def cmd_restart(args: argparse.Namespace) -> None:
    if len(args.machines) > MACHINES_NAMED:
        raise CliError(f"restart: {len(args.machines)} machines named, at most {MACHINES_NAMED}")
    body = RestartPlanRequest(module=args.module, machines=args.machines, by=getpass.getuser(),
                              hold=args.hold)  # fmt: skip
    reply = await verb(args, "restart", ChangeReply, body, changes=True)
    await plans.wait_for(args, reply)


async def cmd_modules(args: argparse.Namespace) -> None:
    reply = await listed(args, "modules", ModulesReply, ModulesRequest(), want=args.limit)
    if args.json:
        print_json(whole(reply))
    else:
        render.modules(console(), reply, want=args.limit)


async def cmd_declaration(args: argparse.Namespace) -> None:
    reply: DeclarationReply = await verb(
        args, "declaration", DeclarationReply, DeclarationRequest(machine=args.machine)
    )
    if args.json:
        print_json(reply)
    else:
        console().print(f"{reply.machine}  {reply.digest}  epoch {reply.epoch}")
        sys.stdout.write(json.dumps(json.loads(bytes(reply.declaration)), indent=2) + "\n")


async def cmd_secret_set(args: argparse.Namespace) -> None:
    if args.from_file:
        try:
            value = args.from_file.read_bytes()
        except OSError as e:
            raise CliError(f"--from-file: {args.from_file}: {e.strerror or e}") from None
    elif sys.stdin.isatty():
        value = getpass.getpass(f"value of secret {args.name}: ").encode()
    else:
        value = sys.stdin.buffer.read()
    body = changes.secret_request(args.name, value, modules=args.modules)
    reply = await verb(args, "secret-set", ChangeReply, body, changes=True)
    await plans.wait_for(args, reply)


async def cmd_secret_list(args: argparse.Namespace) -> None:
    reply = await listed(args, "secrets", SecretsReply, SecretsRequest(), want=args.limit)
    if args.json:
        print_json(whole(reply))
    else:
        render.secrets(console(), reply, want=args.limit)


async def cmd_secret_delete(args: argparse.Namespace) -> None:
    check_name(args.name, field="NAME")
    body = SecretDeleteRequest(name=args.name, by=getpass.getuser())
    reply = await verb(args, "secret-delete", SecretDeleteReply, body, changes=True)
    if args.json:
        print_json(reply)
    else:
        console().print(reply.message)


# --- the key of the secrets (services/controller/catalog/secretkeys.py) ---------------------------

# Refusals after which the controller has changed nothing: the key file is put back as it was.
_NOTHING_DONE = ("bad_request", "conflict", "forbidden", "unknown_verb")


async def cmd_secret_rotate_key(args: argparse.Namespace) -> None:
    """A new key, made here and first in the mesh's key file (the old one kept), given to the
    holder, which re-wraps every secret under it; then the old key leaves the file. A rotation
    cut short leaves both keys in the file: run again, it goes on with the same new key."""
    path = args.key_file or Path(
        os.environ.get("MESH_SECRETS_KEY_FILE") or MeshDir(DEFAULT_DIR).secrets_key
    )
    try:
        ring = secretkeys.read(path)
    except secretkeys.SecretsKeyError as e:
        raise CliError(f"{e} (--key-file names the mesh's key file)") from None
    if len(ring.keys) > 1:  # one cut short: the new key is first already
        new, replaces = ring.keys[0], secretkeys.key_id(ring.keys[1])
    else:
        new, replaces = secretkeys.new_key(), ring.active
        secretkeys.write(path, ring.first(new))
    body = RotateKeyRequest(
        key=base64.b64encode(new).decode(), replaces=replaces, by=getpass.getuser()
    )
    try:
        reply = await verb(args, "secret-rotate-key", RotateKeyReply, body, changes=True)
    except VerbFailed as e:
        if e.code in _NOTHING_DONE:
            secretkeys.write(path, ring)
            raise
        raise CliError(f"{e}; {path} holds the new key and the old one: run "
                       "`mesh secret rotate-key` again to finish") from None  # fmt: skip
    secretkeys.write(path, secretkeys.KeyRing((new,)))
    if not args.json:
        console().print(f"{path}: key {reply.key} (back it up: the old key no longer opens the "
                        "store's secrets)")  # fmt: skip
    await plans.wait_for(args, reply)


async def cmd_build_logs(args: argparse.Namespace) -> None:
    reply: BuildLogsReply = await verb(
        args, "build-logs", BuildLogsReply, BuildLogsRequest(module=args.module, bundle=args.bundle)
    )
    if args.json:
        print_json(reply)
    else:
        sys.stderr.write(f"build {reply.key[:19]} of {reply.module}/{reply.bundle} on "
                         f"{reply.builder}: {reply.state}\n")  # fmt: skip
        sys.stdout.write(reply.log)


COMMANDS = {
    ("push",): cmd_push,
    ("plan",): cmd_plan,
    ("tier",): plans.cmd_tier,
    ("assign",): cmd_assign,
    ("unassign",): cmd_unassign,
    ("restart",): cmd_restart,
    ("modules",): cmd_modules,
    ("declaration",): cmd_declaration,
    ("secret", "set"): cmd_secret_set,
    ("secret", "list"): cmd_secret_list,
    ("secret", "delete"): cmd_secret_delete,
    ("secret", "rotate-key"): cmd_secret_rotate_key,
    ("build", "logs"): cmd_build_logs,
}
