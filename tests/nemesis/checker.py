"""The nemesis's checker: a pure function of a run's history (tests/nemesis/history.py), the
store's final state among its lines. No I/O, so hand-made histories test it.

What it verifies (issue 29):
- one holder per epoch: status answers, the bus's seat record and the store's `seat.taken`
  never name two holders for one epoch, and every plan write in the store's audit carries the
  epoch of the last takeover before it (a holder acts only under its own epoch);
- epochs only rise: the bus's seat record (by revision) and each machine's declarations put on
  the bus; the store's takeovers and audited seat rows; each host's `applied` reports;
- no machine applies an older epoch's declaration after a newer one (good applies);
- every acknowledged push, assign and secret is in the final store, every plan there is final
  and every plan an operation was given is there;
- every status request is answered within the command line's timeout, except during a
  documented fault (the bus's majority gone, every store down) or within RECOVERY after it,
  counted apart; a fault kind the lead has declared under repair (`under_repair`, say
  `block-nats/holder`) is counted apart too;
- every piece exited within EXIT_WITHIN seconds of SIGTERM;
- no command hung: a change the harness had to kill (`timeout`: still running long after its
  plan could have ended, tests/nemesis/workload.py's CHANGE_BOUND) is a violation too.
"""

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STATUS_TIMEOUT = 5.0  # the command line's `--timeout` default for a read (programs/cli/client.py)
SLACK = 0.5  # an answer's own way back after the deadline (the client's last try)
RECOVERY = 10.0  # after a documented fault heals: the seat taken again, the client reconnected
EXIT_WITHIN = 10.0
LATE = 1.0  # one try's bound: an answer after it means a try was lost (or a slow holder)
# Faults after which a request may go unanswered (docs/operations.md, failure table): the
# bus's majority gone (JetStream and the seat's record stop), every store down (nobody can
# hold the seat until the standby is promoted).
DOCUMENTED = frozenset({"nats-majority", "pg-failover"})
FINAL_PLAN_STATES = frozenset({"done", "failed", "reverted", "cancelled"})


@dataclass
class Violation:
    # one-holder, epochs-rise, stale-apply, lost-write, plan-not-final, status, exit, hung
    kind: str
    t: float
    message: str


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    # Status requests not answered in time, by the faults active then (`kind/role`).
    unanswered: Counter = field(default_factory=Counter)
    excused: Counter = field(default_factory=Counter)  # ... during documented faults
    under_repair: Counter = field(default_factory=Counter)  # ... faults the lead excused
    answered: int = 0
    late: int = 0  # answered in time, but after more than LATE seconds (a lost try or more)
    slowest: float = 0.0
    faults: Counter = field(default_factory=Counter)  # by kind/role

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, kind: str, t: float, message: str) -> None:
        self.violations.append(Violation(kind, t, message))


def check(history: list[dict[str, Any]], *, under_repair: Iterable[str] = ()) -> Report:
    report = Report()
    final = next((line for line in history if line["type"] == "final"), None)
    _one_holder_per_epoch(history, final, report)
    _epochs_rise(history, final, report)
    _applies_rise(history, report)
    _writes_kept(history, final, report)
    _status_answered(history, report, frozenset(under_repair))
    _hung(history, report)
    _exits(history, report)
    return report


def _one_holder_per_epoch(history: list[dict], final: dict | None, report: Report) -> None:
    named: dict[int, dict[str, float]] = defaultdict(dict)  # epoch -> holder -> first seen
    for line in history:
        if line["type"] == "epoch" and line["source"] in ("status", "bus") and line.get("holder"):
            named[line["epoch"]].setdefault(line["holder"], line["t"])
    end = history[-1]["t"] if history else 0.0
    for seat in (final or {}).get("seats", []):
        named[seat["epoch"]].setdefault(seat["holder"], end)
    for epoch, holders in sorted(named.items()):
        if len(holders) > 1:
            report.add("one-holder", min(holders.values()),
                       f"epoch {epoch} held by {sorted(holders)}")  # fmt: skip
    seat = None
    for i, row in enumerate((final or {}).get("audit", [])):
        if row["tbl"] == "seats":
            seat = row["epoch"]
        elif row["seat"] != seat or row["epoch"] not in (None, seat):
            what = f"audit row {i} ({row['tbl']} {row.get('what') or ''})"
            report.add("one-holder", end, f"{what} written with epoch {row['epoch']}, seat "
                       f"{row['seat']}, after epoch {seat} took")  # fmt: skip


def _rising(values: list[tuple[float, int]], what: str, kind: str, report: Report,
            *, strictly: bool = False) -> None:  # fmt: skip
    top = None
    for t, epoch in values:
        if top is not None and (epoch < top or (strictly and epoch == top)):
            report.add(kind, t, f"{what}: epoch {epoch} after {top}")
        top = epoch if top is None else max(top, epoch)


def _epochs_rise(history: list[dict], final: dict | None, report: Report) -> None:
    epochs = [line for line in history if line["type"] == "epoch"]
    bus = sorted((e for e in epochs if e["source"] == "bus"), key=lambda e: e["revision"])
    _rising([(e["t"], e["epoch"]) for e in bus], "the bus's seat record", "epochs-rise", report)
    declared: dict[str, list[tuple[float, int]]] = defaultdict(list)
    hosts: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in epochs:
        if e["source"] == "declared":
            declared[e["machine"]].append((e["t"], e["epoch"]))
        elif e["source"] == "applied" and e.get("step") != "fence":
            # A fence refusal names the stale epoch it refused, not one the host took.
            hosts[e["machine"]].append((e["t"], e["epoch"]))
    for machine, seen in sorted(declared.items()):
        _rising(seen, f"{machine}'s declaration put on the bus", "epochs-rise", report)
    for machine, seen in sorted(hosts.items()):
        _rising(seen, f"{machine}'s applied reports", "epochs-rise", report)
    end = history[-1]["t"] if history else 0.0
    final = final or {}
    _rising([(end, s["epoch"]) for s in final.get("seats", [])], "the store's seat.taken",
            "epochs-rise", report, strictly=True)  # fmt: skip
    audited = [(end, r["epoch"]) for r in final.get("audit", []) if r["tbl"] == "seats"]
    _rising(audited, "the store's seat row", "epochs-rise", report)


def _applies_rise(history: list[dict], report: Report) -> None:
    good: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for line in history:
        if line["type"] == "epoch" and line["source"] == "applied" and line.get("ok"):
            good[line["machine"]].append((line["t"], line["epoch"]))
    for machine, seen in sorted(good.items()):
        _rising(seen, f"{machine} applied a declaration", "stale-apply", report)


def _writes_kept(history: list[dict], final: dict | None, report: Report) -> None:
    end = history[-1]["t"] if history else 0.0
    if final is None:
        report.add("lost-write", end, "no final state was read from the store")
        return
    versions = {tuple(v) for v in final.get("versions", [])}
    assigned = {tuple(a) for a in final.get("assignments", [])}
    secrets: dict[str, int] = final.get("secrets", {})
    plans: dict[str, str] = {str(k): v for k, v in final.get("plans", {}).items()}
    invoked = {line["id"]: line for line in history if line["type"] == "op"
               and line["phase"] == "invoke"}  # fmt: skip
    for line in history:
        if line["type"] != "op" or line["phase"] != "ok" or line["op"] == "status":
            continue
        asked, t = invoked.get(line["id"], {}), line["t"]
        if line["op"] == "push" and line.get("version"):
            if (asked.get("module"), line["version"]) not in versions:
                report.add("lost-write", t, f"push {line['id']}: {asked.get('module')} "
                           f"version {line['version']} acknowledged, not in the store")  # fmt: skip
        elif line["op"] == "assign":
            for machine in asked.get("machines", []):
                if (asked.get("module"), machine) not in assigned:
                    report.add("lost-write", t, f"assign {line['id']}: {asked.get('module')} "
                               f"on {machine} acknowledged, not in the store")  # fmt: skip
        elif line["op"] == "secret":
            name, version = asked.get("name"), line.get("version")
            if name not in secrets or (version is not None and secrets[name] < int(version)):
                report.add("lost-write", t, f"secret {line['id']}: {name} version {version} "
                           f"acknowledged, the store has {secrets.get(name)}")  # fmt: skip
        plan = line.get("plan")
        if plan is not None and str(plan) not in plans:
            report.add("lost-write", t, f"{line['op']} {line['id']}: plan {plan} acknowledged, "
                       "not in the store")  # fmt: skip
    for plan, state in sorted(plans.items(), key=lambda p: int(p[0])):
        if state not in FINAL_PLAN_STATES:
            report.add("plan-not-final", end, f"plan {plan} ended the run {state}")


def _windows(history: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, kind/role) of every fault; one that never ended lasts to the history's end."""
    starts: dict[int, dict] = {}
    found = []
    for line in history:
        if line["type"] != "fault":
            continue
        if line["phase"] == "start":
            starts[line["id"]] = line
        elif line["id"] in starts:
            s = starts.pop(line["id"])
            found.append((s["t"], line["t"], f"{s['kind']}/{s.get('role', s['target'])}"))
    end = history[-1]["t"] if history else 0.0
    found += [(s["t"], end, f"{s['kind']}/{s.get('role', s['target'])}") for s in starts.values()]
    return found


def _handovers(history: list[dict]) -> list[tuple[float, float, str]]:
    """(asked, answered) of every planned handover the workload asked, as a window: a status
    lost while one ran is labelled with it too (it is no fault, but it explains)."""
    asked = {line["id"]: line["t"] for line in history if line["type"] == "op"
             and line["op"] == "handover" and line["phase"] == "invoke"}  # fmt: skip
    ended = [line for line in history if line["type"] == "op" and line["phase"] != "invoke"]
    return [(asked[e["id"]], e["t"], "handover (planned)") for e in ended if e["id"] in asked]


def _status_answered(history: list[dict], report: Report, under_repair: frozenset[str]) -> None:
    windows = _windows(history)
    report.faults.update(w[2] for w in windows)
    windows += _handovers(history)
    invoked = {line["id"]: line["t"] for line in history if line["type"] == "op"
               and line["op"] == "status" and line["phase"] == "invoke"}  # fmt: skip
    for line in history:
        if line["type"] != "op" or line["op"] != "status" or line["phase"] == "invoke":
            continue
        start = invoked.get(line["id"], line["t"])
        took = line["t"] - start
        if line["phase"] == "ok" and took <= STATUS_TIMEOUT + SLACK:
            report.answered += 1
            report.late += took > LATE
            report.slowest = max(report.slowest, took)
            continue
        end = start + max(took, STATUS_TIMEOUT)
        active = sorted({kind for s, e, kind in windows if s <= end and start <= e})
        # A documented fault excuses the RECOVERY after its heal too (the seat taken again).
        recent = [(s, e + RECOVERY, kind) for s, e, kind in windows]
        documented = sorted({kind for s, e, kind in recent if s <= end and start <= e
                             and kind.split("/")[0] in DOCUMENTED})  # fmt: skip
        repaired = [k for k in active if k in under_repair]
        label = ", ".join(active) or "no fault"
        if documented:
            report.excused[", ".join(documented)] += 1
        elif repaired:
            report.under_repair[", ".join(repaired)] += 1
        else:
            report.unanswered[label] += 1
            how = "answered" if line["phase"] == "ok" else line["phase"]
            report.add("status", start, f"status {line['id']} sent at {start:.1f}s {how} after "
                       f"{took:.1f}s ({line.get('error', '')}); faults then: {label}")  # fmt: skip


def _hung(history: list[dict], report: Report) -> None:
    for line in history:
        if line["type"] == "op" and line["op"] != "status" and line["phase"] == "timeout":
            report.add("hung", line["t"], f"{line['op']} {line['id']} was still running when "
                       f"the harness killed it ({line.get('error', '')})")  # fmt: skip


def _exits(history: list[dict], report: Report) -> None:
    for line in history:
        if line["type"] == "exit" and (line["seconds"] is None or line["seconds"] > EXIT_WITHIN):
            took = "did not exit" if line["seconds"] is None else f"took {line['seconds']:.1f}s"
            report.add("exit", line["t"], f"{line['piece']} {took} after SIGTERM "
                       f"(bound {EXIT_WITHIN:g}s)")  # fmt: skip


def around(history: list[dict], t: float, *, seconds: float = 5.0, most: int = 40) -> list[dict]:
    """The lines within `seconds` of `t` (the nearest `most`), in order."""
    near = [line for line in history if abs(line["t"] - t) <= seconds and line["type"] != "final"]
    near.sort(key=lambda line: abs(line["t"] - t))
    return sorted(near[:most], key=lambda line: line["t"])
