"""Human output: tables and short summaries. `--json` bypasses all of this."""

import json
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mesh import version
from mesh.model import (
    ChangeReply,
    DiffReply,
    Facts,
    ModulesReply,
    NodesReply,
    PlanSummary,
    ProcessState,
    SecretsReply,
    StatusReply,
    ToolEntry,
)
from programs.cli.output import more


def _ago(when: datetime | None) -> str:
    if when is None:
        return "never"
    seconds = (datetime.now(UTC) - when).total_seconds()
    if seconds < 1:
        return "just now"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f}G" if n else "?"


def _limits(f: Facts) -> str:
    """What a machine can enforce of a process's limits (docs/modules.md, Process limits)."""
    if f.limits is None:
        return ""  # a host before limits
    cgroups = f" (cgroup {f.cgroups})" if f.cgroups else ""
    return f", limits: {','.join(f.limits) or 'none'}{cgroups}"


def _use(p: ProcessState) -> str:
    """A running process's use: memory and cpu (cores)."""
    if p.memory is None or p.pid is None:
        return ""
    return f" {_size(p.memory)} {p.cpu or 0:.2f}cpu"


def _life(p: ProcessState) -> str:
    """How long it has run, how often it was restarted, and what its failing check said."""
    said = []
    if p.since is not None and p.pid is not None:
        said.append(f"started {_ago(p.since)}")
    if p.restarts:
        said.append(f"{p.restarts} restart(s)" + (f", {p.in_a_row} in a row" if p.in_a_row else ""))
    if p.check:
        said.append(f"check: {p.check}")
    return escape(f" [{'; '.join(said)}]") if said else ""


def _size(n: int) -> str:
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _version(v: str | None) -> str:
    """A process's running mesh for a table; `?` when it did not say (an older mesh)."""
    return escape(version.short(v)) if v else "?"


def status(console: Console, s: StatusReply) -> None:
    seat = (
        f"held by {s.seat.holder} (pid {s.seat.pid} on {s.seat.host}, mesh "
        f"{_version(s.seat.version)}), epoch {s.seat.epoch}, since {_ago(s.seat.since)}"
        if s.seat
        else "no holder"
    )
    standbys = (
        ", ".join(f"{b.instance} (pid {b.pid}, mesh {_version(b.version)})" for b in s.standbys)
        or "none"
    )
    table = Table.grid(padding=(0, 2))
    table.add_row("[bold]seat[/]", f"mesh-controller {seat}")
    table.add_row("[bold]standbys[/]", standbys)
    table.add_row("[bold]nodes[/]", f"{s.nodes.total} total, {s.nodes.up} up, {s.nodes.down} down")
    table.add_row("[bold]plan[/]", "none in progress" if s.plan is None else plan_line(s.plan))
    if s.handover is not None and s.handover.from_:
        h = s.handover
        if h.planned and h.gap_ms is not None:
            how = f"handed over by {h.from_} to {h.to} {_ago(h.at)}, gap {h.gap_ms:g} ms"
        else:
            how = f"{h.to} took over from {h.from_} {_ago(h.at)} (it did not hand over)"
        table.add_row("[bold]last handover[/]", how)
    for warning in s.seat.warnings if s.seat else []:
        table.add_row("[bold yellow]warning[/]", escape(warning))
    console.print(table)


def plan_line(p: PlanSummary) -> str:
    where = f", tier {p.tier}" if p.tier is not None else ""
    doing = ("cancelling" if p.cancelled else "reverting") if p.phase == "revert" else p.state
    if p.soak is not None:  # steering: canaries (or a tier) soaking
        where = f", tier {p.soak.tier} soaking ({p.soak.left:.0f}s left)"
    return f"{p.id} {p.trigger} {p.subject}: {doing}{where}, {p.done}/{p.machines} machine(s) done"


def nodes(console: Console, r: NodesReply, *, want: int | None = None) -> None:
    if not r.nodes:
        console.print("no machines have registered yet")
        return
    table = Table(box=None, header_style="bold")
    columns = ("NAME", "TIER", "STATE", "VERSION", "LAST SEEN", "LABELS", "SYSTEM", "PROCESSES")
    for column in columns:
        table.add_column(column)
    for n in r.nodes:
        system = (
            f"{n.facts.os}/{n.facts.arch} {n.facts.cpus}cpu {_bytes(n.facts.memory)}"
            + (f", {n.facts.container_engine}" if n.facts.container_engine else ", no containers")
            + _limits(n.facts)
            if n.facts
            else "?"
        )
        labels = ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-"
        procs = (
            ", ".join(
                f"{p.name}{' (new version)' if p.trial else ''} {p.state}"
                f"{' healthy' if p.healthy else ''}{f' pid {p.pid}' if p.pid else ''}{_use(p)}"
                f"{f' ({escape(p.reason)})' if p.reason else ''}"
                f"{f' last said: {escape(p.said)}' if p.said else ''}{_life(p)}"
                for p in n.processes
            )
            or "-"
        )
        if n.digest_wanted and n.digest_applied != n.digest_wanted and n.drained:
            procs += f" (drained: wants {n.digest_wanted[7:19]}, keeps what it runs)"
        elif n.digest_wanted and n.digest_applied != n.digest_wanted and n.up:
            procs += f" (stopped at {n.apply_error})" if n.apply_error else " (applying)"
        state = (
            ("[green]up[/]" if n.up else "[red]down[/]")
            + (", [yellow]drained[/]" if n.drained else "")
            + (", [yellow]noisy[/]" if n.noisy else "")
        )
        table.add_row(
            n.name, str(n.tier), state, _version(n.version), _ago(n.last_seen), labels, system,
            procs,
        )  # fmt: skip
    console.print(table)
    more(console, shown=len(r.nodes), total=r.total, want=want, what="machine")


CHANGED_SHOWN = 20  # machines a change's output names; `mesh plan ID` lists every one


def change(console: Console, r: ChangeReply) -> None:
    console.print(r.message)  # it names the plan, or says nothing changes
    for machine in r.machines[:CHANGED_SHOWN]:
        console.print(f"  ~ {machine}")
    left = max(r.changed, len(r.machines)) - min(len(r.machines), CHANGED_SHOWN)
    if left > 0:
        console.print(f"  … and {left:,} more (mesh plan {r.plan} lists them)")


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def diff(console: Console, r: DiffReply, *, want: int | None = None) -> None:
    changing = max(r.total, len(r.machines))
    console.print(f"module {r.module} {r.version[:19]}: {changing} machine(s) would change")
    for name in r.builds:
        console.print(f"  would build bundle {name} first")
    for m in r.machines:
        declaration_changes(console, m.machine, before=m.before, after=m.after, changes=m.changes)
    more(console, shown=len(r.machines), total=r.total, want=want, what="machine")


def declaration_changes(
    console: Console, machine: str, *, before: str | None, after: str, changes: list[Any]
) -> None:
    """What a machine's declaration changes, from digest `before` to `after`: each process,
    file, account... added, removed or changed, and the fields that change."""
    console.print(f"[bold]{machine}[/] {before[:19] if before else '(none)'} -> {after[:19]}")
    for c in changes:
        console.print(f"  {c['op']} {c['kind']} {c['name']}", markup=False)
        for field, (old, new) in sorted(c.get("fields", {}).items()):
            console.print(f"      {field}: {_short(old)} -> {_short(new)}", markup=False)


ASSIGNED_SHOWN = 10  # machines a module's row names; the rest are counted (`--json` has all)


def _assigned(machines: list[str]) -> str:
    if len(machines) <= ASSIGNED_SHOWN:
        return ", ".join(machines) or "-"
    shown = ", ".join(machines[:ASSIGNED_SHOWN])
    return f"{shown} and {len(machines) - ASSIGNED_SHOWN:,} more ({len(machines):,} machines)"


def modules(console: Console, r: ModulesReply, *, want: int | None = None) -> None:
    if not r.modules:
        console.print("no modules have been pushed yet")
        return
    table = Table(box=None, header_style="bold")
    columns = (
        "MODULE",
        "VERSION",
        "PUSHED",
        "BY",
        "ASSIGNED TO",
        "PROCESSES",
        "TOOLS",
        "CONTAINERS",
    )
    for column in columns:
        table.add_column(column)
    for m in r.modules:
        table.add_row(
            m.name, f"{m.number} ({m.version[:19]})" if m.number else m.version[7:19],
            _ago(m.pushed_at), m.pushed_by or "-",
            _assigned(m.assigned), ", ".join(m.processes) or "-", ", ".join(m.tools) or "-",
            ", ".join(m.containers) or "-",
        )  # fmt: skip
    console.print(table)
    more(console, shown=len(r.modules), total=r.total, want=want, what="module")


def secrets(console: Console, r: SecretsReply, *, want: int | None = None) -> None:
    if not r.secrets:
        console.print("no secrets are set (mesh secret set NAME)")
        return
    table = Table(box=None, header_style="bold")
    for column in ("SECRET", "VERSION", "SET", "BY", "NAMED BY", "MAY NAME IT"):
        table.add_column(column)
    for e in r.secrets:
        table.add_row(
            escape(e.name), str(e.version), _ago(e.at), escape(e.by or "-"),
            escape(", ".join(e.modules) or "-"), escape(e.allowed or "admins' modules"),
        )  # fmt: skip
    console.print(table)
    more(console, shown=len(r.secrets), total=r.total, want=want, what="secret")


def tools(console: Console, found: list[ToolEntry], *, machine: str | None = None) -> None:
    if not found:
        where = f"on {machine}" if machine else "in the fleet"
        console.print(f"no tools {where} (a module's [tool.NAME] tables, once assigned and ready)")
        return
    table = Table(box=None, header_style="bold")
    for column in ("MACHINE", "SERVER", "TOOL", "DESCRIPTION"):
        table.add_column(column)
    for t in found:
        line = " ".join(t.description.split())
        line = line if len(line) <= 80 else line[:77] + "..."
        if not t.up:
            line = f"[red](machine down)[/] {escape(line)}"
        elif t.state != "ready":
            line = f"[yellow]({escape(t.state)})[/] {escape(line)}"
        else:
            line = escape(line)
        table.add_row(escape(t.machine), escape(t.server), escape(t.name), line)
    console.print(table)
