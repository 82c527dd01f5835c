"""`mesh dev creds [--dir DIR] [--hosts N] [--export OUT] [--nats-host HOST]`: the credentials
`mesh dev up` issues, without starting anything, for a mesh whose pieces run elsewhere
(compose.dev.yaml's one-shot `creds` service).

The mesh's CA is made first (DIR/tls), so every credentials file carries it. With `--nats-host`
(repeatable: the names clients reach the server by, e.g. `nats` in compose), a certificate for
the nats-server is issued beside its authorization block (DIR/nats/server.pem, server.key 0600).

It issues what is missing, exactly as `mesh dev up` does (operators `admin`, `viewer` and
`tools`, the controllers, hosts `node-1`…`node-N`, node-1 the builder), keeps what exists, and
writes the nats-server authorization block to include (`DIR/nats/auth.conf`). With
`--export OUT`, each identity's file is also copied to `OUT/<identity>/nats.creds` (0600), so a
container can mount its own credentials and nobody else's. The key of the secrets in the store
(DIR/keys/secrets.key, mesh/auth/secretkeys.py) is made if missing and, with `--export`, copied
for the controllers alone (`OUT/controller/secrets.key`, 0600)."""

import argparse
from pathlib import Path
from typing import Any

import msgspec

from mesh.auth import creds, registry, secretkeys, tls
from mesh.auth.policy import Kind, Role
from mesh.meshdir import DEFAULT_DIR, MeshDir
from mesh.paths import write_private
from programs.cli.args import Parser
from programs.cli.output import print_json

EXPORT_FILE = "nats.creds"  # the name a host gives a process's credentials ($MESH_FILES)
KEY_FILE = secretkeys.FILE_NAME  # the controllers' key of the secrets, beside their credentials


class Issued(msgspec.Struct):
    dir: str
    auth: str  # the authorization block for nats-server to include
    creds: dict[str, str]  # identity -> its credentials file in DIR
    exported: dict[str, str]  # identity -> its copy under --export (empty without it)
    ca: str = ""  # the mesh's CA certificate, which every credentials file carries
    server_cert: str = ""  # the nats-server's certificate, with --nats-host


def add_parser(dev_verbs: Any, common: argparse.ArgumentParser) -> None:
    p: Parser = dev_verbs.add_parser(
        "creds", parents=[common], help="issue the dev mesh's credentials, start nothing"
    )
    p.add_argument(
        "--dir", type=Path, default=DEFAULT_DIR, help=f"the mesh's folder ({DEFAULT_DIR})"
    )
    p.add_argument("--hosts", type=_hosts, default=3, metavar="N", help="hosts node-1..N (3)")
    p.add_argument(
        "--export", type=Path, default=None, metavar="OUT",
        help="also copy each identity's file to OUT/<identity>/nats.creds",
    )  # fmt: skip
    p.add_argument(
        "--nats-host", action="append", default=[], metavar="HOST",
        help="issue the nats-server a certificate for HOST (repeatable), in DIR/nats",
    )  # fmt: skip


def _hosts(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= n <= 999:
        raise argparse.ArgumentTypeError(f"{n} is out of range (1 to 999)")
    return n


def identities(hosts: int) -> list[tuple[Kind, str, Role | None, bool]]:
    """(kind, name, role, builder) of every identity `mesh dev up` issues for `hosts` hosts."""
    found: list[tuple[Kind, str, Role | None, bool]] = [
        ("operator", "admin", "admin", False),
        ("operator", "viewer", "viewer", False),
        ("operator", "tools", "tools", False),
        ("controller", registry.CONTROLLER, None, False),
    ]
    found += [("host", f"node-{i}", None, i == 1) for i in range(1, hosts + 1)]
    return found


class Held(msgspec.Struct, frozen=True):
    path: Path
    who: str  # as its file's header says: "host node-1 (builder)"


def issue(folder: MeshDir, hosts: int) -> dict[str, Held]:
    """Issue what is missing, keep what exists, write users.json and auth.conf."""
    issued: dict[str, Held] = {}
    tls.ensure_ca(folder.tls)
    with registry.locked(folder) as users:
        for kind, name, role, builder in identities(hosts):
            path = users.ensure(kind, name, role=role, builder=builder)
            user = users.get(kind, name)
            assert user is not None  # ensure just put it there
            issued[name] = Held(path=path, who=user.describe())
        users.save()
    return issued


def export(issued: dict[str, Held], out: Path) -> dict[str, str]:
    """Copy each file to OUT/<identity>/nats.creds, atomically and readable by its owner only."""
    copies: dict[str, str] = {}
    for name, held in issued.items():
        found = creds.read(held.path)
        if found.seed is None:  # never: mesh issues nkey seeds
            raise registry.AuthError(f"{held.path}: not an nkey credentials file")
        target = out / name / EXPORT_FILE
        # The file as issued, every line kept: the controllers' key (without it a host takes
        # announcements and builds unsigned) and the operator it is (without it the operator's
        # changes go where the server refuses them).
        write_private(target, held.path.read_bytes())
        copies[name] = str(target)
    return copies


async def cmd_dev_creds(args: argparse.Namespace) -> None:
    folder = MeshDir(args.dir)
    issued = issue(folder, args.hosts)
    ring = secretkeys.read(folder.secrets_key) if folder.secrets_key.exists() else None
    ring = ring or secretkeys.make(folder.secrets_key)
    exported = export(issued, args.export) if args.export is not None else {}
    if args.export is not None:
        secretkeys.write(args.export / registry.CONTROLLER / KEY_FILE, ring)
    cert = folder.nats / "server.pem"
    if args.nats_host:
        hosts = [*args.nats_host, "127.0.0.1", "localhost"]
        tls.issue_server(folder.tls, cert, folder.nats / "server.key", name="nats", hosts=hosts)
    result = Issued(
        dir=str(folder.root),
        auth=str(folder.auth_conf),
        creds={name: str(held.path) for name, held in issued.items()},
        exported=exported,
        ca=str(folder.ca),
        server_cert=str(cert) if args.nats_host else "",
    )
    if args.json:
        print_json(result)
        return
    print(f"credentials in {folder.creds}: {', '.join(issued)}")
    print(f"nats-server authorization (to include): {folder.auth_conf}")
    print(f"the mesh's CA: {folder.ca} (every credentials file carries it)")
    if args.nats_host:
        print(f"nats-server certificate for {', '.join(args.nats_host)}: {cert}")
    if exported:
        print(f"copied to {args.export}/<identity>/{EXPORT_FILE}")


COMMANDS = {("dev", "creds"): cmd_dev_creds}
