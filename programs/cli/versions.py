"""`mesh history MODULE` and `mesh rollback MODULE [--to VERSION] [--wait]`: a module's versions,
each with the plan that last rolled it out and how that ended, and going back to one of them
through an ordinary plan (followed with `--wait` as a push's is)."""

import argparse
import getpass
import re
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mesh.model import (
    ChangeReply,
    HistoryReply,
    HistoryRequest,
    RollbackRequest,
    VersionDiffReply,
    VersionDiffRequest,
)
from mesh.names import check_name
from programs.cli import plans
from programs.cli.args import LIMIT_HELP, count
from programs.cli.client import listed, verb
from programs.cli.output import console, more, print_json, whole

# What the controller takes as a version's name (mesh.model.VersionWord); which names a version
# of the module, it says, listing the versions there are.
VERSION_WORD = re.compile(r"[A-Za-z0-9:]{1,80}")


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    history = verbs.add_parser(
        "history", parents=[common], help="a module's versions and how each rolled out"
    )
    history.add_argument("module", metavar="MODULE")
    history.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)
    history.add_argument(
        "--diff", nargs=2, type=version_word, metavar=("A", "B"),
        help="what changed from version A to version B (numbers, or digests)",
    )  # fmt: skip

    back = verbs.add_parser(
        "rollback", parents=[common], help="take a module back to an earlier version"
    )
    back.add_argument("module", metavar="MODULE")
    back.add_argument(
        "--to", metavar="VERSION", type=version_word,
        help="its number in `mesh history` (or its digest); the version before the current one "
        "without",
    )  # fmt: skip
    back.add_argument(
        "--wait", action="store_true",
        help="follow the plan to its end; exit non-zero if it fails or is reverted",
    )  # fmt: skip


def version_word(text: str) -> str:
    """`--to`: a number or a digest (or its prefix): refused here only when it could never be
    one (a sign, a space), naming the value, as the controller would refuse its shape."""
    if not VERSION_WORD.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a version number nor a digest (sha256:… or its hex digits)"
        )
    return text


async def cmd_history(args: argparse.Namespace) -> None:
    check_name(args.module, field="MODULE")
    if args.diff:
        a, b = args.diff
        request = VersionDiffRequest(module=args.module, a=a, b=b)
        diffed = await verb(args, "version-diff", VersionDiffReply, request)
        if args.json:
            print_json(diffed)
        else:
            render_diff(console(), diffed)
        return
    reply = await listed(
        args, "history", HistoryReply, HistoryRequest(module=args.module), want=args.limit
    )
    if args.json:
        print_json(whole(reply))
    else:
        render(console(), reply, want=args.limit)


def render(out: Console, r: HistoryReply, *, want: int | None = None) -> None:
    table = Table(box=None, header_style="bold")
    for column in ("VERSION", "DIGEST", "PUSHED", "BY", "PLAN", "STATE", "BUNDLES", "NOTE"):
        table.add_column(column)
    for v in r.versions:
        table.add_row(
            f"{v.version}{' (current)' if v.current else ''}", v.digest[:19],
            v.pushed.strftime("%Y-%m-%d %H:%M:%S"), escape(v.by or "-"),
            str(v.plan) if v.plan is not None else "-", v.state or "-",
            "kept" if v.kept else "pruned", escape(v.note),
        )  # fmt: skip
    out.print(f"[bold]{escape(r.module)}[/]: {r.total} version(s), newest first")
    out.print(table)
    more(out, shown=len(r.versions), total=r.total, want=want, what="version")


def render_diff(out: Console, r: VersionDiffReply) -> None:
    """module.toml's lines added in green and removed in red; the bundles whose bytes differ."""
    out.print(
        f"[bold]{escape(r.module)}[/]: version {r.a} ({r.a_digest[:19]}) -> version {r.b} "
        f"({r.b_digest[:19]})"
    )
    if not r.manifest and not r.bundles:
        out.print("  the same module.toml and bundles")
        return
    for line in r.manifest:
        style = {"+": "green", "-": "red", "@": "cyan"}.get(line[:1]) if line[:3] not in (
            "+++", "---") else "bold"  # fmt: skip
        out.print(escape(line), style=style, highlight=False)
    for b in r.bundles:
        out.print(f"bundle {escape(b.bundle)}: {(b.before or '(none)')[:19]} -> "
                  f"{(b.after or '(none)')[:19]}", highlight=False)  # fmt: skip


async def cmd_rollback(args: argparse.Namespace) -> None:
    check_name(args.module, field="MODULE")
    body = RollbackRequest(module=args.module, to=args.to, by=getpass.getuser())
    reply = await verb(args, "rollback", ChangeReply, body, changes=True)
    await plans.wait_for(args, reply)


COMMANDS = {
    ("history",): cmd_history,
    ("rollback",): cmd_rollback,
}
