"""`mesh machine add NAME` / `mesh machine remove NAME`: a host's credentials, issued into and
revoked from a mesh's folder on this machine (the one `mesh dev up --dir` made), followed by a
reload of the mesh's nats-server so the change counts at once.

`mesh label MACHINE K=V... [--remove K]`, and `mesh machine add --tier --label --builder`: the
tier and labels that decide what a machine gets are the operator's, held by the controller; a
host never chooses its own (docs/security.md). A machine not registered yet is placed: its
first registration takes them.

`mesh drain MACHINE` / `mesh undrain MACHINE`: a machine out of every plan (it keeps what it
runs), and back in, brought up to date by a plan of its own."""

import argparse
import getpass
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.errors

from mesh import bus, config
from mesh.auth import creds as credentials
from mesh.auth import registry, server
from mesh.client.asking import VerbFailed, connected
from mesh.meshdir import DEFAULT_DIR, MeshDir
from mesh.model import (
    DrainReply,
    DrainRequest,
    JoinedKeyReply,
    JoinedKeyRequest,
    LabelReply,
    LabelRequest,
    labels_said,
)
from mesh.names import InvalidName, check_name
from programs.cli import folderaudit, plans
from programs.cli.args import Parser, label, tier
from programs.cli.client import CliError, verb, where
from programs.cli.output import console, print_json, whole
from programs.placement import place, place_new
from programs.units import host_unit, render


class Added(msgspec.Struct):
    name: str
    creds: str  # the credentials file, mode 0600: copy it to the machine, keep it secret
    command: str  # what starts the host with it
    reloaded: bool  # the running server admits it now (else: at its next start)
    tier: int | None = None  # as the controller holds it, when --tier/--label/--builder asked
    labels: dict[str, str] | None = None
    ca: bool = False  # the file carries the mesh's CA (the host trusts the servers by it)
    servers: str | None = None  # the NATS URL(s) the file carries, comma-separated
    unit_name: str = ""  # a systemd unit that runs the same command, at every boot
    unit: str = ""  # its text
    audited: bool = False  # a controller recorded it in the audit log, as the verified operator


class Removed(msgspec.Struct):
    name: str
    revoked: str  # the credentials file that no longer works (deleted), or the key it joined with
    reloaded: bool
    audited: bool = False


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    machine = verbs.add_parser("machine", parents=[common], help="machines' credentials")
    machine_verbs = machine.add_subparsers(
        dest="machine_command", metavar="COMMAND", parser_class=Parser
    )
    machine_verbs.required = True
    add = machine_verbs.add_parser(
        "add", parents=[common], help="issue a new host's credentials and print its command"
    )
    add.add_argument("name", metavar="NAME")
    add.add_argument(
        "--builder", action="store_true", help="it may store build outputs (label it builder=true)"
    )
    add.add_argument("--tier", type=tier, default=None, help="its rollout tier 0-9 (2)")
    add.add_argument(
        "--label", type=label, action="append", default=[], metavar="K=V", help="repeatable"
    )
    remove = machine_verbs.add_parser(
        "remove", parents=[common], help="revoke a host's credentials"
    )
    remove.add_argument("name", metavar="NAME")
    for p in (add, remove):
        p.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"the mesh's folder ({DEFAULT_DIR})"
        )

    labels = verbs.add_parser(
        "label", parents=[common], help="set or remove a machine's labels (an admin's)"
    )
    labels.add_argument("machine", metavar="MACHINE")
    labels.add_argument("labels", type=label, nargs="*", metavar="K=V", help="labels to set")
    labels.add_argument(
        "--remove", type=_label_key, action="append", default=[], metavar="K",
        help="a label to remove (repeatable)",
    )  # fmt: skip

    drain = verbs.add_parser(
        "drain", parents=[common],
        help="take a machine out of every plan; it keeps what it runs (an admin's)",
    )  # fmt: skip
    drain.add_argument("machine", metavar="MACHINE")
    undrain = verbs.add_parser(
        "undrain", parents=[common],
        help="put a drained machine back; a plan brings it up to date (an admin's)",
    )  # fmt: skip
    undrain.add_argument("machine", metavar="MACHINE")
    undrain.add_argument(
        "--wait", action="store_true", help="follow the plan that brings it up to date to its end"
    )


def add_dev_parser(dev_verbs: Any, common: argparse.ArgumentParser) -> None:
    p = dev_verbs.add_parser(
        "place", parents=[common], help="place the dev mesh's machines as `mesh dev up` does"
    )
    p.add_argument("--hosts", type=int, default=3, metavar="N", help="hosts node-1..N (3)")


async def cmd_dev_place(args: argparse.Namespace) -> None:
    """`mesh dev place [--hosts N]`: node-1 tier 0 with builder=true, node-2 tier 1, the rest
    tier 2, for the machines the store has never seen, as an admin (compose.dev.yaml's one-shot
    `place` service, before its hosts start: they never choose their own)."""
    if not 0 <= args.hosts <= 64:
        raise CliError(f"--hosts: {args.hosts} is out of range (0 to 64)")
    url, creds = where(args)
    async with connected(url=url, creds=creds, what="dev place") as nc:
        lines = await place_new(nc, url=url, hosts=args.hosts, alive=lambda: None, within=90)
    if args.json:
        print_json({"placed": lines})
        return
    for line in lines or ["every machine was placed before: nothing to do"]:
        print(line)


def _label_key(text: str) -> str:
    try:
        return check_name(text, field="label key")
    except InvalidName as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mesh(args: argparse.Namespace) -> MeshDir:
    folder = MeshDir(args.dir)
    if not folder.users.exists():
        raise CliError(
            f"no mesh credentials in {folder.root} (no {folder.users}); "
            f"`mesh dev up --dir {args.dir}` makes a mesh there"
        )
    return folder


RELOAD_WITHIN = 10.0  # for each server to take a reload (it is asynchronous: a SIGHUP)


async def _reload(folder: MeshDir, creds: str | None, *, admitted: bool) -> bool:
    """Have the mesh's running servers take a change of identities; True once one has. A new
    one needs nothing of them (its JWT is signed by the mesh's signer: mesh/auth/trust.py); a
    revoked one is in the account's new JWT, pushed to them as the folder's claims user, and
    they close its connections. Then wait until each takes it: `creds` (a credentials file's
    text, if known) connects when `admitted`, or is refused. Without the wait, credentials just
    issued or revoked could be taken otherwise by the next command."""
    url = folder.nats_url()
    if url is None:
        return False
    if not admitted and not await _push_account(folder, url):
        return False
    if not creds:
        return True
    with tempfile.TemporaryDirectory(prefix="mesh-reload-") as held:
        probe = Path(held) / "probe.creds"
        probe.write_text(creds)
        probe.chmod(0o600)
        for one in config.servers(url):
            await _taken(one, str(probe), admitted=admitted)
    return True


async def _push_account(folder: MeshDir, url: str) -> bool:
    """The account's JWT (with its revocations) to the servers; False when none answers (they
    take it from their configuration, written already, at their start)."""
    users = registry.Registry.load(folder)
    pusher = users.system_user("claims")
    try:
        nc = await bus.connect(url, name="mesh-claims", creds=str(pusher), reconnect=False)
    except (bus.Unreachable, bus.Unauthorized):
        return False
    try:
        await server.publish_account(nc, users.trust, list(users.revoked.values()))
    except (ValueError, nats.errors.Error) as e:
        print(f"mesh: the servers did not take the account's new JWT ({e}); they take it from "
              "their configuration at their next start", file=sys.stderr)  # fmt: skip
        return False
    finally:
        await bus.close(nc, drain=False)
    return True


async def _taken(url: str, creds: str, *, admitted: bool) -> None:
    """Wait until the server at `url` admits (or refuses) `creds`; said on stderr if it has not
    within RELOAD_WITHIN, or answers not at all (it is stopping, or another's)."""
    with anyio.move_on_after(RELOAD_WITHIN):
        while True:
            try:
                nc = await bus.connect(url, name="mesh-reload-check", creds=creds,
                                       reconnect=False)  # fmt: skip
            except bus.Unauthorized:
                if not admitted:
                    return
            except bus.Unreachable:
                return  # not running any more: it takes the change at its start
            else:
                await bus.close(nc, drain=False)
                if admitted:
                    return
            await anyio.sleep(0.1)  # ok: polling the server's reload, with a deadline
    print(f"mesh: nats-server at {url} has not taken the change after {RELOAD_WITHIN:.0f} s; "
          "see its log", file=sys.stderr)  # fmt: skip


async def cmd_machine_add(args: argparse.Namespace) -> None:
    name = check_name(args.name, field="NAME")
    folder = _mesh(args)
    if registry.Registry.load(folder).get("host", name) is not None:
        raise CliError(
            f"machine {name} already has credentials ({folder.creds_file('host', name)}); "
            f"`mesh machine remove {name}` revokes them, then add it again for new ones"
        )
    url = folder.nats_url() or config.nats_url(getattr(args, "nats_url", None))
    labels = dict(args.label) | ({"builder": "true"} if args.builder else {})
    placed: tuple[int | None, dict[str, str] | None] = (None, None)
    if args.tier is not None or labels:
        # Before the credentials exist, so the host's first registration finds its placement;
        # a controller that cannot be asked leaves nothing half done.
        admin = folder.creds_file("operator", "admin")
        creds = config.creds(getattr(args, "creds", None)) or (
            str(admin) if admin.exists() else None
        )
        async with connected(url=url, creds=creds, what="machine add") as nc:
            placed = await place(nc, url=url, machine=name, tier=args.tier, labels=labels,
                                 timeout=getattr(args, "timeout", 10.0))  # fmt: skip
    with registry.locked(folder) as users:
        if users.get("host", name) is not None:
            raise CliError(f"machine {name} was given credentials meanwhile; see {folder.users}")
        path = users.issue("host", name, builder=args.builder)
        users.save()
    reloaded = await _reload(folder, path.read_text(), admitted=True)
    held = credentials.read(path)
    argv = ["mesh", "host", "run", "--name", name, "--creds", str(path)]
    if not held.servers:  # the file names no servers: the command must
        argv += ["--nats-url", url]
    unit = host_unit(name, argv)
    audited = await folderaudit.record(args, folder, "machine-add", name,
                                       "builder" if args.builder else "")  # fmt: skip
    added = Added(name=name, creds=str(path), command=shlex.join(argv), reloaded=reloaded,
                  tier=placed[0], labels=placed[1], ca=held.ca is not None,
                  servers=held.servers, unit_name=unit.name, unit=render(unit),
                  audited=audited)  # fmt: skip
    if args.json:
        print_json(added)
        return
    print(f"machine {name}: credentials in {path} (mode 0600; copy it to the machine, secretly)")
    carried = [what for what, has in (("the mesh's CA", added.ca),
               (f"the NATS URL(s) {held.servers}", held.servers)) if has]  # fmt: skip
    if carried:
        print(f"that one file carries {' and '.join(carried)}: the host needs nothing else")
    if added.labels is not None:
        tier_text = f"tier {added.tier}" if added.tier is not None else "its tier"
        print(f"{tier_text}, labels {labels_said(added.labels)}: held by the controller")
    print(
        "the mesh's nats-server admits it now"
        if reloaded
        else f"no nats-server is running for {folder.root}: it admits {name} once started"
    )
    print(f"start the host with:\n  {added.command}")
    print(
        f"or have systemd run it, at every boot (as root: this in /etc/systemd/system/"
        f"{added.unit_name}, then `systemctl enable --now {added.unit_name}`):\n\n{added.unit}",
        end="",
    )


async def cmd_label(args: argparse.Namespace) -> None:
    check_name(args.machine, field="MACHINE")
    if not args.labels and not args.remove:
        raise CliError(f"label {args.machine}: name labels to set (K=V) or to --remove (K)")
    req = LabelRequest(machine=args.machine, set=dict(args.labels), remove=args.remove)
    reply = await verb(args, "label", LabelReply, req, changes=True)
    if args.json:
        print_json(reply)
        return
    after = f"{reply.machine}: labels {labels_said(reply.labels)} (were {labels_said(reply.was)})"
    if not reply.registered:
        after += f"; {reply.machine} has not registered yet: it takes them when it does"
    console().print(after)


async def _drain(args: argparse.Namespace, name: str) -> None:
    """`mesh drain MACHINE` / `mesh undrain MACHINE [--wait]`."""
    check_name(args.machine, field="MACHINE")
    req = DrainRequest(machine=args.machine, by=getpass.getuser())
    reply = await verb(args, name, DrainReply, req, changes=True)
    if reply.plan is None or not getattr(args, "wait", False):
        print_json(reply) if args.json else console().print(reply.message)
        return
    if not args.json:
        console().print(reply.message)
    final = await plans.follow(args, reply.plan)
    if args.json:
        print_json({**msgspec.to_builtins(reply), "outcome": whole(final)})
    else:
        plans.render_end(final)
    plans.outcome(final)


async def cmd_drain(args: argparse.Namespace) -> None:
    await _drain(args, "drain")


async def cmd_undrain(args: argparse.Namespace) -> None:
    await _drain(args, "undrain")


async def cmd_machine_remove(args: argparse.Namespace) -> None:
    name = check_name(args.name, field="NAME")
    folder = _mesh(args)
    with registry.locked(folder) as users:
        issued = folder.creds_file("host", name)
        text = issued.read_text() if issued.exists() else ""
        try:
            revoked = str(users.revoke("host", name))
        except registry.AuthError:
            revoked = ""
        else:
            users.save()
    if not revoked:  # a machine that joined with a token: its key is the controller's to give
        revoked = await _revoke_joined(args, folder, name)
    reloaded = await _reload(folder, text or None, admitted=False)
    audited = await folderaudit.record(args, folder, "machine-remove", name, "revoked")
    removed = Removed(name=name, revoked=revoked, reloaded=reloaded, audited=audited)
    if args.json:
        print_json(removed)
        return
    print(f"machine {name}: credentials revoked ({revoked}"
          f"{' deleted' if revoked.startswith('/') else ''})")  # fmt: skip
    print(
        "the mesh's servers took the revocation: they have closed the machine's connections"
        if reloaded
        else f"no nats-server is running for {folder.root}: it will not admit {name}"
    )


async def _revoke_joined(args: argparse.Namespace, folder: MeshDir, name: str) -> str:
    """The key a machine joined with (`mesh join`), forgotten by the controller and revoked
    here; what was revoked, in words."""
    try:
        forgot = await folderaudit.ask_as_admin(
            args, folder, "joined-forget", JoinedKeyReply, JoinedKeyRequest(machine=name),
            what="machine remove",
        )  # fmt: skip
    except VerbFailed as e:
        if e.code == "not_found":
            raise CliError(
                f"machine {name} has no credentials in {folder.root} and did not join with a token"
            ) from None
        raise CliError(f"machine {name} joined with a token, and its key is the controller's "
                       f"to give: {e}") from None  # fmt: skip
    with registry.locked(folder) as users:
        users.revoke_key(forgot.public)
        users.save()
    return f"key {forgot.public}, which it joined with"


COMMANDS = {
    ("machine", "add"): cmd_machine_add,
    ("machine", "remove"): cmd_machine_remove,
    ("label",): cmd_label,
    ("drain",): cmd_drain,
    ("undrain",): cmd_undrain,
    ("dev", "place"): cmd_dev_place,
}
