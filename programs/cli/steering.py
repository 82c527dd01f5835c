"""`mesh plan approve|pause|resume|cancel|reject ID [--wait]`, and `--hold` for push, assign and
unassign: the operator's hand on a plan (docs/operations.md, Steering a change)."""

import argparse
import getpass
import re
from typing import Any

import msgspec

from mesh.model import NOTE_MOST, SteerReply, SteerRequest
from programs.cli import plans
from programs.cli.client import CliError, verb
from programs.cli.output import console, print_json, whole

# The command's word -> the verb it asks (docs/verbs.md).
VERBS = {
    "approve": "plan-approve",
    "pause": "plan-pause",
    "resume": "plan-resume",
    "cancel": "plan-cancel",
    "reject": "plan-reject",
}
# How a followed plan ends well after each word (`pause` is not followed: a paused plan waits).
ENDS = {"approve": "done", "resume": "done", "cancel": "cancelled"}


def hold_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hold", action="store_true",
        help="record the plan held: no machine changes until `mesh plan approve ID`",
    )  # fmt: skip


def digest_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--digest", type=plan_digest, metavar="D",
        help="approve: only if the plan still does what `mesh plan ID` showed (its digest)",
    )  # fmt: skip


def plan_digest(text: str) -> str:
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", text):
        raise argparse.ArgumentTypeError(
            f"{text[:80]!r} is not a digest (sha256: and 64 hex digits)"
        )
    return text


def reason_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reason", type=reason, metavar="TEXT",
        help="reject: why, in a line (the plan and the audit keep it)",
    )  # fmt: skip


def reason(text: str) -> str:
    if len(text) > NOTE_MOST or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise argparse.ArgumentTypeError(
            f"one line of at most {NOTE_MOST} characters, without control characters"
        )
    return text


def wait_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait", action="store_true",
        help="approve, resume, cancel: follow the plan to its end (exit 1 if it ends otherwise "
        "than done, or cancelled for cancel)",
    )  # fmt: skip


async def cmd_steer(args: argparse.Namespace, what: list[str]) -> None:
    word = what[0]
    if len(what) != 2 or not what[1].isdigit():
        raise CliError(f"usage: mesh plan {word} ID")
    plan_id = int(what[1])
    digest = getattr(args, "digest", None)
    if digest is not None and word != "approve":
        raise CliError(f"--digest: only `mesh plan approve ID` takes it, not `{word}`")
    why = getattr(args, "reason", None)
    if why is not None and word != "reject":
        raise CliError(f"--reason: only `mesh plan reject ID` takes it, not `{word}`")
    body = SteerRequest(id=plan_id, by=getpass.getuser(), digest=digest, reason=why or "")
    reply = await verb(args, VERBS[word], SteerReply, body, changes=True)
    # An approval that leaves the plan held (it waits for more, `mesh policy`) ends nothing.
    if not getattr(args, "wait", False) or word not in ENDS or reply.state == "held":
        print_json(reply) if args.json else console().print(reply.message)
        return
    if not args.json:
        console().print(reply.message)
    final = await plans.follow(args, plan_id)
    if args.json:
        document: dict[str, Any] = msgspec.to_builtins(reply)
        print_json({**document, "state": final.state, "outcome": whole(final)})
    else:
        plans.render_end(final)
    if final.state != ENDS[word]:
        raise CliError(plans.ended(final))
