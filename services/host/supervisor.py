"""The supervisor: every declared process kept running as declared.

Each process has one task (owned by the supervisor's task group) that starts it, or adopts the
instance a previous host left running, waits for it to exit and restarts it by its policy with
exponential backoff (1 s doubling to 30 s; reset after 30 s up), while its check runs: `passes`
consecutive passes make it healthy. A changed process is swapped as declared: stop-first, or
start-first (the new beside the old; the old stopped once the new is healthy; a new version that
never gets healthy is stopped and the old keeps running). Instances are recorded in
ROOT/state/processes.json for adoption; stopping the host does not stop its processes.
"""

import hashlib
import logging
import secrets
import subprocess
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import anyio
import msgspec
from anyio.abc import TaskGroup
from nats.aio.client import Client

from mesh.lifetime import first_of
from mesh.model import ProcessState, ProcessStatus
from mesh.modules.compose import DProcess, DTool, canonical_process
from mesh.modules.gate import duration
from services.host import checks, limits, logwriter, metrics, processes
from services.host.limits import Cgroups
from services.host.processes import Instance

log = logging.getLogger(__name__)

BACKOFF_MAX = 30.0
STEADY_AFTER = 30.0  # up this long, and the backoff starts again from 1 s
# A process without a check counts healthy once it has run this long: one killed at start over
# and over (its memory limit, a missing file) is never healthy, and its plan's step fails as a
# crash loop ([rollout] crash_loop) instead of counting it done.
SETTLE = 1.0
DRAINED_WITHIN = 1.0  # seconds an exited process's log writer gets to write its last lines


def spec_digest(p: DProcess | DTool) -> str:
    return "sha256:" + hashlib.sha256(canonical_process(p)).hexdigest()


class Launch(msgspec.Struct):
    """Everything needed to run one declared process on this machine."""

    name: str
    decl: DProcess | DTool  # a tool server's is a DTool (services/host/tools.py)
    spec: str
    cwd: Path
    env: dict[str, str]
    uid: int | None
    gid: int | None
    log_file: Path
    groups: list[int] = []
    # Where its cgroup goes (services/host/limits.py; none made when the machine cannot) and
    # its name there: `<module>.<process>`.
    cgroups: Cgroups = msgspec.field(default_factory=Cgroups)
    group: str = ""


def _last_spec(log_file: Path, spec: str) -> str | None:
    """The spec its log's last start was of (None: none recorded), recording `spec` instead."""
    record = log_file.with_name("spec")
    try:
        was: str | None = record.read_text().strip()
    except OSError:
        was = None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(spec)
    except OSError:
        pass  # a marker without the version before: nothing else depends on it
    return was


class Supervised:
    piped = False  # stdin and stdout as pipes to the host (a tool server's MCP over stdio)

    def __init__(self, launch: Launch, *, nc: Client, changed: Callable[[], None]) -> None:
        self.launch = launch
        self._nc = nc
        self._changed = changed
        self.instance: Instance | None = None
        self.pipes: processes.Pipes | None = None  # the host's ends, when piped
        self.state: ProcessStatus = "starting"
        self.healthy = False
        self.became_healthy = anyio.Event()
        self.last_error = ""
        self.reason = ""  # why it last exited (limits.py names a limit's kill)
        self.restarts = 0
        self.in_a_row = 0  # restarts with no steady run between (STEADY_AFTER): a crash loop
        self.since: datetime | None = None  # when its running instance started
        self.check_said = ""  # its last check's failure, until a check passes
        self.said = ""  # the last line it printed before it last exited
        self.oom_kills = 0  # by its memory limit, since this host started it
        self._oom_before = 0  # its cgroup's count when the instance started
        self.meter = limits.Meter()
        self._stopping = False
        self._spawned = False  # a start after the first is a restart (its log's marker says)
        # The sessions of this process's other instances (its old version beside a start-first
        # new one): their listening sockets on its check's port are not another process's.
        self.kin: Callable[[], list[int]] = list
        self.scope = anyio.CancelScope()

    def report(self) -> ProcessState:
        instance = self.instance
        pid = instance.pid if instance else None
        memory, cpu = self.meter.read(pid, instance.cgroups if instance else {})
        down = self.state not in ("starting", "running")
        return ProcessState(
            name=self.launch.name, state=self.state, healthy=self.healthy, pid=pid,
            memory=memory, cpu=cpu, reason=self.reason if down else "", restarts=self.restarts,
            in_a_row=0 if self._steady() else self.in_a_row,
            check="" if down or self.healthy else self.check_said,
            since=None if down else self.since, said=self.said if down else "",
        )  # fmt: skip

    def _steady(self) -> bool:
        """Running for STEADY_AFTER: the restarts before no longer count as a loop."""
        since = self.since
        return (
            self.state == "running"
            and since is not None
            and ((datetime.now(UTC) - since).total_seconds() > STEADY_AFTER)
        )

    def _set(self, state: ProcessStatus, *, healthy: bool | None = None, error: str = "") -> None:
        changed = state != self.state or (healthy is not None and healthy != self.healthy)
        self.state = state
        if healthy is not None:
            self.healthy = healthy
            if healthy:
                self.became_healthy.set()
        if error:
            self.last_error = error
        if changed:
            self._changed()

    async def run(self, *, adopt: Instance | None = None) -> None:
        with self.scope:
            backoff = 1.0
            while not self._stopping:
                adopted = adopt is not None
                if adopt is not None:
                    self.instance, adopt = adopt, None
                    self._oom_before = limits.oom_kills(self.instance.cgroups)
                    log.info("process %s: adopted pid %d", self.launch.name, self.instance.pid)
                else:
                    try:
                        self.instance = self._spawn()
                    except (OSError, ValueError, subprocess.SubprocessError) as e:
                        self.reason = f"could not start: {e}"
                        self._set("failed", healthy=False, error=self.reason)
                        log.warning("process %s could not start: %s", self.launch.name, e)
                        await self._back_off(backoff)
                        backoff = min(backoff * 2, BACKOFF_MAX)
                        continue
                    log.info("process %s started, pid %d", self.launch.name, self.instance.pid)
                self.since, self.check_said = datetime.now(UTC), ""
                self._changed()
                up_since = time.monotonic()
                self._set("running", healthy=self._healthy_at_start())
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._alongside, adopted)
                    code = await processes.wait(self.instance)
                    self._exited(code)
                    tg.cancel_scope.cancel()
                processes.kill_group(self.instance.pid)  # what it left behind goes with it
                how = self._why_exited(code)
                if not self._stopping:  # its last words, once its log writer has them all
                    await processes.drained(self.instance, within=DRAINED_WITHIN)
                    self.said = logwriter.last_line(self.launch.log_file)
                with anyio.CancelScope(shield=True):  # a stop must not leave it behind
                    await limits.remove(self.instance.cgroups)
                self.instance = None
                if self._stopping:
                    self._set("stopped", healthy=False)
                    return
                self.reason = how
                policy = self._policy()
                if policy == "never" or (policy == "on-failure" and code == 0):
                    self._set("exited" if code == 0 else "failed", healthy=False, error=how)
                    log.info("process %s %s; restart = %s", self.launch.name, how, policy)
                    return
                if time.monotonic() - up_since > STEADY_AFTER:
                    backoff, self.in_a_row = 1.0, 0
                self.restarts += 1
                self.in_a_row += 1
                metrics.RESTARTS.labels(self.launch.name).inc()
                log.info("process %s %s; restarting in %gs", self.launch.name, how, backoff)
                self._set("restarting", healthy=False, error=how)
                await self._back_off(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _back_off(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    # What a kind of supervised process does its own way (services/host/tools.py: tool servers).

    def _healthy_at_start(self) -> bool:
        return False  # its check says, or (none) having run SETTLE

    def _policy(self) -> str:
        return self.launch.decl.restart

    async def _alongside(self, adopted: bool) -> None:
        """Runs while the instance does; cancelled when it exits."""
        if self.launch.decl.check is not None:
            await self._check_loop()
            return
        if not adopted:  # an adopted one has been running all along
            await anyio.sleep(SETTLE)
        self._set("running", healthy=True)

    def _exited(self, code: int | None) -> None:
        """The instance has just exited (before what runs alongside it is cancelled)."""

    def _spawn(self) -> Instance:
        launch = self.launch
        lim = launch.decl.limits or None
        cgroups = {}
        if launch.cgroups.parents:
            spec = launch.spec.removeprefix("sha256:")[:8]
            name = f"{launch.group or launch.name}.{spec}.{secrets.token_hex(3)}"
            cgroups = limits.create(launch.cgroups, name=name, lim=lim)
        self._oom_before = limits.oom_kills(cgroups)
        try:
            instance, self.pipes = processes.spawn(
                launch.decl.command, cwd=launch.cwd, env=launch.env, log_file=launch.log_file,
                spec=launch.spec, uid=launch.uid, gid=launch.gid, groups=launch.groups,
                piped=self.piped, cgroups=cgroups, files_max=lim.files if lim else None,
                marker=self._marker(),
            )  # fmt: skip
        except BaseException:
            limits.discard(cgroups)
            raise
        self._spawned = True
        return instance

    def _marker(self) -> bytes:
        """The line its log gets before its output: a start (and a new version), or a restart
        and why, so `mesh logs` shows where one run ends and the next begins."""
        name, spec = self.launch.name, self.launch.spec
        if self._spawned:
            said = (f"restarted ({self.reason}; restart {self.restarts}, {self.in_a_row} in a "
                    "row)")  # fmt: skip
        else:
            was = _last_spec(self.launch.log_file, spec)
            new = f": a new version (was {was[:19]})" if was and was != spec else ""
            said = f"started, spec {spec[:19]}{new}"
        return f"[mesh] {name} {said}\n".encode()

    def _why_exited(self, code: int | None) -> str:
        """How the instance ended, in words; a kill at its memory limit names the limit."""
        assert self.instance is not None
        killed = limits.oom_kills(self.instance.cgroups) - self._oom_before
        lim = self.launch.decl.limits or None
        if killed > 0:
            self.oom_kills += killed
            metrics.OOM_KILLS.labels(self.launch.name).inc(killed)
        if killed > 0 and lim is not None and lim.memory is not None and code in (None, -9):
            return f"memory limit {limits.amount(lim.memory)} reached"
        if code is None:
            return "exited"
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    async def _check_loop(self) -> None:
        check = self.launch.decl.check
        assert check is not None
        every = duration(check.every)
        passes = 0
        while True:
            ok, why = await checks.once(
                self.launch.decl, nc=self._nc, cwd=self.launch.cwd, uid=self.launch.uid,
                gid=self.launch.gid, env=self.launch.env, groups=self.launch.groups,
                session=self.instance.pid if self.instance else None, kin=self.kin(),
            )  # fmt: skip
            passes = passes + 1 if ok else 0
            said, self.check_said = self.check_said, "" if ok else why
            if said != self.check_said and not self.healthy:
                self._changed()  # the plan waiting on it hears why, not only that it waits
            metrics.CHECKS.labels(self.launch.name, "pass" if ok else "fail").inc()
            if ok and passes >= check.passes and not self.healthy:
                log.info("process %s is healthy (%d passes)", self.launch.name, passes)
                self._set("running", healthy=True)
            elif not ok and self.healthy:
                log.info("process %s is unhealthy: %s", self.launch.name, why)
                self._set("running", healthy=False, error=why)
            elif not ok:
                self.last_error = why
            await anyio.sleep(every)

    async def stop(self) -> None:
        self._stopping = True
        instance = self.instance
        if instance is not None:
            await processes.stop(instance, timeout=duration(self.launch.decl.stop_timeout))
        self.scope.cancel()
        self._set("stopped", healthy=False)


class Supervisor:
    def __init__(self, *, nc: Client, root: Path, changed: Callable[[], None]) -> None:
        self._nc = nc
        self._state = root / "state" / "processes.json"
        self._changed = changed
        self.running: dict[str, Supervised] = {}
        self._tg: TaskGroup | None = None
        self._ready = anyio.Event()
        self._one_change = anyio.Lock()  # reconcile and restart, one at a time
        self._candidates: dict[str, Supervised] = {}  # start-first new versions on trial
        self._left = self._load()  # instances a previous host left running
        # The agent itself, when its declaration names it (mesh-host) and it runs that bundle:
        # reported among the processes, supervised by nobody here (services/host/successor.py).
        self.agent: ProcessState | None = None
        self._agent_meter = limits.Meter()
        # The tool servers (services/host/tools.py), reported among the processes.
        self.tool_servers: Callable[[], list[ProcessState]] = list

    def _load(self) -> dict[str, Instance]:
        try:
            saved = msgspec.json.decode(self._state.read_bytes(), type=dict[str, Instance])
        except (OSError, msgspec.DecodeError):
            return {}
        return {name: replace_child(i) for name, i in saved.items() if processes.alive(i)}

    def adoptable(self, name: str, spec: str) -> bool:
        left = self._left.get(name)
        return left is not None and left.spec == spec

    def save(self) -> None:
        # Everything alive that a next host must know of: not yet adopted, running, on trial.
        # (A candidate is saved as "<name>~new": a next host finds it undeclared and stops it.)
        current = dict(self._left)
        for n, s in self.running.items():
            if s.instance is not None:
                current[n] = s.instance
        for n, s in self._candidates.items():
            if s.instance is not None:
                current[f"{n}~new"] = s.instance
        self._state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(current))
        tmp.replace(self._state)

    def _on_change(self) -> None:
        self.save()
        self._changed()

    def states(self) -> list[ProcessState]:
        """The processes, and any new version on a start-first trial beside its old one (same
        name, `trial` set: a plan must not take its health for the process's)."""
        trials = [
            msgspec.structs.replace(s.report(), trial=True)
            for _, s in sorted(self._candidates.items())
        ]
        agent = []
        if self.agent is not None:  # its use as any process's (from /proc: no cgroup of ours)
            memory, cpu = self._agent_meter.read(self.agent.pid, {})
            agent = [msgspec.structs.replace(self.agent, memory=memory, cpu=cpu)]
        processes = [s.report() for _, s in sorted(self.running.items())]
        return processes + trials + agent + self.tool_servers()

    def cpu_seconds(self) -> dict[str, float]:
        return {n: s.meter.seconds for n, s in sorted(self.running.items()) if s.instance}

    async def run(self) -> None:
        """Own the processes' tasks until cancelled (the host stopping leaves them running)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._ready.set()
            await anyio.sleep_forever()

    def _start(self, launch: Launch, *, adopt: Instance | None = None) -> Supervised:
        assert self._tg is not None, "the supervisor is not running"
        s = Supervised(launch, nc=self._nc, changed=self._on_change)
        s.kin = lambda: self._kin(s)
        self._tg.start_soon(lambda: s.run(adopt=adopt))
        return s

    def _kin(self, s: Supervised) -> list[int]:
        """The sessions of the other instances of `s`'s process (its old or new version)."""
        name = s.launch.name
        return [
            other.instance.pid
            for other in (self.running.get(name), self._candidates.get(name))
            if other is not None and other is not s and other.instance is not None
        ]

    async def reconcile(
        self, launches: dict[str, Launch], *, interrupt: anyio.Event | None = None
    ) -> list[str]:
        """Make the running processes match `launches`; the problems, in words. A start-first
        trial gives way (the old version keeps running) once `interrupt` is set."""
        await self._ready.wait()
        async with self._one_change:
            return await self._reconcile(launches, interrupt or anyio.Event())

    async def _reconcile(self, launches: dict[str, Launch], interrupt: anyio.Event) -> list[str]:
        problems: list[str] = []
        for name in sorted(set(self.running) - set(launches)):
            log.info("process %s is no longer declared: stopping it", name)
            await self.running.pop(name).stop()
        for name, launch in sorted(launches.items()):
            current = self.running.get(name)
            if current is None:
                left = self._left.pop(name, None)
                if left is not None and left.spec != launch.spec:
                    log.info("process %s: the instance left running is another version", name)
                    await retire(left, timeout=duration(launch.decl.stop_timeout))
                    left = None
                self.running[name] = self._start(launch, adopt=left)
            elif current.launch.spec != launch.spec:
                problem = await self._update(name, current, launch, interrupt)
                if problem:
                    problems.append(problem)
        for name, left in list(self._left.items()):
            log.info("process %s (pid %d) is not declared any more: stopping it", name, left.pid)
            await retire(left, timeout=10)
            del self._left[name]
        self._on_change()
        return problems

    async def _update(
        self, name: str, old: Supervised, launch: Launch, interrupt: anyio.Event
    ) -> str | None:
        if launch.decl.update == "stop-first":
            log.info("process %s: new version, stop-first", name)
            await old.stop()
            self.running[name] = self._start(launch)
            return None
        log.info("process %s: new version, start-first", name)
        new = self._start(launch)
        self._candidates[name] = new
        check = launch.decl.check
        within = 60.0
        if check is not None:
            within = max(within, (check.passes + 3) * duration(check.every))
        try:
            await on_trial(new, within=within, interrupt=interrupt)
        finally:
            self._candidates.pop(name, None)
        if not new.healthy:
            why = f"the new version never got healthy within {within:g}s: {new.last_error}"
            if interrupt.is_set():
                why = "a newer declaration came before the new version got healthy"
            log.warning("process %s: %s; the old version keeps running", name, why)
            return why
        await old.stop()
        self.running[name] = new
        return None

    async def restart(self, name: str) -> bool:
        async with self._one_change:
            s = self.running.get(name)
            if s is None:
                return False
            await s.stop()
            self.running[name] = self._start(s.launch)
            self._on_change()
            return True


async def on_trial(new: Supervised, *, within: float, interrupt: anyio.Event) -> None:
    """A new version started beside the old one (start-first), until it is healthy, `within`
    passes or `interrupt` is set; one that is not healthy by then is stopped. The host stopping
    meanwhile stops it too: no new version is left untracked."""
    try:
        with anyio.move_on_after(within):
            await first_of(new.became_healthy, interrupt)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await new.stop()
        raise
    if not new.healthy:
        await new.stop()


async def retire(instance: Instance, *, timeout: float) -> None:
    """An instance nobody supervises (a previous host's) stopped, its cgroup with it."""
    await processes.stop(instance, timeout=timeout)
    await limits.remove(instance.cgroups)


def replace_child(instance: Instance) -> Instance:
    """An instance recorded by a previous host is not our child: we cannot reap it."""
    return msgspec.structs.replace(instance, child=False)
