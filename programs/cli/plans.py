"""`mesh plan [ID] [--follow]`, `mesh tier`, and following a plan after push/assign `--wait`.

Following shows the plan's progress as its holder tells it (mesh/client/progress.py: the plan's
summary and each tier's counts on mesh.plan.<id>; `plan` asked at the start and the end, after a
quiet while and when the seat changes hands): machines done of all, each tier's, and, from what
`plan` answered, the steps in progress and how long they have taken. It outlives a controller
handover and a takeover. It exits 0 when the plan is done and 1, naming the machine and the
reason, when it fails or is reverted.
"""

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

import anyio
import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
)
from rich.table import Table
from rich.text import Text

from mesh.client.asking import connected
from mesh.client.progress import ASK_WITHIN, FINAL, follow_plan
from mesh.model import (
    PlanProgress,
    PlanReply,
    PlanRequest,
    PlanSettings,
    PlansReply,
    PlansRequest,
    PlanStep,
    PlanSummary,
    PlanTier,
    TierReply,
    TierRequest,
)
from programs.cli import render as tables
from programs.cli.client import CliError, listed, verb, where
from programs.cli.output import console, more, print_json, whole

PLANS_LISTED = 20  # `mesh plan` without --limit: the newest 20


async def _plan(args: argparse.Namespace, plan_id: int, *, want: int | None = None) -> PlanReply:
    """The plan with its steps (every page of them; the first `want`)."""
    args.timeout = max(getattr(args, "timeout", 5.0), ASK_WITHIN)
    asked = PlanRequest(id=plan_id, changes=getattr(args, "changes", False))
    return await listed(args, "plan", PlanReply, asked, want=want)


def _elapsed(since: datetime | None, until: datetime | None = None) -> str:
    if since is None:
        return ""
    return f"{((until or datetime.now(UTC)) - since).total_seconds():.1f}s"


def doing(p: PlanSummary | PlanReply | PlanProgress, *, left: bool = True) -> str:
    """A plan's state in words, with what steering adds: held (and how to approve it), paused
    (and how to resume it), reverting or being cancelled, a tier soaking (`left`: with the
    time left now; else until when, which does not change as it is shown again)."""
    if p.state == "held":
        return f"held, waiting for approval (mesh plan approve {p.id})"
    text = f"paused (mesh plan resume {p.id})" if p.state == "paused" else p.state
    if p.phase == "revert" and p.state not in FINAL:
        text += " (cancelling)" if p.cancelled else " (reverting)"
    if p.soak is not None and p.state not in FINAL:
        if left:
            more = max(0.0, (p.soak.until - datetime.now(UTC)).total_seconds())
            text += f", tier {p.soak.tier} soaking ({more:.0f}s left)"
        else:
            text += f", tier {p.soak.tier} soaking until {p.soak.until.astimezone():%H:%M:%S}"
    return text


def ended(p: PlanReply) -> str:
    """How a plan that did not end done ended, in one line."""
    why = p.cancelled if p.state in ("cancelled", "rejected") else None
    return f"plan {p.id} {p.state}: {why or p.failure or 'no reason recorded'}"


def _approvals(out: Console, p: PlanReply) -> None:
    """Who approved it, and while it is held, how many more it needs and which approvals the
    catalog made void (given for what the plan did before it changed)."""
    counted = [a for a in p.approvals if not a.void]
    if p.state == "held" and p.approvals_needed:
        more = p.approvals_needed - len(counted)
        out.print(f"  approvals: {len(counted)} of {p.approvals_needed}; {more} more by "
                  "operators other than its author and those who approved")  # fmt: skip
    for a in p.approvals:
        void = (f" [yellow]void: given for {a.digest[:19]}…, the plan changed since[/]"
                if a.void else "")  # fmt: skip
        out.print(f"  approved by {escape(a.by)} at {a.at.astimezone():%H:%M:%S}{void}")


def _step_state(p: PlanReply, s: PlanStep) -> str:
    """A step's state in words: one an ended plan never reached is `not reached` (its machine
    kept what it had), not `pending`."""
    return "not reached" if s.state == "pending" and p.state in FINAL else s.state


def _rollout(s: PlanSettings) -> str:
    """The plan's canary, soak and pauses, when it has any."""
    said = [f"canary {s.canary}"] if s.canary is not None else []
    said += [f"soak {s.soak:g}s"] if s.soak else []
    said += [f"pause after tier {', '.join(map(str, s.pause_after))}"] if s.pause_after else []
    return ", ".join(said)


def render(out: Console, p: PlanReply, *, want: int | None = None) -> None:
    head = f"[bold]plan {p.id}[/] {p.trigger} {p.subject}: {escape(doing(p))}"
    head += f", by {p.by or '?'}, {_elapsed(p.started or p.created, p.finished)}"
    out.print(head)
    if p.note:
        out.print(f"  note: {escape(p.note)}")
    if p.digest:  # held: what an approval binds to
        out.print(f"  digest: {p.digest} (mesh plan approve {p.id} --digest {p.digest})")
    _approvals(out, p)
    if p.cancelled:
        out.print(f"  {escape(p.cancelled)}")
    if p.failure:
        out.print(f"  [red]{escape(p.failure)}[/]", markup=True)
    if _rollout(p.settings):
        out.print(f"  rollout: {_rollout(p.settings)}")
    for b in p.builds:
        out.print(f"  bundle {b.bundle} {b.digest[:19]} ({'built' if b.built else 'cached'})")
    table = Table(box=None, header_style="bold")
    for column in ("TIER", "MACHINE", "STATE", "TOOK", "BEFORE", "AFTER", "ERROR"):
        table.add_column(column)
    for s in p.steps:
        state = _step_state(p, s) + (" (reverted)" if s.reverted and s.state != "reverted" else "")
        table.add_row(
            str(s.tier), s.machine, state, _elapsed(s.started, s.finished) if s.started else "-",
            (s.before or "(none)")[7:19], s.after[7:19], s.error or "",
        )  # fmt: skip
    out.print(table)
    for s in p.steps:
        if s.changes is not None:  # asked for (`--changes`): what each machine gets
            tables.declaration_changes(
                out, s.machine, before=s.before, after=s.after, changes=s.changes
            )
    if p.state == "held" and not any(s.changes is not None for s in p.steps):
        out.print(f"  what it changes on each machine: mesh plan {p.id} --changes")
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
            str(p.id), doing(p).split(" (mesh plan")[0], p.trigger, p.subject, p.by or "-",
            f"{p.done}/{p.machines}", p.created.strftime("%Y-%m-%d %H:%M:%S"),
            p.failure or p.cancelled or "",
        )  # fmt: skip
    out.print(table)
    more(out, shown=len(r.plans), total=r.total, want=want, what="plan")


def _tier_line(t: PlanTier, steps: list[PlanStep]) -> str:
    """A tier's line: its state, and from `steps` (what `plan` answered last; none when only
    told) the machines applying, with how long, or the first that failed."""
    mine = [s for s in steps if s.tier == t.tier]
    busy = [s for s in mine if s.state == "applying"]
    failed = [s for s in mine if s.state == "failed"]
    text = f"tier {t.tier} {t.state}"
    if busy:
        shown = ", ".join(f"{s.machine} {_elapsed(s.started)}" for s in busy[:3])
        text += f": applying {shown}" + (f" (+{len(busy) - 3})" if len(busy) > 3 else "")
    if failed:
        text += f": {failed[0].machine} failed"
    return text


def _head(p: PlanReply | PlanProgress, *, left: bool = True) -> str:
    return f"plan {p.id} {p.trigger} {p.subject}: {doing(p, left=left)}"


async def follow(args: argparse.Namespace, plan_id: int) -> PlanReply:
    """Show the plan's progress until it ends; the last state."""
    url, creds = where(args)
    timeout = max(getattr(args, "timeout", 5.0), ASK_WITHIN)
    terminal = not args.json and sys.stdout.isatty()
    shown = _Bars(console(), plan_id) if terminal else _Lines(quiet=args.json)
    try:
        async with connected(url=url, creds=creds, what="plan") as nc:
            with shown:
                return await follow_plan(nc, url=url, plan_id=plan_id, show=shown.show,
                                         timeout=timeout)  # fmt: skip
    except (KeyboardInterrupt, anyio.get_cancelled_exc_class()):
        # Ctrl-C stops the following, not the plan: the holder goes on with it.
        sys.stderr.write(
            f"\nplan {plan_id} goes on without this command: `mesh plan {plan_id} --follow` "
            f"follows it again, `mesh plan cancel {plan_id}` cancels it\n"
        )
        raise


class _Took(ProgressColumn):
    """How long the plan has been followed, on its own line, counting as the display refreshes
    (what the holder tells may come seconds apart)."""

    def render(self, task: Task) -> Text:
        took = task.elapsed if task.fields.get("timed") else None
        return Text("" if took is None else f"{took:.0f}s")


class _Soaking(ProgressColumn):
    """The time a soak has left, counting down as the display refreshes."""

    def render(self, task: Task) -> Text:
        soak = task.fields.get("soak")
        if soak is None:
            return Text("")
        left = max(0.0, (soak.until - datetime.now(UTC)).total_seconds())
        return Text(f"soak: {left:.0f}s left")


class _Bars:
    """On a terminal: the plan's line (machines done of all) and a line per tier, redrawn with
    each state shown."""

    def __init__(self, out: Console, plan_id: int) -> None:
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), _Took(), _Soaking(),
                                  console=out)  # fmt: skip
        self._plan = self._progress.add_task(f"plan {plan_id}", total=1, timed=True)
        self._tiers: dict[int, TaskID] = {}

    def __enter__(self) -> "_Bars":
        self._progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._progress.stop()

    def show(self, p: PlanReply | PlanProgress) -> None:
        if isinstance(p, PlanReply):
            done, machines = sum(s.state in ("done", "skipped") for s in p.steps), len(p.steps)
            steps = p.steps
        else:
            done, machines, steps = p.done, p.machines, []
        self._progress.update(self._plan, description=_head(p, left=False),
                              total=max(machines, 1), completed=done,
                              soak=p.soak if p.state not in FINAL else None)  # fmt: skip
        for t in p.tiers:
            if t.tier not in self._tiers:
                self._tiers[t.tier] = self._progress.add_task("", total=t.total)
            self._progress.update(self._tiers[t.tier], description=_tier_line(t, steps),
                                  total=t.total, completed=t.done)  # fmt: skip


class _Lines:
    """Not a terminal: a line per change (none with --json): the plan's state; each tier's count
    as the holder tells it; each step's state as `plan` answers it."""

    def __init__(self, *, quiet: bool) -> None:
        self._quiet = quiet
        self._said: dict[str, str] = {}  # what was last said of the plan, a tier, a machine

    def __enter__(self) -> "_Lines":
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def _new(self, key: str, text: str) -> bool:
        if self._said.get(key) == text:
            return False
        self._said[key] = text
        return True

    def show(self, p: PlanReply | PlanProgress) -> None:
        lines = []
        head = _head(p)
        end = p.state in FINAL
        # Said again only when it changes: a soak's end, not the seconds it has left.
        if not end and self._new("plan", _head(p, left=False)):
            lines.append(head)
        if isinstance(p, PlanProgress):
            for t in p.tiers:
                text = f"  tier {t.tier} {t.state}: {t.done} of {t.total} machine(s) done"
                if self._new(f"tier {t.tier}", text):
                    lines.append(text)
        else:
            for s in p.steps:
                state = _step_state(p, s) + (
                    " reverted" if s.reverted and s.state != "reverted" else ""
                )
                if self._new(f"machine {s.machine}", state):
                    ended = s.finished and s.started
                    took = f" in {_elapsed(s.started, s.finished)}" if ended else ""
                    why = f": {s.error}" if s.error and s.state in ("failed", "skipped") else ""
                    lines.append(f"  tier {s.tier} {s.machine} {state}{took}{why}")
        if end and self._new("plan", _head(p, left=False)):
            lines.append(head)  # the end after the steps that led to it
        if not self._quiet and lines:
            sys.stdout.write("".join(line + "\n" for line in lines))
            sys.stdout.flush()


def outcome(p: PlanReply) -> None:
    """Exit non-zero, in one line, when the plan did not end done."""
    if p.state != "done":
        raise CliError(ended(p))


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
        # Skipped (drained, or down): not changed by this plan, and said so.
        skipped = [s.machine for s in p.steps if s.state == "skipped"]
        but = f", {len(skipped)} skipped ({', '.join(skipped[:5])})" if skipped else ""
        changed = len(p.steps) - len(skipped)  # the skipped are not among those it changed
        console().print(f"plan {p.id} done: {changed} machine(s) in {took}{but}")
    elif p.state == "cancelled":
        back = sum(s.reverted for s in p.steps)
        console().print(f"plan {p.id} cancelled: {back} machine(s) got their previous "
                        "declarations back")  # fmt: skip


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
