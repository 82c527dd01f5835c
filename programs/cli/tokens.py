"""`mesh token create [--control] [--tier N] [--label K=V]... [--ttl D] [--uses N] [--site
NAME]` / `mesh token list` / `mesh token revoke ID`: join tokens, what a new machine presents to
join the mesh with one command (`mesh join TOKEN`, coming), an admin's to make and revoke
(docs/operations.md, Join tokens).

`create` prints one line, the token (mesh/tokens.py says its format): the secret is made here
and only its SHA-256 goes to the controller; the NATS servers and the CA's fingerprint it
carries are this command's own (its `--nats-url` or MESH_NATS_URL, its `--ca`, MESH_CA or the
CA its credentials file carries), so give it the URLs the new machine reaches."""

import argparse
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from rich.markup import escape
from rich.table import Table

from mesh import config, tokens
from mesh.auth import creds as credentials
from mesh.model import (
    TOKEN_TTL_MOST,
    TOKEN_USES_MOST,
    TokenCreated,
    TokenCreateRequest,
    TokenInfo,
    TokenListReply,
    TokenListRequest,
    TokenRevokeReply,
    TokenRevokeRequest,
    labels_said,
)
from mesh.names import InvalidName, check_name
from programs.cli.args import LIMIT_HELP, Parser, count, label, tier
from programs.cli.client import CliError, listed, verb, where
from programs.cli.output import console, print_json, whole

TTL = "1h"
_SPAN = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def ttl(text: str) -> float:
    """`--ttl`: 90s, 15m, 1h, 7d (a bare number: seconds), from 1s to 30d."""
    m = _SPAN.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a duration (like 90s, 15m, 1h, 7d)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is shorter than 1s")
    if seconds > TOKEN_TTL_MOST:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than {TOKEN_TTL_MOST / 86400:g}d")
    return seconds


def uses(text: str) -> int:
    """`--uses`: how many machines may join with the token, 1 to TOKEN_USES_MOST."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= n <= TOKEN_USES_MOST:
        raise argparse.ArgumentTypeError(f"{n} is out of range (1 to {TOKEN_USES_MOST})")
    return n


def site(text: str) -> str:
    try:
        return check_name(text, field="site")
    except InvalidName as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parsers(verbs: Any, common: argparse.ArgumentParser) -> None:
    token = verbs.add_parser(
        "token", parents=[common], help="join tokens: how a new machine joins (an admin's)"
    )
    token_verbs = token.add_subparsers(dest="token_command", metavar="COMMAND", parser_class=Parser)
    token_verbs.required = True
    create = token_verbs.add_parser(
        "create", parents=[common], help="make a join token and print it (one line)"
    )
    create.add_argument(
        "--control", action="store_true",
        help="the machine joins the control plane (labelled role=control)",
    )  # fmt: skip
    create.add_argument("--tier", type=tier, default=None, help="its rollout tier 0-9 (2)")
    create.add_argument(
        "--label", type=label, action="append", default=[], metavar="K=V", help="repeatable"
    )
    create.add_argument(
        "--ttl", type=ttl, default=ttl(TTL), metavar="D",
        help=f"how long it can be used: 90s, 15m, 1h, 7d ({TTL}; at most "
        f"{TOKEN_TTL_MOST / 86400:g}d)",
    )  # fmt: skip
    create.add_argument(
        "--uses", type=uses, default=1, metavar="N",
        help=f"how many machines may join with it (1; at most {TOKEN_USES_MOST})",
    )  # fmt: skip
    create.add_argument("--site", type=site, metavar="NAME", help="the machine's site (kept)")
    listing = token_verbs.add_parser(
        "list", parents=[common], help="the join tokens, newest first (never their secrets)"
    )
    listing.add_argument("--limit", type=count, metavar="N", help=LIMIT_HELP)
    revoke = token_verbs.add_parser("revoke", parents=[common], help="revoke a join token")
    revoke.add_argument("id", metavar="ID")


def _mesh_ca(creds: str | None) -> tuple[str, str]:
    """The mesh's CA certificate (PEM) as this command knows it, and where it came from: --ca
    (or MESH_CA, or $MESH_FILES/ca.pem), else the one its credentials file carries."""
    given = config.ca()
    if given:
        try:
            return Path(given).read_text(), given
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"the mesh's CA {given}: {getattr(e, 'strerror', None) or e}") from None
    if creds:
        held = credentials.read(creds)
        if held.ca:
            return held.ca, f"the CA in {creds}"
    raise CliError(
        "the mesh's CA is not known (--ca, MESH_CA, or a credentials file that carries it): "
        "a token names it, so that a new machine checks the servers before it trusts them"
    )


async def cmd_token_create(args: argparse.Namespace) -> None:
    labels = dict(args.label)
    if args.control and labels.get("role", "control") != "control":
        raise CliError(f"--label role={labels['role']}: --control labels the machine role=control")
    url, creds = where(args)
    pem, ca_from = _mesh_ca(creds)
    fingerprint = tokens.ca_sha256(pem, where=ca_from)
    secret = tokens.new_secret()
    urls = config.servers(url)
    # Checked before the controller records anything: a token that cannot be written is none.
    tokens.JoinToken(urls=urls, ca_sha256=fingerprint, id="0" * 12, secret=secret).encode()
    req = TokenCreateRequest(
        secret_sha256=tokens.secret_hash(secret), ttl=args.ttl, uses=args.uses,
        labels=labels, control=args.control, site=args.site,
    )  # fmt: skip
    if args.tier is not None:
        req = msgspec.structs.replace(req, tier=args.tier)
    made = await verb(args, "token-create", TokenCreated, req, changes=True)
    # The bearer credentials a joining machine connects with before it has its own (None: the
    # controllers cannot sign: `mesh join` with this token says so).
    text = tokens.JoinToken(urls=urls, ca_sha256=fingerprint, id=made.id, secret=secret,
                            extra=made.bearer).encode()  # fmt: skip
    if args.json:
        shown = msgspec.structs.asdict(made)
        shown.pop("bearer")  # in the token already
        print_json({"token": text, **shown})
        return
    if made.bearer is None:
        print("mesh: the controllers have no NATS signing key (the secret mesh-nats-signer): "
              "no machine can join with this token until an admin sets it",
              file=sys.stderr)  # fmt: skip
    print(text)


COLUMNS = ("ID", "STATE", "EXPIRES", "USES LEFT", "TIER", "LABELS", "SITE", "BY", "USED BY")


def _state(t: TokenInfo, now: datetime) -> str:
    if t.revoked is not None:
        return "revoked"
    if t.expires <= now:
        return "expired"
    return "used up" if t.uses_left == 0 else "usable"


async def cmd_token_list(args: argparse.Namespace) -> None:
    reply = await listed(args, "token-list", TokenListReply, TokenListRequest(), want=args.limit)
    if args.json:
        print_json(whole(reply))
        return
    now = datetime.now(UTC)
    table = Table(box=None, header_style="bold")
    for column in COLUMNS:
        table.add_column(column)
    for t in reply.tokens:
        labels = labels_said(t.labels, none="-")
        table.add_row(
            t.id, _state(t, now), t.expires.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"),
            str(t.uses_left), str(t.tier), escape(labels), escape(t.site or "-"), escape(t.by),
            escape(", ".join(t.used_by) or "-"),
        )  # fmt: skip
    out = console()
    out.print(table if reply.tokens else "no join tokens (`mesh token create` makes one)")
    if args.limit is not None and len(reply.tokens) >= args.limit:
        out.print(f"the newest {args.limit}; raise --limit to see older tokens")


async def cmd_token_revoke(args: argparse.Namespace) -> None:
    if not re.fullmatch(r"[0-9a-f]{12}", args.id):
        raise CliError(
            f"ID: {args.id[:40]!r} is not a join token's id (12 hex digits: `mesh token list`)"
        )
    reply = await verb(
        args, "token-revoke", TokenRevokeReply, TokenRevokeRequest(id=args.id), changes=True
    )
    if args.json:
        print_json(reply)
        return
    print(f"join token {reply.id} revoked: no machine joins with it any more")


COMMANDS = {
    ("token", "create"): cmd_token_create,
    ("token", "list"): cmd_token_list,
    ("token", "revoke"): cmd_token_revoke,
}
