"""One nemesis run: the cluster up, the workload and the seeded faults for a while, everything
healed, the store's final state read, every piece stopped with SIGTERM, the history checked."""

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
import netns
from faults import install_audit  # the store's audit of every write (tests/faults.py)

from mesh.client.asking import VerbFailed, ask, connected
from mesh.model import StatusReply

from .checker import EXIT_WITHIN, LATE, Report, around, check
from .cluster import CONTROLLERS, HOSTS, MEMBERS, NATS, Cluster, ClusterError, until
from .history import History
from .inject import Injector
from .schedule import Fault, schedule
from .workload import CHANGE_BOUND, Workload, watcher

SETTLE = 150.0  # after the faults: every plan final, within this
STREAMS = 2  # status streams at once


@dataclass
class Outcome:
    seed: int
    seconds: float
    faults: list[Fault]
    history: History
    report: Report
    restarts: int


async def fleet_up(c: Cluster) -> None:
    """ctl-0 holding with every host up, then ctl-1 standing by."""
    c.start_controller(CONTROLLERS[0])
    for name in HOSTS:
        c.start_host(name)

    said: list[str] = []

    async def up(standbys: int):
        try:
            async with connected(url=c.url, creds=None, what="status") as nc:
                s = await ask(nc, url=c.url, verb="status", reply=StatusReply, timeout=2)
        except VerbFailed as e:
            said[:] = [str(e)]
            return None
        return s.seat and s.nodes.up == len(HOSTS) and len(s.standbys) >= standbys

    try:
        await until(lambda: up(0), within=90, what="a holder with every host up")
        c.start_controller(CONTROLLERS[1])
        await until(lambda: up(1), within=60, what=f"{CONTROLLERS[1]} standing by")
    except ClusterError as e:
        raise ClusterError(f"{e} (status said: {said[0] if said else 'nothing amiss'})") from None


async def final_state(c: Cluster) -> dict:
    """What the store holds at the end, on the primary of then."""
    conn = await asyncpg.connect(c.direct(c.primary), timeout=10)
    try:
        seats = await conn.fetch("SELECT epoch, detail->>'holder' AS holder FROM events"
                                 " WHERE kind = 'seat.taken' ORDER BY id")  # fmt: skip
        audit = await conn.fetch("SELECT tbl, what, epoch, seat FROM fault_audit ORDER BY id")
        plans = await conn.fetch("SELECT id, state FROM plans")
        secrets = await conn.fetch("SELECT name, version FROM secrets")
        assigned = await conn.fetch("SELECT module, machine FROM assignments")
        versions = await conn.fetch("SELECT module, version FROM module_versions")
    finally:
        await conn.close()
    return {
        "seats": [dict(r) for r in seats], "audit": [dict(r) for r in audit],
        "plans": {str(r["id"]): r["state"] for r in plans},
        "secrets": {r["name"]: r["version"] for r in secrets},
        "assignments": [list(r) for r in assigned], "versions": [list(r) for r in versions],
    }  # fmt: skip


async def settled(c: Cluster) -> None:
    """Every plan final (or SETTLE passed: the checker then says which is not)."""

    async def final() -> bool:
        try:
            conn = await asyncpg.connect(c.direct(c.primary), timeout=5)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return False
        try:
            open_ = await conn.fetchval("SELECT count(*) FROM plans WHERE state IN"
                                        " ('pending', 'building', 'rolling')")  # fmt: skip
        finally:
            await conn.close()
        return open_ == 0

    try:
        await until(final, within=SETTLE, what="every plan final")
    except ClusterError as e:
        c.history.add("note", what=str(e))


async def faults_in_turn(injector: Injector, faults: list[Fault], t0: float,
                         say: Callable[[str], None]) -> None:  # fmt: skip
    for fault in faults:
        wait = t0 + fault.at - time.monotonic()
        if wait > 0:
            await anyio.sleep(wait)  # ok: the schedule's start time
        say(f"  {time.monotonic() - t0:6.1f}s {fault.kind} {fault.role} "
            f"({injector.target(fault)}) for {fault.lasts:g}s")  # fmt: skip
        await injector.run(fault)


async def workload_and_faults(c: Cluster, faults: list[Fault], seed: int, seconds: float,
                              say: Callable[[str], None]) -> None:  # fmt: skip
    injector = Injector(c)
    work = Workload(c, injector, seed)
    nc = await watcher(c)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(c.supervise)
            tg.start_soon(work.watch, nc)
            say("setting up: the secret, module nem on every machine, module extra")
            await work.prepare()
            for _ in range(STREAMS):
                tg.start_soon(work.status_stream)
            tg.start_soon(work.changes)
            t0 = time.monotonic()
            c.history.add("note", what=f"workload started; {len(faults)} faults over {seconds:g}s")
            await faults_in_turn(injector, faults, t0, say)
            left = t0 + seconds - time.monotonic()
            if left > 0:
                await anyio.sleep(left)  # ok: the run's length, faults or not
            say("faults over, every one healed; letting the changes end")
            work.stopping.set()
            with anyio.move_on_after(CHANGE_BOUND):
                await work.changes_ended.wait()
            await settled(c)
            tg.cancel_scope.cancel()
    finally:
        await nc.close()


async def run(seed: int, minutes: float, folder: Path, *, say: Callable[[str], None] = print,
              under_repair: tuple[str, ...] = ()) -> Outcome:  # fmt: skip
    """A run of `minutes` with the faults of `seed`; the history is FOLDER/history.jsonl."""
    seconds = minutes * 60
    faults = schedule(seed, seconds)
    folder.mkdir(parents=True, exist_ok=True)
    history = History(folder / "history.jsonl")
    history.add("note", what=f"seed {seed}, {minutes:g} minutes",
                schedule=[str(f) for f in faults])  # fmt: skip
    netns.remove_stale()
    ca_before = os.environ.get("MESH_CA")
    with netns.network(MEMBERS) as net, net.inside("client"):
        c = Cluster(net, folder, history, sys.executable)
        os.environ["MESH_CA"] = c.ca  # the library's client, as `source DIR/env` gives it
        try:
            say(f"starting {len(NATS)} nats-servers, PostgreSQL pg1 + pg2, 2 controllers, "
                f"{len(HOSTS)} hosts in network namespaces ({folder})")  # fmt: skip
            await c.start_nats()
            await c.start_store()
            await fleet_up(c)
            await install_audit(c.direct(c.primary))
            await workload_and_faults(c, faults, seed, seconds, say)
            history.add("final", **(await final_state(c)))
            say(f"stopping every piece with SIGTERM (each within {EXIT_WITHIN:g}s)")
            for piece, took in (await c.stop_all(EXIT_WITHIN)).items():
                history.add("exit", piece=piece, seconds=took)
        finally:
            c.kill_all()
            history.close()
            if ca_before is None:
                os.environ.pop("MESH_CA", None)
            else:
                os.environ["MESH_CA"] = ca_before
    report = check(history.lines, under_repair=under_repair)
    return Outcome(seed, seconds, faults, history, report, c.restarts)


def describe(o: Outcome) -> list[str]:
    """The run's result in lines: the figures, and for each violation the seed, the schedule
    and the history around it."""
    r = o.report
    lines = [
        f"seed {o.seed}, {o.seconds / 60:g} minutes, {len(o.faults)} faults "
        f"({', '.join(f'{k} {n}' for k, n in sorted(r.faults.items()))})",
        f"status: {r.answered} answered within the timeout ({r.late} after more than "
        f"{LATE:g}s, the slowest in {r.slowest:.2f}s); "
        f"unanswered: {dict(r.unanswered) or 0}; during documented faults: "
        f"{dict(r.excused) or 0}; under repair: {dict(r.under_repair) or 0}",
        f"pieces restarted by their supervisor: {o.restarts}",
        f"violations: {len(r.violations)}" + (
            " (" + ", ".join(f"{k} {n}" for k, n in sorted(_kinds(r).items())) + ")"
            if r.violations else ""),
    ]  # fmt: skip
    if r.violations:
        lines += ["", f"seed {o.seed}; schedule:", *(f"  {f}" for f in o.faults)]
        for v in r.violations[:10]:
            lines += ["", f"VIOLATION {v.kind} at {v.t:.1f}s: {v.message}", "history around it:"]
            lines += [f"  {json.dumps(line, default=str)}" for line in around(o.history.lines, v.t)]
        if len(r.violations) > 10:
            lines.append(f"... and {len(r.violations) - 10} more (history: {o.history.path})")
    return lines


def _kinds(r: Report) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in r.violations:
        counts[v.kind] = counts.get(v.kind, 0) + 1
    return counts
