"""Process limits on this machine (docs/modules.md, Process limits; systemd's MemoryMax=, CPUQuota=,
TasksMax= and LimitNOFILE= are the model): each process in a cgroup of its own, with its memory,
CPU and task limits, and the open-files rlimit, both set in the child before it execs.

cgroup v2 where the machine has it (one hierarchy, `cgroup.controllers` at its mount); v1 where
that is what it has (a hierarchy per controller: memory, cpu, cpuacct, pids). The host's
processes live under the host's own cgroup, in a folder named for the machine and the host's
folder (`mesh-<machine>.<hash>`: two hosts of one name on one machine, as tests run them, stay
apart), each instance in `<module>.<process>.<spec>.<random>` (its own: a restart's new instance
never shares the folder of the one being removed), removed once the instance has exited (what
it left in there killed first). An adopted instance stays where it is: its folders are saved
with it (processes.Instance). A machine where the host may not make cgroups (no root, a
read-only or absent hierarchy: MESH_CGROUP_ROOT points elsewhere) enforces only `files_max`;
a declaration asking for more fails its apply before anything changes (`refusal`), and the
machine's facts say what it can enforce.

Warning: `entering` runs in the child between fork and exec (subprocess's preexec_fn) while the
host has threads: it only makes system calls (no imports, no locks, no allocation to speak of).
"""

import errno
import hashlib
import logging
import os
import resource
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal

import anyio
import msgspec

from mesh.modules.compose import DLimits

log = logging.getLogger(__name__)

Limit = Literal["memory", "cpu", "tasks", "files"]
LIMITS: tuple[Limit, ...] = ("memory", "cpu", "tasks", "files")
FIELDS: dict[Limit, str] = {
    "memory": "memory_max", "cpu": "cpu_max", "tasks": "tasks_max", "files": "files_max",
}  # fmt: skip
# The controller (v1: the hierarchy) each limit needs; `files` is an rlimit, there everywhere.
NEEDS: dict[Limit, str] = {"memory": "memory", "cpu": "cpu", "tasks": "pids"}
V1 = ("memory", "cpu", "cpuacct", "pids")  # cpuacct: the CPU time used, for reports only
UNIFIED = ""  # the key of the one folder of an instance on v2
PERIOD_US = 100_000  # the CPU quota's period (systemd's too)


def mount() -> Path:
    return Path(os.environ.get("MESH_CGROUP_ROOT", "/sys/fs/cgroup"))


class Cgroups(msgspec.Struct):
    """Where this host makes its processes' cgroups, and what it cannot enforce, and why."""

    version: Literal["v1", "v2", ""] = ""
    parents: dict[str, str] = {}  # controller (v2: UNIFIED) -> the folder of this host's
    cannot: dict[str, str] = {}  # limit -> why this machine cannot enforce it

    def can(self) -> list[str]:
        return [limit for limit in LIMITS if limit not in self.cannot]


def amount(n: int) -> str:
    """Bytes as a manifest would say them: 64M, 1G, 1536K."""
    for unit, size in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def declared(lim: DLimits) -> dict[Limit, str]:
    """The limits a process declares, each as its manifest says it."""
    out: dict[Limit, str] = {}
    if lim.memory is not None:
        out["memory"] = amount(lim.memory)
    if lim.cpu is not None:
        out["cpu"] = f"{lim.cpu:g}"
    if lim.tasks is not None:
        out["tasks"] = str(lim.tasks)
    if lim.files is not None:
        out["files"] = str(lim.files)
    return out


def refusal(cgroups: Cgroups, lim: DLimits) -> str | None:
    """Why this machine cannot run a process with these limits (one line), or None."""
    for limit, value in declared(lim).items():
        why = cgroups.cannot.get(limit)
        if why is not None:
            return f"{FIELDS[limit]} = {value}: this machine cannot enforce it ({why})"
    return None


# --- finding what this machine can do ----------------------------------------------------------


def _own() -> dict[str, str]:
    """This process's cgroup in each hierarchy (v2: under UNIFIED)."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [UNIFIED]:
            out[c] = path
    return out


def probe(*, machine: str, state: Path) -> Cgroups:
    """What this machine lets the host enforce, its folders made (and emptied of what a host
    before it left there and nothing uses), and listed in STATE/state/cgroups.json (for
    mesh.embedded.children.remove_cgroups: `mesh dev up` and the tests clean up with it)."""
    root = mount()
    name = f"mesh-{machine}.{hashlib.sha256(str(state).encode()).hexdigest()[:8]}"
    own = _own()
    if (root / "cgroup.controllers").exists():
        found = _probe_v2(root, own.get(UNIFIED, "/"), name)
    else:
        found = _probe_v1(root, own, name)
    for parent in found.parents.values():
        _sweep(Path(parent))
    record = state / "state" / "cgroups.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_bytes(msgspec.json.encode(sorted(found.parents.values())))
    return found


def _probe_v1(root: Path, own: dict[str, str], name: str) -> Cgroups:
    parents: dict[str, str] = {}
    why: dict[str, str] = {}
    for controller in V1:
        # co-mounted controllers (cpu,cpuacct) are one folder by two names: one path for both
        hierarchy = (root / controller).resolve()
        folder = hierarchy / own.get(controller, "/").lstrip("/") / name
        if not (hierarchy / "cgroup.procs").exists():
            why[controller] = f"no {controller} cgroup hierarchy at {hierarchy}"
            continue
        try:
            folder.mkdir(exist_ok=True)
            if not os.access(folder / "cgroup.procs", os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as e:
            why[controller] = f"no writable {controller} cgroup at {folder.parent}: {e.strerror}"
            continue
        parents[controller] = str(folder)
    cannot = {limit: why[c] for limit, c in NEEDS.items() if c not in parents}
    return Cgroups(version="v1" if parents else "", parents=parents, cannot=cannot)


def _probe_v2(root: Path, own: str, name: str) -> Cgroups:
    base = root / own.lstrip("/")
    if base.name == f"{name}.agent":  # an agent before this one moved there (below)
        base = base.parent
    folder = base / name
    wanted = [c for c in ("memory", "cpu", "pids") if c in _words(base / "cgroup.controllers")]
    try:
        folder.mkdir(exist_ok=True)
        enable = " ".join(f"+{c}" for c in wanted)
        if enable:
            try:
                (base / "cgroup.subtree_control").write_text(enable)
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                # v2 gives controllers only to a cgroup's children when it has no processes
                # of its own: the agent moves itself into a leaf beside its processes' folder
                # (as systemd's delegation asks).
                leaf = base / f"{name}.agent"
                leaf.mkdir(exist_ok=True)
                (leaf / "cgroup.procs").write_text(str(os.getpid()))
                (base / "cgroup.subtree_control").write_text(enable)
            (folder / "cgroup.subtree_control").write_text(enable)
    except OSError as e:
        why = f"no writable cgroup at {base}: {e.strerror}"
        return Cgroups(cannot={limit: why for limit in NEEDS})
    cannot = {
        limit: f"the {c} controller is not enabled at {base}"
        for limit, c in NEEDS.items()
        if c not in wanted
    }
    return Cgroups(version="v2", parents={UNIFIED: str(folder)}, cannot=cannot)


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _sweep(parent: Path) -> None:
    """The empty cgroups a host before this one left (it was killed while they emptied)."""
    try:
        children = [c for c in parent.iterdir() if c.is_dir()]
    except OSError:
        return
    for child in children:
        if not _words(child / "cgroup.procs"):
            try:
                child.rmdir()
            except OSError:
                pass


def release(cgroups: Cgroups) -> None:
    """The host's folders, when nothing is left in them (its processes outlive it otherwise)."""
    for parent in cgroups.parents.values():
        _sweep(Path(parent))
        try:
            Path(parent).rmdir()
        except OSError:
            pass


# --- one instance's cgroup ---------------------------------------------------------------------


def create(cgroups: Cgroups, *, name: str, lim: DLimits | None) -> dict[str, str]:
    """The cgroup of a new instance, its limits written: its folder in each hierarchy. Raises
    OSError (the start fails, and says why)."""
    dirs: dict[str, str] = {}
    try:
        for controller, parent in cgroups.parents.items():
            if controller not in _joined(lim):
                continue
            folder = Path(parent) / name
            if str(folder) not in dirs.values():
                folder.mkdir()  # never another instance's (adopted, or being removed)
            dirs[controller] = str(folder)
        if lim is not None:
            _write_limits(cgroups.version, dirs, lim)
    except BaseException:
        discard(dirs)
        raise
    return dirs


def _joined(lim: DLimits | None) -> set[str]:
    """The hierarchies an instance joins: those its use is read from, and those of its limits.
    (On v1 each join of a hierarchy costs the start tens of milliseconds: bench/limits.py.)"""
    joined = {UNIFIED, "memory", "cpuacct"}
    if lim is not None and lim.cpu is not None:
        joined.add("cpu")
    if lim is not None and lim.tasks is not None:
        joined.add("pids")
    return joined


def discard(dirs: Mapping[str, str]) -> None:
    """The folders of a cgroup nothing joined (its instance did not start)."""
    for folder in set(dirs.values()):
        try:
            os.rmdir(folder)
        except OSError:
            pass


def _write_limits(version: str, dirs: dict[str, str], lim: DLimits) -> None:
    def put(controller: str, file: str, value: str, *, optional: bool = False) -> None:
        try:
            (Path(dirs[controller]) / file).write_text(value)
        except FileNotFoundError:
            if not optional:  # swap accounting is off on many machines: nothing to bound
                raise

    quota = None if lim.cpu is None else max(1000, round(lim.cpu * PERIOD_US))
    if version == "v2":
        if lim.memory is not None:
            put(UNIFIED, "memory.max", str(lim.memory))
            put(UNIFIED, "memory.swap.max", "0", optional=True)
        if quota is not None:
            put(UNIFIED, "cpu.max", f"{quota} {PERIOD_US}")
        if lim.tasks is not None:
            put(UNIFIED, "pids.max", str(lim.tasks))
        return
    if lim.memory is not None:
        put("memory", "memory.limit_in_bytes", str(lim.memory))
        put("memory", "memory.memsw.limit_in_bytes", str(lim.memory), optional=True)
    if quota is not None:
        put("cpu", "cpu.cfs_period_us", str(PERIOD_US))
        put("cpu", "cpu.cfs_quota_us", str(quota))
    if lim.tasks is not None:
        put("pids", "pids.max", str(lim.tasks))


def entering(
    dirs: Mapping[str, str], *, files: int | None, uid: int | None, gid: int | None,
    groups: Iterable[int],
) -> Callable[[], None]:  # fmt: skip
    """What the child does before exec: joins its cgroup, takes its open-files limit, then
    drops to its account (after joining: an account may not move itself into a cgroup)."""
    procs = [os.path.join(d, "cgroup.procs") for d in sorted(set(dirs.values()))]
    nofile = None
    if files is not None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # Only root may raise the hard limit; anyone may lower it.
        nofile = files if os.geteuid() == 0 or hard == resource.RLIM_INFINITY else min(files, hard)
    drop = uid is not None and os.geteuid() == 0
    extra = list(groups)

    def enter() -> None:
        for path in procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writer itself
            finally:
                os.close(fd)
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if drop:
            assert uid is not None and gid is not None
            os.setgroups(extra)
            os.setgid(gid)
            os.setuid(uid)

    return enter


def _pids(folder: str) -> list[int]:
    return [int(p) for p in _words(Path(folder) / "cgroup.procs")]


async def remove(dirs: Mapping[str, str]) -> None:
    """An instance's cgroup, once it has exited: whatever it left running in there is killed
    (systemd's KillMode=control-group), then the folders go (a killed process leaves its
    cgroup a moment after it is reaped)."""
    for folder in sorted(set(dirs.values())):
        pause = 0.002  # doubling: most are empty after a moment (bench/limits.py)
        with anyio.move_on_after(5):
            while True:
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        log.warning("cgroup %s not removed: %s", folder, e.strerror)
                        break
                for pid in _pids(folder):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                await anyio.sleep(pause)
                pause = min(pause * 2, 0.1)


# --- what an instance uses ---------------------------------------------------------------------


def _stat(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file (`memory.stat`, `cpu.stat`, `memory.events`, `oom_control`)."""
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().lstrip("-").isdigit():
                out[key] = int(value)
    except OSError:
        pass
    return out


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def memory(dirs: Mapping[str, str]) -> int | None:
    """Bytes in use (less the page cache the kernel may take back, as `docker stats` says)."""
    if UNIFIED in dirs:
        folder, current = Path(dirs[UNIFIED]), "memory.current"
        inactive = _stat(folder / "memory.stat").get("inactive_file", 0)
    elif "memory" in dirs:
        folder, current = Path(dirs["memory"]), "memory.usage_in_bytes"
        inactive = _stat(folder / "memory.stat").get("total_inactive_file", 0)
    else:
        return None
    used = _number(folder / current)
    return None if used is None else max(0, used - inactive)


def cpu_seconds(dirs: Mapping[str, str]) -> float | None:
    if UNIFIED in dirs:
        usec = _stat(Path(dirs[UNIFIED]) / "cpu.stat").get("usage_usec")
        return None if usec is None else usec / 1e6
    ns = _number(Path(dirs["cpuacct"]) / "cpuacct.usage") if "cpuacct" in dirs else None
    return None if ns is None else ns / 1e9


def throttled(dirs: Mapping[str, str]) -> int:
    """How many CPU periods the cgroup was throttled in (its quota used up)."""
    folder = dirs.get(UNIFIED) or dirs.get("cpu")
    return _stat(Path(folder) / "cpu.stat").get("nr_throttled", 0) if folder else 0


def oom_kills(dirs: Mapping[str, str]) -> int:
    """Processes the kernel killed in the cgroup for its memory limit."""
    if UNIFIED in dirs:
        return _stat(Path(dirs[UNIFIED]) / "memory.events").get("oom_kill", 0)
    if "memory" in dirs:
        return _stat(Path(dirs["memory"]) / "memory.oom_control").get("oom_kill", 0)
    return 0


_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _proc(pid: int) -> tuple[int, float] | None:
    """Without a cgroup: the process itself (not its children), from /proc."""
    try:
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError, IndexError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return rss, (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


class Meter:
    """One process's use as reported: memory now, and CPU in cores over the last few seconds
    (the rate between two readings at least MIN_WINDOW apart)."""

    MIN_WINDOW = 1.0

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (monotonic, cpu seconds)
        self.cores = 0.0
        self.seconds = 0.0  # CPU seconds of the current instance

    def read(self, pid: int | None, dirs: Mapping[str, str]) -> tuple[int, float]:
        if pid is None:
            self._last, self.cores = None, 0.0
            return 0, 0.0
        used, seconds = memory(dirs), cpu_seconds(dirs)
        if used is None or seconds is None:
            own = _proc(pid)
            used = used if used is not None else (own[0] if own else 0)
            seconds = seconds if seconds is not None else (own[1] if own else 0.0)
        now = time.monotonic()
        if self._last is None or seconds < self._last[1]:
            self._last = (now, seconds)
        elif now - self._last[0] >= self.MIN_WINDOW:
            self.cores = round((seconds - self._last[1]) / (now - self._last[0]), 3)
            self._last = (now, seconds)
        self.seconds = seconds
        return used, self.cores
