"""`mesh plan [ID] [--follow]`, `mesh tier`, and following a plan after push/assign `--wait`.

Following polls the `plan` verb (twice a second) and shows each tier's progress: machines done
of total, the steps in progress and how long they have taken. It outlives a controller handover:
each poll is retried over "no responders" up to its own deadline. It exits 0 when the plan is
done and 1, naming the machine and the reason, when it fails or is reverted.
"""

import argparse
import sys
import time
from datetime import UTC, datetime
from typing import Any

import anyio
import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table

from mesh.model import PlanReply, PlanRequest, PlansReply, PlansRequest, TierReply, TierRequest
from programs.cli import render as tables
from programs.cli.client import CliError, listed, verb
from programs.cli.output import console, more, print_json, whole

FINAL = ("done", "failed", "reverted")
POLL_EVERY = 0.5
POLL_TIMEOUT = 30.0  # one poll, across a handover or a takeover
PLANS_LISTED = 20  # `mesh plan` without --limit: the newest 20


async def _plan(args: argparse.Namespace, plan_id: int, *, want: int | None = None) -> PlanReply:
    """The plan with its steps (every page of them; the first `want`)."""
    args.timeout = max(getattr(args, "timeout", 5.0), POLL_TIMEOUT)
    return await listed(args, "plan", PlanReply, PlanRequest(id=plan_id), want=want)


def _elapsed(since: datetime | None, until: datetime | None = None) -> str:
    if since is None:
        return ""
    return f"{((until or datetime.now(UTC)) - since).total_seconds():.1f}s"


def render(out: Console, p: PlanReply, *, want: int | None = None) -> None:
    head = f"[bold]plan {p.id}[/] {p.trigger} {p.subject}: {p.state}"
    if p.phase == "revert" and p.state not in FINAL:
        head += " (reverting)"
    head += f", by {p.by or '?'}, {_elapsed(p.started or p.created, p.finished)}"
    out.print(head)
    if p.failure:
        out.print(f"  [red]{p.failure}[/]", markup=True)
    for b in p.builds:
        out.print(f"  bundle {b.bundle} {b.digest[:19]} ({'built' if b.built else 'cached'})")
    table = Table(box=None, header_style="bold")
    for column in ("TIER", "MACHINE", "STATE", "TOOK", "BEFORE", "AFTER", "ERROR"):
        table.add_column(column)
    for s in p.steps:
        state = s.state + (" (reverted)" if s.reverted and s.state != "reverted" else "")
        table.add_row(
            str(s.tier), s.machine, state, _elapsed(s.started, s.finished) if s.started else "-",
            (s.before or "(none)")[7:19], s.after[7:19], s.error or "",
        )  # fmt: skip
    out.print(table)
    more(out, shown=len(p.steps), total=p.total, want=want, what="step")


def _listing(out: Console, r: PlansReply, *, want: int | None) -> None:
    if not r.plans:
        out.print("no plans yet")
        return
    table = Table(box=None, header_style="bold")
    for column in ("PLAN", "STATE", "TRIGGER", "SUBJECT", "BY", "MACHINES", "CREATED", "ERROR"):
        table.add_column(column)
    for p in r.plans:
        table.add_row(
            str(p.id), p.state + (" (reverting)" if p.phase == "revert" and p.state not in FINAL
                                  else ""),
            p.trigger, p.subject, p.by or "-", f"{p.done}/{p.machines}",
            p.created.strftime("%Y-%m-%d %H:%M:%S"), p.failure or "",
        )  # fmt: skip
    out.print(table)
    more(out, shown=len(r.plans), total=r.total, want=want, what="plan")


def _tier_line(p: PlanReply, tier: int) -> str:
    mine = [s for s in p.steps if s.tier == tier]
    busy = [s for s in mine if s.state == "applying"]
    failed = [s for s in mine if s.state == "failed"]
    state = next((t.state for t in p.tiers if t.tier == tier), "pending")
    text = f"tier {tier} {state}"
    if busy:
        shown = ", ".join(f"{s.machine} {_elapsed(s.started)}" for s in busy[:3])
        text += f": applying {shown}" + (f" (+{len(busy) - 3})" if len(busy) > 3 else "")
    if failed:
        text += f": {failed[0].machine} failed"
    return text


async def follow(args: argparse.Namespace, plan_id: int) -> PlanReply:
    """Show the plan's progress until it ends; the last state."""
    out = console()
    started = time.monotonic()
    if args.json or not sys.stdout.isatty():
        return await _follow_lines(args, plan_id, quiet=args.json)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[took]}"))  # fmt: skip
    with Progress(*columns, console=out, transient=False) as progress:
        tasks: dict[int, TaskID] = {}
        header = progress.add_task(f"plan {plan_id}", total=1, took="")  # all machines
        while True:
            p = await _plan(args, plan_id)
            took = f"{time.monotonic() - started:.0f}s"
            what = f"plan {p.id} {p.trigger} {p.subject}: {p.state}"
            done = sum(s.state in ("done", "skipped") for s in p.steps)
            progress.update(header, description=what + (" (reverting)" if p.phase == "revert"
                                                        else ""), took=took,
                            total=max(len(p.steps), 1), completed=done)  # fmt: skip
            for t in p.tiers:
                if t.tier not in tasks:
                    tasks[t.tier] = progress.add_task("", total=t.total, took="")
                progress.update(tasks[t.tier], description=_tier_line(p, t.tier), completed=t.done)
            if p.state in FINAL:
                return p
            await anyio.sleep(POLL_EVERY)  # ok: polling a remote state at a fixed rate


async def _follow_lines(args: argparse.Namespace, plan_id: int, *, quiet: bool) -> PlanReply:
    """Not a terminal: one line per change of a step's state (none with --json)."""
    seen: dict[str, str] = {}
    last_state = ""
    while True:
        p = await _plan(args, plan_id)
        lines = []
        head = f"plan {p.id} {p.trigger} {p.subject}: {p.state}"
        if p.phase == "revert" and p.state not in FINAL:
            head += " (reverting)"
        if head != last_state and p.state not in FINAL:
            lines.append(head)
        for s in p.steps:
            state = s.state + (" reverted" if s.reverted and s.state != "reverted" else "")
            if seen.get(s.machine) != state:
                seen[s.machine] = state
                took = f" in {_elapsed(s.started, s.finished)}" if s.finished and s.started else ""
                why = f": {s.error}" if s.error and s.state in ("failed", "skipped") else ""
                lines.append(f"  tier {s.tier} {s.machine} {state}{took}{why}")
        if head != last_state and p.state in FINAL:
            lines.append(head)  # the end after the steps that led to it
        last_state = head
        if not quiet:
            for line in lines:
                sys.stdout.write(line + "\n")
            sys.stdout.flush()
        if p.state in FINAL:
            return p
        await anyio.sleep(POLL_EVERY)  # ok: polling a remote state at a fixed rate


def outcome(p: PlanReply) -> None:
    """Exit non-zero, in one line, when the plan did not end done."""
    if p.state != "done":
        raise CliError(f"plan {p.id} {p.state}: {p.failure or 'no reason recorded'}")


async def wait_for(args: argparse.Namespace, reply: Any) -> None:
    """After push/assign/unassign/secret set: print the reply, then follow its plan if asked."""
    if not getattr(args, "wait", False) or reply.plan is None:
        if args.json:
            print_json(reply)
        else:
            tables.change(console(), reply)
        return
    if not args.json:
        tables.change(console(), reply)
    final = await follow(args, reply.plan)
    if args.json:
        print_json({**msgspec.to_builtins(reply), "outcome": whole(final)})
    else:
        render_end(final)
    outcome(final)


def render_end(p: PlanReply) -> None:
    if p.state == "done":
        took = _elapsed(p.started, p.finished)
        console().print(f"plan {p.id} done: {len(p.steps)} machine(s) in {took}")


async def listing(args: argparse.Namespace) -> None:
    want = args.limit or PLANS_LISTED
    reply = await listed(args, "plans", PlansReply, PlansRequest(), want=want)
    if args.json:
        print_json(whole(reply))
    else:
        _listing(console(), reply, want=want)


async def show(args: argparse.Namespace, plan_id: int) -> None:
    if not args.follow:
        p = await _plan(args, plan_id, want=args.limit)
        print_json(whole(p)) if args.json else render(console(), p, want=args.limit)
        return
    final = await follow(args, plan_id)
    if args.json:
        print_json(whole(final))
    else:
        render(console(), final)
    outcome(final)


async def cmd_tier(args: argparse.Namespace) -> None:
    reply = await verb(
        args, "tier", TierReply, TierRequest(machine=args.machine, tier=args.tier), changes=True
    )
    if args.json:
        print_json(reply)
    else:
        console().print(f"{reply.machine}: tier {reply.was} -> {reply.tier}")
