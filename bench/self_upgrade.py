"""Benchmark: the mesh upgrading its own host agents through a plan, and where the time goes.

The pieces are real: `mesh dev up --hosts N --dir DIR --port 0` (programs/dev_up.py: one
nats-server, PostgreSQL, two controllers, hosts node-1..N, node-1 in tier 0 and the builder,
node-2 in tier 1, the rest in tier 2) started by the bench in a temporary folder, and the `mesh`
command line as an operator runs it (`mesh push DIR --wait --json`, with the admin's
credentials from DIR/creds). First the module `sleeper` is pushed (a `system` bundle /usr/bin,
`sleep 100000` as the account mesh-bench-sleeper, assigned to tiers 0, 1 and 2: one process on
every host; as root the host creates that system account the first time and it is kept, as the
tests keep theirs). Then `--rounds` rounds, each of two pushes, each followed to its end:

1. baseline: `sleeper` again with another value of an environment variable (BENCH_ROUND): a
   plan through every tier for a change that needs no new agent (each sleeper restarts).
2. agent upgrade: `services/host` from a new version of the mesh: a copy of this checkout's
   packages with a marker appended to mesh/version.py (as tests/helpers.py `mesh_copy` makes
   it), so each round is a new source and a new bundle. The controller asks the builder
   (node-1) to build the mesh bundle (services/host/builder.py, meshbuild.py: the packages and
   every dependency from the builder's environment, about 50 MiB); the plan then rolls it tier
   by tier: on each machine the running agent fetches the bundle from the object store and
   unpacks it (services/host/bundles.py), starts the new agent from it, and hands the machine
   over (services/host/successor.py); the step is done once the new agent has applied the
   declaration and reported. Round 1 replaces the agents `mesh dev up` started from the
   checkout; the later rounds replace agents that run from a bundle.

For every push it prints, from the push command's start (all wall-clock, one machine):
  push -> plan start: push -> recorded (the command's packing and upload, the controller's
    look at the source; the plan's `created`, recorded as `building` before the build), the
    build (recorded -> the builder's "built mesh-host/mesh: …" line: the bundle made and
    stored), built -> the plan's `started`;
  the plan from `started` to `finished` (`mesh plan ID`), each tier's span and the gap between
    tiers; the push command's exit after the plan's end (its polling);
  per machine, from its step's `started`: the host's log lines "bundle mesh:… stored" (fetch
    and unpack done), "starting the new host agent", the new agent's first line ("container
    engine …": its interpreter started, its modules imported, the engine probed), its "the old
    agent let go" (it connected and said ready; the old one stopped being the agent), "handed
    this machine over to the new agent" (the new agent adopted every process, serves, has
    registered and said running) and the step's `finished` (the new agent applied the
    declaration, which names its own bundle, and the controller heard its report). A
    baseline step has only its start and finish.
The log lines' own timestamps are whole seconds: the bench reads every log under DIR/logs
every 20 ms and timestamps each line as it appears (late by at most that, plus the write).
After every plan it asks `nodes` (what `mesh nodes --json` shows) and checks: every sleeper
kept its pid through an agent upgrade, every mesh-host pid changed, and every host reports the
new bundle's digest as its `version`. "cores" is how many cores the whole machine kept busy
from the push command's start to its exit (/proc/stat; everything on the machine counts) and
"cpu wait" the share of that time in which some runnable task waited for a CPU
(/proc/pressure/cpu).

Then, with the mesh idle, the fetch alone, `--fetches` times, with node-1's credentials (a
host's: the admin's may not answer the object store's flow control) and the last round's
mesh bundle: `mesh.blobs.get` as the agents call it; nats-py's `ObjectStore.get` with
`writeinto` (a BytesIO: the chunks are written, not concatenated), each with the CPU time
this process spent in it (user + system, getrusage); the sha256 of the bundle
(blobs.get computes it twice); `archive.members` (the checks, also the first pass of unpack),
`archive.unpack` into a new folder and the read-only pass of bundles.py (`_read_only`). Then
one `blobs.get` under cProfile, and one `ObjectStore.get` with `writeinto`: for each, the
functions with the most own time (`--top`).

Summary: p50 and max of each measure over rounds (and machines). Figures are printed, never
judged: nothing here fails on a timing (see docs/performance.md).

    .venv/bin/python bench/self_upgrade.py [--hosts 3] [--rounds 3] [--fetches 3] [--top 12]
                                           [--keep] [--deadline 1800]

Everything lives in a temporary folder (`--keep` keeps it: DIR with every piece's log);
`mesh dev up` runs in its own session and is stopped (SIGTERM: it stops hosts, their processes,
controllers, PostgreSQL and NATS) in a `finally`, then anything of DIR's still running is
killed and reported. The machine should be otherwise idle: the figures include every piece's
start-up and compile time (a new bundle holds no bytecode: the new agent compiles its modules
as it starts).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from common import (  # bench/common.py: what the benches share
    BenchError,
    CpuMeter,
    machine_line,
    run_or_exit,
    say,
)
from nats.aio.client import Client

from mesh import blobs, bus, subjects, wire
from mesh.client.pages import every_page
from mesh.embedded.children import Child, spawn, stop_agents, stop_supervised
from mesh.entry import command
from mesh.meshdir import MeshDir
from mesh.model import NodesReply, NodesRequest, PlanReply, PlanRequest
from mesh.modules import archive
from mesh.modules.meshsource import PACKAGES, PROJECT_FILE
from services.host import bundles

CHECKOUT = Path(__file__).resolve().parent.parent
MESH = command()
POLL_LOGS = 0.02  # seconds between two reads of the logs
READY_WITHIN = 180.0  # `mesh dev up` until its `ready` line
SETTLE_WITHIN = 60.0  # after a plan: until `nodes` shows what it should
ACCOUNT = "mesh-bench-sleeper"

SLEEPER = f"""\
[module]
name = "sleeper"
[bundle.bin]
kind = "system"
path = "/usr/bin"
[account.{ACCOUNT}]
[process.sleeper]
bundle = "bin"
command = ["sleep", "100000"]
account = "{ACCOUNT}"
env = {{ BENCH_ROUND = "%s" }}
[assign]
tiers = [0, 1, 2]
"""


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# --- the logs, timestamped as their lines appear ----------------------------------------------


@dataclass
class Line:
    at: float  # time.time() when the bench read it
    text: str


class Logs:
    """Every *.log under a folder, read every POLL_LOGS seconds; each new line kept with the
    wall-clock time it was read at."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lines: dict[str, list[Line]] = {}  # file stem -> its lines so far
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def read(self) -> None:
        now = time.time()
        for path in sorted(self.folder.glob("*.log")):
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            data = self._partial.pop(path, b"") + data
            *whole, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
            found = self.lines.setdefault(path.stem, [])
            found.extend(Line(now, raw.decode(errors="replace")) for raw in whole)

    async def run(self) -> None:
        while True:
            self.read()
            await asyncio.sleep(POLL_LOGS)

    def _matching(
        self, files: Iterable[str], pattern: str, *, after: float, before: float
    ) -> list[Line]:
        regex = re.compile(pattern)
        return [
            line
            for name in files
            for line in self.lines.get(name, [])
            if after <= line.at <= before and regex.search(line.text)
        ]

    def first(
        self, files: Iterable[str], pattern: str, *, after: float, before: float = float("inf")
    ) -> Line | None:
        """The first line (by the time it was read) of any of `files` matching `pattern`,
        read within [after, before]."""
        hits = self._matching(files, pattern, after=after, before=before)
        return min(hits, key=lambda line: line.at) if hits else None

    def last(
        self, files: Iterable[str], pattern: str, *, after: float, before: float
    ) -> Line | None:
        hits = self._matching(files, pattern, after=after, before=before)
        return max(hits, key=lambda line: line.at) if hits else None


# --- the mesh --------------------------------------------------------------------------------


def mesh_copy(folder: Path, marker: str) -> Path:
    """A copy of this checkout's mesh, marked (as tests/helpers.py `mesh_copy` makes it)."""
    for package in PACKAGES:
        shutil.copytree(
            CHECKOUT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(CHECKOUT / PROJECT_FILE, folder / PROJECT_FILE)
    with open(folder / "mesh" / "version.py", "a") as f:
        f.write(f"\nMARKER = {marker!r}  # a bench's version of the mesh\n")
    return folder


class Mesh:
    """`mesh dev up` in its own session, its folder, its logs, a connection as the admin."""

    def __init__(self, folder: Path, hosts: int) -> None:
        self.folder = folder
        self.dir = MeshDir(folder / "dev")
        self.hosts = [f"node-{i}" for i in range(1, hosts + 1)]
        self.logs = Logs(self.dir.root / "logs")
        self.child: Child | None = None
        self.nc: Client | None = None
        self.url = ""
        self.seen_pids: set[int] = set()  # every agent and sleeper pid, checked gone at the end

    @property
    def output(self) -> Path:
        return self.folder / "dev-up.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        env.update(
            MESH_NATS_URL=self.url, MESH_CA=str(self.dir.ca),
            MESH_CREDS=str(self.dir.creds / "admin.creds"), PYTHONUNBUFFERED="1",
        )  # fmt: skip
        return env

    async def start(self, hosts: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
        env["PYTHONUNBUFFERED"] = "1"
        argv = [*MESH, "dev", "up", "--hosts", str(hosts), "--dir", str(self.dir.root),
                "--port", "0"]  # fmt: skip
        self.child = await spawn("mesh dev up", argv, log=self.output, env=env, cwd=self.folder)
        deadline = time.monotonic() + READY_WITHIN
        while time.monotonic() < deadline:
            if not self.child.running:
                raise BenchError(f"mesh dev up exited ({self.child.proc.returncode}):\n"
                                 f"{self.child.tail(30)}")  # fmt: skip
            text = self.output.read_text(errors="replace") if self.output.exists() else ""
            found = re.search(r"^ready (\S+)$", text, re.M)
            if found:
                self.url = found.group(1)
                break
            await asyncio.sleep(0.2)
        else:
            raise BenchError(f"mesh dev up not ready within {READY_WITHIN:g}s:\n"
                             f"{self.child.tail(30)}")  # fmt: skip
        self.nc = await bus.connect(
            self.url, name="bench self-upgrade", creds=str(self.dir.creds / "admin.creds"),
            reconnect=False, ca=str(self.dir.ca),
        )  # fmt: skip

    def check_alive(self) -> None:
        if self.child is not None and not self.child.running:
            raise BenchError(f"mesh dev up exited ({self.child.proc.returncode}):\n"
                             f"{self.child.tail(30)}")  # fmt: skip

    async def ask(self, verb: str, body: object, into: type, within: float = 10.0):
        assert self.nc is not None
        data = await bus.request(
            self.nc, subjects.ctl(verb), wire.encode(body), deadline=time.monotonic() + within
        )
        return wire.decode_reply(data, into)

    async def nodes(self) -> NodesReply:
        return await every_page(lambda body: self.ask("nodes", body, NodesReply), NodesRequest())

    async def plan(self, plan_id: int) -> PlanReply:
        return await every_page(lambda body: self.ask("plan", body, PlanReply),
                                PlanRequest(id=plan_id))  # fmt: skip

    async def cli(self, *args: str, timeout: float = 900) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            *MESH, *args, env=self.env(), cwd=self.folder, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BenchError(f"`mesh {' '.join(args)}` took more than {timeout:g}s") from None
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    def agent_pid(self, host: str) -> int | None:
        try:
            return int((self.dir.root / "hosts" / host / "agent.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    async def stop(self) -> list[str]:
        """Stop `mesh dev up` (SIGTERM: it stops everything in order); then kill whatever of
        DIR still runs, and say what that was."""
        notes: list[str] = []
        if self.nc is not None:
            await bus.close(self.nc)
        if self.child is not None:
            code = await self.child.stop(sig=signal.SIGTERM, timeout=120)
            if code not in (0, None):
                notes.append(f"mesh dev up exited with code {code}")
        hosts = self.dir.root / "hosts"
        if hosts.is_dir():
            agents = stop_agents(hosts)
            supervised = stop_supervised(hosts)
            if agents or supervised:
                notes.append(f"killed after mesh dev up stopped: agents {agents}, "
                             f"supervised {supervised}")  # fmt: skip
        await asyncio.sleep(0.5)
        left = leftovers(self.folder, self.seen_pids)
        notes.append("leftover processes: " + (", ".join(left) if left else "none"))
        return notes


def leftovers(folder: Path, pids: set[int]) -> list[str]:
    """Processes still running that name `folder`, run in it, or were seen by the bench."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = (entry / "cwd").resolve()
        except OSError:
            continue
        if str(folder) in cmdline or cwd.is_relative_to(folder) or pid in pids:
            if (entry / "stat").read_text().split()[2] == "Z":
                continue
            found.append(f"{pid} {cmdline.strip()[:80]}")
    return found


# --- a push and its figures ------------------------------------------------------------------


@dataclass
class Machine:
    name: str
    tier: int
    step: float  # step started -> finished
    marks: dict[str, float] = field(default_factory=dict)  # log event -> seconds after start
    sleeper: tuple[int | None, int | None] = (None, None)  # pid before, after
    agent: tuple[int | None, int | None] = (None, None)
    version: str | None = None


@dataclass
class Push:
    kind: str  # "upgrade" or "baseline"
    round: int
    plan: PlanReply
    pushed: float  # time.time() when the push command started
    exited: float  # and when it exited
    cores: float
    cpu_wait: float | None
    digest: str | None = None  # the mesh bundle's (upgrade)
    built: float | None = None  # the builder's "built" line
    build_began: float | None = None  # the builder's "building" line
    machines: list[Machine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def started(self) -> float:
        assert self.plan.started is not None
        return self.plan.started.timestamp()

    @property
    def finished(self) -> float:
        assert self.plan.finished is not None
        return self.plan.finished.timestamp()

    def tiers(self) -> list[tuple[int, float, float]]:
        """(tier, first step's start, last step's finish)."""
        out = []
        for t in sorted({s.tier for s in self.plan.steps}):
            steps = [s for s in self.plan.steps if s.tier == t]
            first = min(s.started.timestamp() for s in steps if s.started)
            last = max(s.finished.timestamp() for s in steps if s.finished)
            out.append((t, first, last))
        return out


MARKS = (  # per machine of an agent upgrade: (name, pattern; {hex}: the bundle's digest)
    ("bundle stored", r"bundle mesh:sha256:{hex} stored"),
    ("starting new agent", r"starting the new host agent from \S*mesh-sha256-{hex}"),
    ("new agent's first line", r"host {name}: (no )?container engine"),
    ("old agent let go", r"the old agent let go: taking the machine over"),
    ("handed over", r"handed this machine over to the new agent \(pid \d+, mesh:sha256:{hex}\)"),
)


def sleeper_env(folder: Path, value: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "module.toml").write_text(SLEEPER % value)
    return folder


async def pids(mesh: Mesh) -> dict[str, dict[str, int | None]]:
    """Machine -> process -> pid, and "agent" -> the agent's pid (its pid file)."""
    reply = await mesh.nodes()
    found = {n.name: {p.name: p.pid for p in n.processes} for n in reply.nodes}
    for host in mesh.hosts:
        found.setdefault(host, {})["agent"] = mesh.agent_pid(host)
    for procs in found.values():
        mesh.seen_pids.update(p for p in procs.values() if p)
    return found


async def settled(mesh: Mesh, digest: str | None, before: dict) -> dict:
    """`nodes` once every host runs what the plan rolled: the new version (an upgrade), every
    process healthy with a pid, every agent's pid file naming another agent than before."""
    deadline = time.monotonic() + SETTLE_WITHIN
    while True:
        mesh.check_alive()
        reply = await mesh.nodes()
        nodes = {n.name: n for n in reply.nodes}
        ok = all(
            h in nodes
            and all(p.healthy and p.pid for p in nodes[h].processes)
            and "sleeper" in {p.name for p in nodes[h].processes}
            and (
                digest is None
                or (
                    nodes[h].version == digest
                    and mesh.agent_pid(h) != before[h].get("agent")
                    and "mesh-host" in {p.name for p in nodes[h].processes}
                )
            )
            for h in mesh.hosts
        )
        if ok:
            return {n.name: n for n in reply.nodes}
        if time.monotonic() > deadline:
            raise BenchError(f"the hosts did not settle within {SETTLE_WITHIN:g}s: {reply}")
        await asyncio.sleep(0.2)


async def push(mesh: Mesh, module: Path, kind: str, rnd: int) -> Push:
    before = await pids(mesh)
    meter = CpuMeter()
    t0 = time.time()
    code, out, err = await mesh.cli("push", str(module), "--wait", "--json", "--timeout", "120")
    t1 = time.time()
    cores, cpu_wait = meter.read()
    try:
        reply = msgspec.json.decode(out)
    except msgspec.DecodeError:
        raise BenchError(f"push {module} (exit {code}) printed no JSON: {err.strip()}") from None
    if code != 0 or not reply.get("plan"):
        raise BenchError(f"push {module} (exit {code}): {err.strip()} {out.strip()[:500]}")
    plan = await mesh.plan(reply["plan"])
    if plan.state != "done" or plan.started is None or plan.finished is None:
        raise BenchError(f"plan {plan.id} ended {plan.state}: {plan.failure}")
    result = Push(kind=kind, round=rnd, plan=plan, pushed=t0, exited=t1, cores=cores,
                  cpu_wait=cpu_wait)  # fmt: skip
    digest = next((b.digest for b in plan.builds if b.bundle == "mesh"), None)
    result.digest = digest if kind == "upgrade" else None
    await asyncio.sleep(3 * POLL_LOGS)  # the last lines read
    nodes = await settled(mesh, result.digest, before)
    after = await pids(mesh)
    hosts_log = [f"node-{i}" for i in range(1, len(mesh.hosts) + 1)]
    if result.digest is not None:
        hexd = result.digest.removeprefix("sha256:")
        built = mesh.logs.first(
            hosts_log, rf"built mesh-host/mesh: sha256:{hexd}", after=t0, before=t1
        )
        if built is not None:
            result.built = built.at
            began = mesh.logs.last(
                hosts_log, r"building mesh-host/mesh: ", after=t0, before=built.at
            )
            result.build_began = began.at if began else None
        elif any(b.built for b in plan.builds):
            result.notes.append("no builder log line for the build")
    for s in plan.steps:
        assert s.started is not None and s.finished is not None
        start, finish = s.started.timestamp(), s.finished.timestamp()
        m = Machine(name=s.machine, tier=s.tier, step=finish - start)
        if result.digest is not None:
            hexd = result.digest.removeprefix("sha256:")
            since = start - 1.0  # the log's lines are read up to POLL_LOGS late; never early
            for name, pattern in MARKS:
                line = mesh.logs.first([s.machine], pattern.format(hex=hexd, name=s.machine),
                                       after=since, before=finish + 2.0)  # fmt: skip
                if line is None:
                    result.notes.append(f"{s.machine}: no line for {name!r}")
                    continue
                m.marks[name] = line.at - start
                since = line.at
        m.sleeper = (before.get(s.machine, {}).get("sleeper"), after[s.machine].get("sleeper"))
        old_agent = before.get(s.machine, {}).get("mesh-host") or before[s.machine]["agent"]
        m.agent = (old_agent, after[s.machine].get("mesh-host"))
        m.version = nodes[s.machine].version
        result.machines.append(m)
    return result


def describe(p: Push) -> list[str]:
    plan = p.plan
    lines = []
    head = (
        f"{p.kind} round {p.round}: plan {plan.id} {plan.state}, {len(plan.steps)} machine(s); "
        f"push -> plan start {p.started - p.pushed:.2f} s"
    )
    created = plan.created.timestamp()
    if p.kind == "upgrade":
        parts = [f"push -> recorded {created - p.pushed:.2f}"]
        if p.built is not None:
            parts.append(f"build {p.built - created:.2f}")
            parts.append(f"built -> start {p.started - p.built:.2f}")
        head += f" ({', '.join(parts)})"
        if p.build_began is not None and p.built is not None:
            head += f"; the builder's own build {p.built - p.build_began:.2f} s"
    lines.append(head)
    tiers = p.tiers()
    tier_text = []
    prev = p.started
    for t, first, last in tiers:
        tier_text.append(f"tier {t} {last - first:.2f} (+{first - prev:.2f} before)")
        prev = last
    lines.append(
        f"  plan {p.finished - p.started:.2f} s: {'; '.join(tier_text)}; push command exit "
        f"{p.exited - p.finished:.2f} s after the plan's end; whole push {p.exited - p.pushed:.2f}"
        f" s; cores {p.cores:.2f}, cpu wait "
        f"{'-' if p.cpu_wait is None else f'{p.cpu_wait:.0%}'}"
    )
    if p.digest:
        lines.append(f"  bundle {p.digest[:19]}…")
    for m in p.machines:
        keep = "kept" if m.sleeper[0] == m.sleeper[1] else "changed"
        text = f"  {m.name} (tier {m.tier}): step {m.step:.2f} s"
        if m.marks:
            cells = ", ".join(f"{k} +{v:.2f}" for k, v in m.marks.items())
            text += f" [{cells}, step done +{m.step:.2f}]"
        text += f"; sleeper pid {m.sleeper[0]} -> {m.sleeper[1]} {keep}"
        if p.digest is not None:
            agent = "changed" if m.agent[0] != m.agent[1] else "NOT changed"
            right = "the new bundle" if m.version == p.digest else f"{m.version}, NOT the new one"
            text += f"; mesh-host pid {m.agent[0]} -> {m.agent[1]} {agent}; version {right}"
        lines.append(text)
    lines.extend(f"  note: {n}" for n in p.notes)
    return lines


# --- the fetch alone -------------------------------------------------------------------------


@dataclass
class Fetch:
    size: int = 0
    entries: int = 0
    blobs_get: list[float] = field(default_factory=list)
    writeinto: list[float] = field(default_factory=list)
    cpu: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # user, system
    sha256: list[float] = field(default_factory=list)
    members: list[float] = field(default_factory=list)
    unpack: list[float] = field(default_factory=list)
    read_only: list[float] = field(default_factory=list)
    profiles: list[tuple[str, float, str]] = field(default_factory=list)  # what, seconds, top


def cpu_times(since: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """This process's CPU seconds (user, system), less `since`."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime - since[0], used.ru_stime - since[1]


def _writable(path: Path) -> None:
    """Folders writable again (a bundle's are read-only), so that they can be removed."""
    for folder, dirs, _ in os.walk(path):
        for d in [folder, *(os.path.join(folder, d) for d in dirs)]:
            try:
                if not os.path.islink(d):
                    os.chmod(d, 0o755)
            except OSError:
                pass


async def fetch(mesh: Mesh, digest: str, times: int, top: int) -> Fetch:
    creds = mesh.dir.creds / "hosts" / "node-1.creds"
    nc = await bus.connect(mesh.url, name="bench fetch (node-1's creds)", creds=str(creds),
                           reconnect=False, ca=str(mesh.dir.ca))  # fmt: skip
    # nats-py's ObjectStore.get (an ordered consumer) is the baseline: hosts may not make
    # consumers on the bundle store (docs/security.md, the bus), so it reads as the controllers
    # (who also may answer the consumer's flow control).
    admin = await bus.connect(mesh.url, name="bench fetch (the controllers' creds)",
                              creds=str(mesh.dir.creds / "controller.creds"), reconnect=False,
                              ca=str(mesh.dir.ca))  # fmt: skip
    f = Fetch()
    scratch = mesh.folder / "fetch"
    scratch.mkdir()
    try:
        obs = await blobs.store(admin)
        name = digest.replace(":", "-")
        for i in range(times):
            t, used = time.perf_counter(), cpu_times()
            data = await blobs.get(nc, digest)
            f.blobs_get.append(time.perf_counter() - t)
            f.cpu.setdefault("blobs.get", []).append(cpu_times(used))
            buf = io.BytesIO()
            t, used = time.perf_counter(), cpu_times()
            await obs.get(name, writeinto=buf)
            f.writeinto.append(time.perf_counter() - t)
            f.cpu.setdefault("writeinto", []).append(cpu_times(used))
            if blobs.digest(buf.getvalue()) != digest:
                raise BenchError("ObjectStore.get with writeinto gave other bytes")
            t = time.perf_counter()
            blobs.digest(data)
            f.sha256.append(time.perf_counter() - t)
            t = time.perf_counter()
            found = await asyncio.to_thread(archive.members, data)
            f.members.append(time.perf_counter() - t)
            f.size, f.entries = len(data), len(found)
            dest = scratch / f"unpacked-{i}"
            dest.mkdir()
            t = time.perf_counter()
            await asyncio.to_thread(archive.unpack, data, dest)
            f.unpack.append(time.perf_counter() - t)
            t = time.perf_counter()
            await asyncio.to_thread(bundles._read_only, dest)
            f.read_only.append(time.perf_counter() - t)
            _writable(dest)
            shutil.rmtree(dest)
            (gu, gs), (wu, ws) = f.cpu["blobs.get"][-1], f.cpu["writeinto"][-1]
            say(f"  fetch {i + 1}: blobs.get {f.blobs_get[-1]:.2f} s (cpu {gu:.2f} user + "
                f"{gs:.2f} sys), get(writeinto) {f.writeinto[-1]:.2f} s (cpu {wu:.2f} user + "
                f"{ws:.2f} sys), sha256 {f.sha256[-1]:.2f} s, members "
                f"{f.members[-1]:.2f} s, unpack {f.unpack[-1]:.2f} s, read-only "
                f"{f.read_only[-1]:.2f} s")  # fmt: skip
        for what, call in (
            ("blobs.get", lambda: blobs.get(nc, digest)),
            ("ObjectStore.get(writeinto=BytesIO)", lambda: obs.get(name, writeinto=io.BytesIO())),
        ):
            profile = cProfile.Profile()
            t = time.perf_counter()
            profile.enable()
            await call()
            profile.disable()
            seconds = time.perf_counter() - t
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
            f.profiles.append((what, seconds, out.getvalue()))
    finally:
        await bus.close(nc)
        await bus.close(admin)
        if scratch.exists():
            _writable(scratch)
            shutil.rmtree(scratch, ignore_errors=True)
    return f


# --- the run and the summary -----------------------------------------------------------------


def p50_max(values: list[float]) -> str:
    if not values:
        return f"{0:>3} {'-':>8} {'-':>8}"
    return f"{len(values):>3} {statistics.median(values):>8.2f} {max(values):>8.2f}"


def summary(pushes: list[Push], f: Fetch | None) -> list[str]:
    rows: list[tuple[str, list[float]]] = []
    for kind in ("upgrade", "baseline"):
        ps = [p for p in pushes if p.kind == kind]
        if not ps:
            continue
        label = "agent upgrade" if kind == "upgrade" else "baseline (sleeper env)"
        rows.append((f"{label}: push -> plan start", [p.started - p.pushed for p in ps]))
        if kind == "upgrade":
            rows.append(("  push -> recorded", [p.plan.created.timestamp() - p.pushed for p in ps]))
            built = [(p, p.built) for p in ps if p.built is not None]
            rows.append(("  recorded -> built (the build)",
                         [at - p.plan.created.timestamp() for p, at in built]))  # fmt: skip
            rows.append(("    of which the builder's own",
                         [at - p.build_began for p, at in built if p.build_began]))  # fmt: skip
            rows.append(("  built -> plan start", [p.started - at for p, at in built]))
        rows.append((f"{label}: plan start -> finish", [p.finished - p.started for p in ps]))
        rows.append(("  a tier (first start -> last finish)",
                     [last - first for p in ps for _, first, last in p.tiers()]))  # fmt: skip
        rows.append(("  between tiers", [
            first - prev for p in ps
            for (_, _, prev), (_, first, _) in zip(p.tiers(), p.tiers()[1:], strict=False)
        ]))  # fmt: skip
        rows.append(("  plan finish -> push command exit", [p.exited - p.finished for p in ps]))
        machines = [m for p in ps for m in p.machines]
        if kind == "upgrade":
            for name, _ in MARKS:
                rows.append((f"  per machine: step start -> {name}",
                             [m.marks[name] for m in machines if name in m.marks]))  # fmt: skip
        rows.append(("  per machine: step start -> step finished", [m.step for m in machines]))
        if kind == "upgrade":
            names = [n for n, _ in MARKS]
            phases = [("fetch + unpack", None, names[0]),
                      ("stored -> starting new agent", names[0], names[1]),
                      ("starting -> new agent's first line", names[1], names[2]),
                      ("first line -> old agent let go", names[2], names[3]),
                      ("let go -> handed over (new agent running)", names[3], names[4]),
                      ("handed over -> step finished", names[4], "")]  # fmt: skip
            for label_, a, b in phases:
                values = []
                for m in machines:
                    start = 0.0 if a is None else m.marks.get(a)
                    end = m.step if b == "" else m.marks.get(b)
                    if start is not None and end is not None:
                        values.append(end - start)
                rows.append((f"  phase: {label_}", values))
        rows.append((f"{label}: cores (push -> exit)", [p.cores for p in ps]))
    if f is not None:
        for label, key, wall in (
            (f"fetch alone ({f.size / 2**20:.1f} MiB): blobs.get", "blobs.get", f.blobs_get),
            ("  ObjectStore.get(writeinto=BytesIO)", "writeinto", f.writeinto),
        ):
            rows.append((label, wall))
            rows.append(("    cpu user", [u for u, _ in f.cpu.get(key, [])]))
            rows.append(("    cpu system", [s for _, s in f.cpu.get(key, [])]))
        rows.append(("  sha256 of the bundle (once)", f.sha256))
        rows.append((f"  archive.members ({f.entries} entries)", f.members))
        rows.append(("  archive.unpack (members again, then write)", f.unpack))
        rows.append(("  the read-only pass (bundles._read_only)", f.read_only))
    width = max(len(r[0]) for r in rows)
    header = f"{'measure (seconds)':<{width}} {'n':>3} {'p50':>8} {'max':>8}"
    return [header, "-" * len(header)] + [f"{n:<{width}} {p50_max(v)}" for n, v in rows]


async def stop_reading(task: asyncio.Task[None] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def bench(args: argparse.Namespace, folder: Path) -> tuple[list[Push], Fetch | None, list]:
    mesh = Mesh(folder, args.hosts)
    tailing: asyncio.Task[None] | None = None
    pushes: list[Push] = []
    fetched: Fetch | None = None
    whole = CpuMeter()
    notes: list[str] = []
    try:
        say(f"starting `mesh dev up --hosts {args.hosts}` in {mesh.dir.root}…")
        t = time.monotonic()
        await mesh.start(args.hosts)
        tailing = asyncio.create_task(mesh.logs.run())
        say(f"  ready on {mesh.url} after {time.monotonic() - t:.1f} s")
        say("pushing sleeper (the process on every host)…")
        code, out, err = await mesh.cli(
            "push", str(sleeper_env(folder / "sleeper", "0")), "--wait", "--json"
        )
        if code != 0:
            raise BenchError(f"push sleeper: {err.strip()} {out.strip()[:300]}")
        await settled(mesh, None, {})
        say("  sleeper runs on every host")
        for rnd in range(1, args.rounds + 1):
            say("")
            module = sleeper_env(folder / "sleeper", str(rnd))
            p = await push(mesh, module, "baseline", rnd)
            pushes.append(p)
            for line in describe(p):
                say(line)
            source = await asyncio.to_thread(mesh_copy, folder / f"v{rnd}", f"bench-v{rnd}")
            p = await push(mesh, source / "services" / "host", "upgrade", rnd)
            pushes.append(p)
            for line in describe(p):
                say(line)
        digests = [p.digest for p in pushes if p.digest]
        await stop_reading(tailing)  # not in the profile below
        if digests and args.fetches > 0:
            say("")
            say(f"the fetch alone, node-1's credentials, bundle {digests[-1][:19]}…:")
            fetched = await fetch(mesh, digests[-1], args.fetches, args.top)
    finally:
        await stop_reading(tailing)
        say("stopping…")
        with_cores = whole.read()
        notes = await mesh.stop()
        notes.insert(0, f"the whole run: {time.time() - whole.t0:.0f} s, cores "
                        f"{with_cores[0]:.2f}")  # fmt: skip
        for n in notes:
            say(f"  {n}")
    return pushes, fetched, notes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3, help="hosts of the dev mesh (3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds: a baseline, an upgrade (3)")
    p.add_argument("--fetches", type=int, default=3, help="fetches alone at the end (3)")
    p.add_argument("--top", type=int, default=12, help="functions shown of the profile (12)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--deadline", type=float, default=1800, help="seconds for the whole run")
    return p


async def run(args: argparse.Namespace) -> tuple[list[Push], Fetch | None]:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    folder = Path(tempfile.mkdtemp(prefix="mesh-bench-upgrade-")).resolve()
    try:
        async with asyncio.timeout(args.deadline):
            pushes, fetched, _ = await bench(args, folder)
    except TimeoutError:
        raise BenchError(f"the run took longer than --deadline {args.deadline:g}s") from None
    except (wire.RemoteError, bus.NoAnswer) as e:
        raise BenchError(f"a request failed: {type(e).__name__}: {e}") from None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if args.keep:
            say(f"kept {folder}")
        else:
            _writable(folder)
            shutil.rmtree(folder, ignore_errors=True)
    return pushes, fetched


def main() -> None:
    args = parser().parse_args()
    if not 3 <= args.hosts <= 64:
        sys.exit("--hosts must be between 3 and 64 (one host in each of tiers 0, 1 and 2)")
    if args.rounds < 1 or args.fetches < 0:
        sys.exit("--rounds must be positive, --fetches not negative")
    say(machine_line())
    pushes, fetched = run_or_exit(run(args))
    say("")
    for line in summary(pushes, fetched):
        say(line)
    for what, seconds, top in fetched.profiles if fetched is not None else []:
        say("")
        say(f"one {what} under cProfile: {seconds:.2f} s; the top by own time:")
        say(top.strip("\n"))


if __name__ == "__main__":
    main()
