"""Process limits (docs/modules.md, Process limits): the gate's refusals naming the field; on a real
host with cgroups, a process past its memory_max killed, reported with the limit and restarted;
tasks_max failing a fork the process can log; files_max bounding its open files; cpu_max
throttling it (the cgroup's counters, no timing); the limits kept across a host restart; and a
host that cannot enforce a limit refusing the apply in one line, keeping what runs."""

import os
import signal
from pathlib import Path

import httpx
import pytest
from helpers import CHECKOUT, MESH, ask, await_until, next_failure, ok, ok_json
from module_folders import write_module
from prometheus_client.parser import text_string_to_metric_families

from mesh.embedded import ports
from mesh.modules import compose, gate
from services.host import limits, processes

GOOD = (CHECKOUT / "docs" / "examples" / "hello" / "module.toml").read_text()


def _cgroups_writable() -> str | None:
    """Why this machine cannot run the enforcement tests, or None."""
    if os.geteuid() != 0:
        return "limits are enforced only by a host running as root"
    probe = limits.mount() / "memory" / "mesh-test-probe"
    if not (limits.mount() / "cgroup.controllers").exists():
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            return f"no writable memory cgroup ({e.strerror})"
    return None


NO_CGROUPS = _cgroups_writable()
needs_cgroups = pytest.mark.skipif(NO_CGROUPS is not None, reason=NO_CGROUPS or "")


# --- the gate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field", "says"),
    [
        ('memory_max = "lots"', "process.hello.memory_max", "not an amount of memory"),
        ('memory_max = "1K"', "process.hello.memory_max", "out of range"),
        ("cpu_max = 0", "process.hello.cpu_max", "out of range"),
        ("cpu_max = nan", "process.hello.cpu_max", "out of range"),
        ('cpu_max = "half"', "process.hello.cpu_max", "Expected `float | null`"),
        ("tasks_max = -1", "process.hello.tasks_max", "-1 is out of range"),
        ("files_max = 0", "process.hello.files_max", "0 is out of range"),
    ],
)
def test_the_gate_refuses_a_bad_limit_naming_its_field(line: str, field: str, says: str) -> None:
    text = GOOD.replace('account = "hello"\n', f'account = "hello"\n{line}\n', 1)
    with pytest.raises(gate.Refused) as refused:
        gate.parse(text)
    assert refused.value.field.lstrip("$.") == field, str(refused.value)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_tool_server_takes_limits_and_the_host_agent_none() -> None:
    tool = (CHECKOUT / "docs" / "examples" / "files" / "module.toml").read_text()
    limited = tool.replace('timeout = "30s"', 'timeout = "30s"\nmemory_max = "128M"', 1)
    assert gate.parse(limited).tool["files"].memory_max == "128M"
    with pytest.raises(gate.Refused) as refused:
        gate.parse(tool.replace('timeout = "30s"', 'timeout = "30s"\nfiles_max = 0', 1))
    assert refused.value.field == "tool.files.files_max"
    agent = (CHECKOUT / "services" / "host" / "module.toml").read_text()
    with pytest.raises(gate.Refused) as refused:
        gate.parse(agent.replace("root = true", 'root = true\nmemory_max = "1G"', 1))
    assert refused.value.field == "process.mesh-host.memory_max"
    assert "takes no memory_max" in str(refused.value)


def test_limits_are_canonical_in_the_declaration() -> None:
    def declared(extra: str) -> compose.DProcess:
        text = GOOD.replace('account = "hello"\n', f'account = "hello"\n{extra}\n', 1)
        m = gate.parse(text)
        mv = compose.ModuleVersion(name="hello", version="v", manifest=m,
                                   bundles={b: "sha256:x" for b in m.bundle})  # fmt: skip
        return compose.compose("node-1", [mv]).processes["hello"]

    one = declared('memory_max = "1G"\ncpu_max = 1\ntasks_max = 64\nfiles_max = 1024')
    other = declared('files_max = 1024\ntasks_max = 64\ncpu_max = 1.0\nmemory_max = "1024M"')
    assert compose.canonical_process(one) == compose.canonical_process(other)
    assert one.limits == compose.DLimits(memory=2**30, cpu=1.0, tasks=64, files=1024)
    # a process without limits keeps the bytes (and the digest) it had before limits existed
    assert b"limits" not in compose.canonical_process(declared(""))


# --- on a real host ----------------------------------------------------------------------------

HOG = """\
import time
print("hog starting", flush=True)
held = []
while True:
    held.append(b"\\x01" * (8 * 2**20))  # written: the pages are really used
    print(f"hog holds {len(held) * 8} MiB", flush=True)
"""
FORKER = """\
import os, time
children = 0
while True:
    try:
        pid = os.fork()
    except OSError as e:
        print(f"fork failed after {children} children: {e}", flush=True)
        break
    if pid == 0:
        time.sleep(3600)  # ok: a child that only takes a task
        os._exit(0)
    children += 1
time.sleep(3600)  # ok: runs on, its children with it
"""
OPENER = """\
import os, time
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print(f"opened {len(fds)} files: {e}", flush=True)
time.sleep(3600)  # ok: runs on
"""
# Eight processes spinning: on a machine busy with other work each gets a share of the cores
# (a tenth of one, say), and eight of them still want more than their cgroup's 0.2.
SPIN = """\
import os
for _ in range(7):
    if os.fork() == 0:
        break
while True:
    pass
"""
SLEEPER = "import time\ntime.sleep(3600)  # ok: runs, and uses nothing\n"
SCRIPTS = {
    "src/hog.py": HOG, "src/forker.py": FORKER, "src/opener.py": OPENER, "src/spin.py": SPIN,
    "src/sleeper.py": SLEEPER,
}  # fmt: skip


def limited_module(folder: Path, processes: dict[str, str], *, version: str = "1") -> Path:
    """Module `lim` on node-1: each process runs src/NAME.py as account `lim`, with the limits
    given (TOML lines)."""
    tables = "".join(
        f'[process.{name}]\nbundle = "code"\naccount = "lim"\n'
        f'command = ["python3", "{name}.py"]\n{lines}\n'
        for name, lines in processes.items()
    )
    return write_module(
        folder,
        f'[module]\nname = "lim"\ndescription = "version {version}"\n'
        '[bundle.code]\nkind = "files"\nsource = "src"\n[account.lim]\n'
        f'{tables}[assign]\nmachines = ["node-1"]\n',
        files=SCRIPTS,
    )


async def _process(nc, name: str) -> dict | None:
    nodes = await ask(nc, "mesh.ctl.nodes")
    if not nodes or not nodes.get("nodes"):
        return None
    return next((p for p in nodes["nodes"][0]["processes"] if p["name"] == name), None)


def _log(tmp_path: Path, name: str) -> str:
    try:
        return (
            tmp_path / "hosts" / "node-1" / "processes" / name / "logs" / "output.log"
        ).read_text()
    except FileNotFoundError:
        return ""


def _cgroup(pid: int, controller: str) -> Path:
    """The folder of `pid`'s cgroup in a v1 hierarchy."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return limits.mount() / controller / path.lstrip("/")
    raise AssertionError(f"pid {pid} has no {controller} cgroup")


@needs_cgroups
async def test_a_process_past_its_memory_max_is_killed_named_and_restarted(
    nc, tmp_path, cli, start_fleet, start_host
) -> None:
    port = ports.free_port()
    await start_fleet(hosts=1, start_host=lambda name, *flags: start_host(
        name, *flags, "--metrics", str(port)))  # fmt: skip
    ok(cli("push", str(limited_module(tmp_path / "m", {"hog": 'memory_max = "64M"'}))))

    async def killed_for_it():
        p = await _process(nc, "hog")
        return p if p and p.get("reason") == "memory limit 64M reached" else None

    p = await await_until(killed_for_it, within=60, what="hog killed at its memory limit")
    assert p["state"] in ("restarting", "failed") and not p["healthy"]
    # its restart policy (always) applies: it is started again, and killed again
    await await_until(lambda: _async(_log(tmp_path, "hog").count("hog starting") >= 2),
                      within=60, what="hog started again")  # fmt: skip
    log = _log(tmp_path, "hog")
    assert "hog holds 8 MiB" in log and "hog holds 128 MiB" not in log, log[-500:]
    shown = ok_json(cli("nodes", "--json"))["nodes"][0]["processes"]
    assert {"memory", "cpu"} <= shown[0].keys(), shown
    # the host's metrics count the kills, beside each process's memory and CPU seconds
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kills = [s.value for s in families["mesh_host_process_oom_kills"].samples
             if s.name.endswith("_total") and s.labels == {"process": "hog"}]  # fmt: skip
    assert kills and kills[0] >= 1, text
    assert {"mesh_host_process_memory_bytes", "mesh_host_process_cpu_seconds"} <= families.keys()


async def _async(value):
    return value


@needs_cgroups
async def test_tasks_files_and_cpu_are_bounded_and_kept_across_a_host_restart(
    host, nc, tmp_path, cli, start_host
) -> None:
    folder = limited_module(tmp_path / "m", {
        "forker": "tasks_max = 8", "opener": "files_max = 32", "spin": "cpu_max = 0.2",
    })  # fmt: skip
    ok(cli("push", str(folder)))
    await await_until(lambda: _async("fork failed after" in _log(tmp_path, "forker")),
                      within=60, what="the forker to log its failed fork")  # fmt: skip
    said = _log(tmp_path, "forker")
    assert "Resource temporarily unavailable" in said and "after 7 children" in said, said
    await await_until(lambda: _async("opened" in _log(tmp_path, "opener")),
                      within=60, what="the opener to run out of files")  # fmt: skip
    opened = next(line for line in _log(tmp_path, "opener").splitlines() if " opened " in line)
    # `<time> opened N files: …`: each line with the time its host read it
    assert "Too many open files" in opened and int(opened.split()[2]) < 32, opened

    spin = await await_until(lambda: _running(nc, "spin"), within=30, what="spin running")
    cpu = _cgroup(spin["pid"], "cpu")
    assert cpu.name.startswith("lim.spin.") and cpu.parent.name.startswith("mesh-node-1.")
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "20000"
    first = limits.throttled({"cpu": str(cpu)})
    await await_until(lambda: _async(limits.throttled({"cpu": str(cpu)}) > first + 2),
                      within=60, what="spin throttled again and again")  # fmt: skip

    # its use is reported: memory (bytes) and cpu (cores, recent)
    used = await await_until(lambda: _used(nc, "spin"), within=30, what="spin's cpu reported")
    assert used["memory"] > 0 and 0 < used["cpu"] < 2

    # A host restart: the processes stay in their cgroups, their limits with them, their use
    # read on by the new host.
    os.killpg(host.pid, signal.SIGKILL)
    host.wait(timeout=10)
    start_host("node-1", "--tier", "0")

    async def adopted():
        s = await ask(nc, "mesh.host.node-1.status")
        if not s or s["pid"] == host.pid:
            return None
        return next((p for p in s["processes"] if p["name"] == "spin" and p.get("cpu")), None)

    after = await await_until(adopted, within=60, what="the new host to adopt spin, its use read")
    assert after["pid"] == spin["pid"] and _cgroup(spin["pid"], "cpu") == cpu
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "20000"
    forker = await _process(nc, "forker")
    pids = _cgroup(forker["pid"], "pids")
    assert (pids / "pids.max").read_text().strip() == "8"


async def _running(nc, name: str) -> dict | None:
    p = await _process(nc, name)
    return p if p and p["state"] == "running" and p["pid"] else None


async def _used(nc, name: str) -> dict | None:
    p = await _process(nc, name)
    return p if p and p.get("cpu") else None


@needs_cgroups
async def test_a_machine_that_cannot_enforce_a_limit_refuses_the_apply_and_keeps_what_runs(
    nc, tmp_path, procs, nats_url, start_fleet, cli
) -> None:
    def start_host(name: str, *extra: str):
        # the host looks for cgroups where there are none: it can enforce files_max alone
        root = str(tmp_path / "hosts" / name)
        env = {"MESH_NATS_URL": nats_url, "MESH_CGROUP_ROOT": str(tmp_path / "no-cgroups")}
        return procs.start(name, [*MESH, "host", "run", "--name", name, "--root", root, *extra],
                           env=env)  # fmt: skip

    await start_fleet(hosts=1, start_host=start_host)
    node = ok_json(cli("nodes", "--json"))["nodes"][0]
    assert node["facts"]["limits"] == ["files"] and node["facts"]["cgroups"] == ""
    assert "limits: files" in ok(cli("nodes"))

    folder = limited_module(tmp_path / "m", {"sleeper": "files_max = 64"})
    ok(cli("push", str(folder)))
    before = await await_until(lambda: _running(nc, "sleeper"), within=30, what="sleeper running")
    assert before["memory"] > 0  # read from /proc without a cgroup

    events = await nc.subscribe("mesh.event.node-1.applied")
    await nc.flush()
    limited_module(folder, {"sleeper": 'files_max = 64\nmemory_max = "64M"'}, version="2")
    done = cli("push", str(folder), "--wait")
    event = await next_failure(events, within=90)
    assert event["step"] == "limits sleeper", event
    why = event["error"]
    assert why.startswith("memory_max = 64M: this machine cannot enforce it (no memory cgroup")
    assert "\n" not in why
    assert done.returncode != 0 and "memory_max = 64M" in done.stdout + done.stderr
    still = await _process(nc, "sleeper")
    assert still["pid"] == before["pid"] and still["state"] == "running"


def test_leftovers_are_named_for_their_machine(tmp_path) -> None:
    """A host's folder names its machine and its own folder (two hosts of one name apart)."""
    if NO_CGROUPS is not None:
        pytest.skip(NO_CGROUPS)
    one = limits.probe(machine="node-x", state=tmp_path / "a")
    two = limits.probe(machine="node-x", state=tmp_path / "b")
    try:
        assert one.version in ("v1", "v2") and one.can() == ["memory", "cpu", "tasks", "files"]
        names = {Path(p).name for p in [*one.parents.values(), *two.parents.values()]}
        assert len(names) == 2 and all(n.startswith("mesh-node-x.") for n in names)
    finally:
        limits.release(one)
        limits.release(two)
    assert not any(Path(p).exists() for p in [*one.parents.values(), *two.parents.values()])


UNIFIED = Path("/sys/fs/cgroup/unified")  # a hybrid machine's v2 hierarchy (no controllers)


@pytest.mark.skipif(
    os.geteuid() != 0 or not (UNIFIED / "cgroup.controllers").exists(),
    reason="needs root and a cgroup v2 hierarchy at /sys/fs/cgroup/unified",
)
async def test_on_cgroup_v2_a_process_joins_its_cgroup_and_the_machine_says_what_it_lacks(
    tmp_path, monkeypatch
) -> None:
    """What CI's machines have of v2 (a hierarchy beside v1's, without the memory, cpu and
    pids controllers): the v2 path, as far as it goes there."""
    monkeypatch.setenv("MESH_CGROUP_ROOT", str(UNIFIED))
    found = limits.probe(machine="node-v2", state=tmp_path)
    dirs: dict[str, str] = {}
    try:
        assert found.version == "v2"
        has = (UNIFIED / "cgroup.controllers").read_text().split()
        lacking = {limit for limit, c in limits.NEEDS.items() if c not in has}
        assert set(found.cannot) == lacking
        for limit in lacking:
            assert "controller is not enabled at" in found.cannot[limit]
        dirs = limits.create(found, name="lim.sleeper.test", lim=None)
        instance, _ = processes.spawn(
            ["sleep", "30"], cwd=tmp_path, env={}, log_file=tmp_path / "log" / "out.log",
            spec="s", uid=None, gid=None, cgroups=dirs,
        )  # fmt: skip
        line = next(x for x in Path(f"/proc/{instance.pid}/cgroup").read_text().splitlines()
                    if x.startswith("0::"))  # fmt: skip
        assert line.endswith("/lim.sleeper.test"), line
        assert limits.cpu_seconds(dirs) is not None
        await processes.stop(instance, timeout=5)
    finally:
        await limits.remove(dirs)
        limits.release(found)
    assert not Path(found.parents[limits.UNIFIED]).exists()
