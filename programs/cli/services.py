"""`mesh controller run|ready|migrate` and `mesh host run`: the services a machine runs (what a
module's process runs: services/controller/module.toml, services/host/module.toml). The
command line starts the services; the services never import the command line."""

import argparse
import sys
from pathlib import Path
from typing import Any

from mesh import config
from mesh.names import check_name
from programs.cli.args import METRICS_HELP, Parser, label, listen, tier
from programs.cli.client import CliError
from programs.cli.output import console, print_json


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    """`controller run|ready|migrate` (the controller's flags: one per setting it takes), then
    `host run`."""
    ctl = verbs.add_parser("controller", parents=[common], help="the controller service")
    ctl_verbs = ctl.add_subparsers(
        dest="controller_command", metavar="COMMAND", parser_class=Parser
    )
    ctl_verbs.required = True
    ctl_run = ctl_verbs.add_parser("run", parents=[common], help="hold the seat or stand by")
    ctl_run.add_argument("--database-url", metavar="URL", help="PostgreSQL (env MESH_DATABASE_URL)")
    ctl_run.add_argument("--instance", metavar="NAME", help="this controller's name")
    ctl_run.add_argument(
        "--system-creds", metavar="FILE",
        help="the NATS system account's kicker, to close a cut-off holder's connection at a "
        "takeover (env MESH_SYSTEM_CREDS; controllers only)",
    )  # fmt: skip
    ctl_run.add_argument(
        "--secrets-key-file", metavar="F",
        help="the key of the secrets (env MESH_SECRETS_KEY_FILE; $MESH_FILES/secrets.key)",
    )  # fmt: skip
    ctl_run.add_argument(
        "--down-after", type=int, default=3, metavar="N", help="missed beats before down (3)"
    )
    ctl_run.add_argument("--metrics", type=listen, metavar="ADDR:PORT", help=METRICS_HELP)
    # Read by mesh.config.events_kept, which names the flag (or variable) of a bad value.
    ctl_run.add_argument(
        "--events-max-age", metavar="AGE",
        help=f"events older than this are pruned: 90s, 12h, 30d or off "
        f"(env MESH_EVENTS_MAX_AGE; {config.EVENTS_MAX_AGE})",
    )  # fmt: skip
    ctl_run.add_argument(
        "--events-max-count", metavar="N",
        help=f"the newest N events are kept, or off (env MESH_EVENTS_MAX_COUNT; "
        f"{config.EVENTS_MAX_COUNT})",
    )  # fmt: skip
    ctl_run.add_argument(
        "--events-prune-every", metavar="SPAN",
        help=f"how often the holder prunes (env MESH_EVENTS_PRUNE_EVERY; "
        f"{config.EVENTS_PRUNE_EVERY})",
    )  # fmt: skip

    # Read by mesh.config.versions_kept, which names the flag (or variable) of a bad value.
    ctl_run.add_argument(
        "--versions-kept", metavar="N",
        help="the bundles of each module's newest N versions are kept for rollbacks, or off "
        f"(env MESH_VERSIONS_KEPT; {config.VERSIONS_KEPT})",
    )  # fmt: skip
    ctl_run.add_argument(
        "--versions-prune-every", metavar="SPAN",
        help="how often the holder deletes older versions' bundles (env "
        f"MESH_VERSIONS_PRUNE_EVERY; {config.VERSIONS_PRUNE_EVERY})",
    )  # fmt: skip

    ready = ctl_verbs.add_parser(
        "ready", parents=[common], help="exit 0 if this machine's controller holds or stands by"
    )
    ready.add_argument(
        "--file", type=Path, metavar="F", help="its readiness file ($MESH_FILES/ready)"
    )
    migrate = ctl_verbs.add_parser("migrate", parents=[common], help="bring the store's schema up")
    migrate.add_argument("--database-url", metavar="URL", help="PostgreSQL (env MESH_DATABASE_URL)")

    _host(verbs, common)


def _host(verbs: Any, common: argparse.ArgumentParser) -> None:
    host = verbs.add_parser("host", parents=[common], help="the host agent")
    host_verbs = host.add_subparsers(dest="host_command", metavar="COMMAND", parser_class=Parser)
    host_verbs.required = True
    host_run = host_verbs.add_parser("run", parents=[common], help="run this machine's agent")
    host_run.add_argument("--name", required=True, help="this machine's name")
    # The operator's (mesh machine add --tier --label, mesh tier, mesh label): a mesh with
    # credentials never takes them from a host; one without takes them at a first registration.
    host_run.add_argument(
        "--tier", type=tier, default=None, help="rollout tier 0-9 (a mesh without credentials)"
    )
    host_run.add_argument("--root", type=Path, default=None, help="confine the host to DIR (dev)")
    host_run.add_argument(
        "--label", type=label, action="append", default=[], metavar="K=V",
        help="repeatable (a mesh without credentials)",
    )  # fmt: skip
    host_run.add_argument(
        "--beat", type=float, default=1.0, metavar="S", help="heartbeat interval in seconds (1)"
    )
    host_run.add_argument("--metrics", type=listen, metavar="ADDR:PORT", help=METRICS_HELP)
    # Given by an agent to the new version of itself it starts (services/host/successor.py).
    host_run.add_argument("--successor-fd", type=int, default=None, help=argparse.SUPPRESS)


async def cmd_controller_ready(args: argparse.Namespace) -> None:
    from services.controller.seat import readiness

    path = args.file or readiness.default_file()
    if path is None:
        raise CliError("no readiness file: pass --file, or run where MESH_FILES is set")
    why = readiness.problem(path)
    if why:
        raise CliError(why)
    if not args.json:
        console().print("ready")


async def cmd_controller_migrate(args: argparse.Namespace) -> None:
    from mesh.store import db
    from mesh.store.migrate import migrate

    database_url = config.database_url(args.database_url)
    if not database_url:
        raise CliError("no database: set MESH_DATABASE_URL or pass --database-url")
    conn = await db.connect(database_url)
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    print_json({"applied": applied}) if args.json else console().print(
        f"migrations applied: {', '.join(map(str, applied))}" if applied else "schema up to date"
    )


async def cmd_controller_run(args: argparse.Namespace) -> None:
    # The command line starts the services; the services never import the command line.
    from services.controller.main import run

    database_url = config.database_url(args.database_url)
    if not database_url:
        raise CliError("no database: set MESH_DATABASE_URL or pass --database-url")
    if args.instance:
        check_name(args.instance, field="--instance")
    # The flags' values first: a mistyped flag is named before what the machine lacks.
    events = config.events_kept(
        max_age=args.events_max_age, max_count=args.events_max_count,
        every=args.events_prune_every,
    )  # fmt: skip
    versions = config.versions_kept(count=args.versions_kept, every=args.versions_prune_every)
    secrets_key = config.secrets_key_file(args.secrets_key_file)
    if not secrets_key:
        raise CliError(
            "no key for the secrets: set MESH_SECRETS_KEY_FILE or pass --secrets-key-file "
            "(mesh dev up and mesh init make DIR/keys/secrets.key)"
        )
    await run(
        nats_url=config.nats_url(
            getattr(args, "nats_url", None), config.creds(getattr(args, "creds", None))
        ),
        database_url=database_url,
        secrets_key=Path(secrets_key),
        instance=args.instance,
        creds=config.creds(getattr(args, "creds", None)),
        system_creds=config.system_creds(args.system_creds),
        signer_file=config.nats_signer_file(),
        down_after=args.down_after,
        metrics_on=args.metrics,
        events=events,
        versions=versions,
    )


async def cmd_host_run(args: argparse.Namespace) -> None:
    from services.host import successor
    from services.host.main import run

    check_name(args.name, field="--name")
    if not 0.05 <= args.beat <= 3600:
        raise CliError(f"--beat: {args.beat:g} is out of range (0.05 to 3600 seconds)")
    await run(
        name=args.name,
        nats_url=config.nats_url(
            getattr(args, "nats_url", None), config.creds(getattr(args, "creds", None))
        ),
        tier=args.tier,
        labels=dict(args.label),
        root=args.root,
        beat_interval=args.beat,
        creds=config.creds(getattr(args, "creds", None)),
        relaunch=successor.relaunch_args(sys.argv[1:]),
        successor_fd=args.successor_fd,
        metrics_on=args.metrics,
    )


COMMANDS = {
    ("controller", "run"): cmd_controller_run,
    ("controller", "ready"): cmd_controller_ready,
    ("controller", "migrate"): cmd_controller_migrate,
    ("host", "run"): cmd_host_run,
}
