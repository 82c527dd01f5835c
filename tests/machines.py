"""Real machines for tests: containers with systemd as PID 1, one per machine (issue 40, item 5).

Each machine is a container of `mesh-machine:local` (images/machine: the mesh's image with
systemd), made by images/build from this checkout, which makes again only what changed. The
machines of a test share a user-defined bridge network of their own and reach each other by
name (the name a test gave: `a`, `b`, also their hostnames); tests use only addresses inside it.
The units a machine enables really start at boot: `reboot` is a shutdown (systemd stops every
unit on the image's stop signal, as on a real reboot) and a boot, `stop` a shutdown (or, hard,
a power cut), `start` a boot.

    def test_join(machines: Machines) -> None:
        machines.add("a", "b")
        machines.run("a", "mesh", "init", "--address", "a")
        token = machines.mesh("a", "token", "create").stdout.strip()  # with a's DIR/env
        machines.run("b", "mesh", "join", token)
        machines.reboot("b")
        machines.mesh("a", "nodes")

Names start with `mesh-test-<pid in hex><random>-` (the network is the prefix itself), so a
leftover is recognisable and its session known; every container and network is labelled with
the pid (and pid namespace) of the session that made it, and `remove_stale` removes those of
sessions whose process is gone. Root and a Docker Engine only: `unavailable()` says why a test
must skip.
"""

import os
import secrets
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from helpers import engine_answers

ROOT = Path(__file__).parent.parent
IMAGE = "mesh-machine:local"
PREFIX = "mesh-test-"
PID_LABEL = "mesh-test.pid"  # the session's process: a leftover's, if that process is gone
NS_LABEL = "mesh-test.pidns"  # ...in this pid namespace: another's pids mean nothing here
TEST_LABEL = "mesh-test.test"  # the test's node id, to tell whose a container was
# Seconds for systemd to boot to `running`: about one for a bare machine, about 35 for the only
# control machine of a mesh (its host's unit is ready once a controller has registered it)
BOOT = 120.0
# Seconds `docker stop` gives systemd's shutdown before it kills the machine: more than systemd's
# own 90 s for a unit that will not stop, so that, as on a real machine, systemd decides.
STOP = 120
BUILD = 3000.0  # images/build from nothing: the base by debootstrap and every image, pip's too
# How the machines run systemd (images/machine/Dockerfile): a fresh writable /run at each boot,
# the cgroup hierarchy for its units, a console (-t) where it writes its boot and shutdown, in
# plain text (`docker logs`). SYS_PTRACE as compose.dev.yaml's machines: a host's tcp check
# reads /proc/PID/fd of processes of other accounts.
FLAGS = ("--tmpfs", "/run", "--tmpfs", "/run/lock", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:ro",
         "-t", "-e", "SYSTEMD_COLORS=0", "--cap-add", "SYS_PTRACE")  # fmt: skip

_built = False  # images/build ran in this process (each worker of a run runs it once)


def unavailable() -> str | None:
    """Why machines cannot be had here, or None."""
    if os.geteuid() != 0:
        return "not root: images/build (it makes mesh-machine:local from this checkout) needs root"
    if not engine_answers():
        return "no Docker Engine answers (.ci/run starts dockerd where it can)"
    return None


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done


def build() -> None:
    """mesh-machine:local as this checkout makes it (images/build locks against other runs, and
    takes seconds when nothing changed)."""
    global _built
    if _built:
        return
    done = subprocess.run([str(ROOT / "images" / "build")], capture_output=True, text=True,
                          timeout=BUILD, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, f"images/build failed:\n{done.stderr[-3000:]}"
    _built = True


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> str:
    return os.readlink("/proc/self/ns/pid")  # pid:[4026531836]


def remove_stale() -> None:
    """Containers and networks of sessions whose process is gone (killed before their own
    clean-up); another session's, still running, are left alone."""
    fmt = f'{{{{.ID}}}} {{{{.Label "{PID_LABEL}"}}}}'
    ours = f"label={NS_LABEL}={_pid_namespace()}"
    # containers first: a network is removed only once none is attached
    for listing, removal in ((["ps", "-a"], ["rm", "-f", "-v"]),
                             (["network", "ls"], ["network", "rm"])):  # fmt: skip
        listed = docker(*listing, "--filter", ours, "--format", fmt).stdout
        dead = [line.split()[0] for line in listed.splitlines() if not _alive(line.split()[-1])]
        if dead:
            docker(*removal, *dead, check=False)


class Machines:
    """A test's machines on their network; `remove` takes everything away."""

    def __init__(self, folder: Path, test: str = "") -> None:
        self.id = f"{os.getpid():x}{secrets.token_hex(2)}"
        self.network = f"{PREFIX}{self.id}"
        self.folder = folder  # where copy_out puts what it copies
        folder.mkdir(parents=True, exist_ok=True)
        self.test = test
        self.names: list[str] = []  # every machine asked for, made or not: all are removed
        self._labels = ("--label", f"{PID_LABEL}={os.getpid()}",
                        "--label", f"{NS_LABEL}={_pid_namespace()}",
                        "--label", f"{TEST_LABEL}={test}")  # fmt: skip
        self._network_made = False

    def container(self, machine: str) -> str:
        return f"{self.network}-{machine}"

    # --- machines --------------------------------------------------------------------------

    def add(self, *machines: str) -> None:
        """Start these machines (their names are their hostnames) and wait until each has
        booted: they boot together."""
        if not self._network_made:
            docker("network", "create", *self._labels, self.network)
            self._network_made = True
        for machine in machines:
            assert machine not in self.names, f"machine {machine} exists"
            self.names.append(machine)
            docker("run", "-d", "--name", self.container(machine), "--hostname", machine,
                   "--network", self.network, "--network-alias", machine, *self._labels,
                   *FLAGS, IMAGE)  # fmt: skip
        for machine in machines:
            self.wait_booted(machine)

    def wait_booted(self, machine: str, within: float = BOOT) -> None:
        """Until systemd says the machine is `running`. `degraded` fails the test with the
        units that failed and their journal; so does a container that stopped."""
        deadline = time.monotonic() + within
        state = ""
        while time.monotonic() < deadline:
            left = max(1.0, deadline - time.monotonic())
            # --wait blocks until the boot is over; before systemd's bus is up it fails at once
            try:
                done = self._exec(machine, ["systemctl", "is-system-running", "--wait"],
                                  timeout=left)  # fmt: skip
            except subprocess.TimeoutExpired:
                break
            state = done.stdout.strip() or done.stderr.strip()
            if state == "running":
                return
            if state == "degraded":
                pytest.fail(f"machine {machine} booted degraded:\n{self.failed(machine)}")
            if not self.is_running(machine):
                logs = docker("logs", "--tail", "40", self.container(machine), check=False)
                pytest.fail(f"machine {machine} stopped while booting:\n{logs.stdout}{logs.stderr}")
            time.sleep(0.1)  # ok: polling interval of a condition with a deadline
        pytest.fail(f"machine {machine} not booted after {within:g}s (systemd says {state!r}):\n"
                    f"{self.failed(machine)}")  # fmt: skip

    def failed(self, machine: str) -> str:
        """The units that failed on a machine, each with the end of its journal."""
        done = self._exec(machine, ["systemctl", "--failed", "--no-legend", "--plain"])
        units = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
        out = [done.stdout.strip() or "(no unit failed)"]
        for unit in units:
            journal = self.journal(machine, unit, lines=30)
            out.append(f"--- {unit}\n{journal}")
        jobs = self._exec(machine, ["systemctl", "list-jobs", "--no-legend"]).stdout.strip()
        if jobs:
            out.append(f"--- jobs still queued\n{jobs}")
        return "\n".join(out)

    def journal(self, machine: str, unit: str | None = None, lines: int = 100) -> str:
        argv = ["journalctl", "--no-pager", "-n", str(lines)] + (["-u", unit] if unit else [])
        done = self._exec(machine, argv)
        return done.stdout + done.stderr

    def is_running(self, machine: str) -> bool:
        done = docker("inspect", "-f", "{{.State.Running}}", self.container(machine), check=False)
        return done.stdout.strip() == "true"

    def reboot(self, machine: str) -> bool:
        """systemd shuts down (every unit stopped as on a real reboot), the container starts
        again with a fresh /run, and systemd boots: enabled units start. Whether the shutdown
        was clean (as `stop`)."""
        clean = self.stop(machine)
        self.start(machine)
        return clean

    def stop(self, machine: str, *, hard: bool = False) -> bool:
        """A shutdown; `hard`: a power cut (SIGKILL to everything, nothing stopped in order).
        Whether systemd halted by itself; if it had to be killed after STOP seconds, the
        machine's last console lines (systemd-shutdown's, which the journal never has) are
        printed."""
        name = self.container(machine)
        if hard:
            docker("kill", name)
            return False
        docker("stop", "-t", str(STOP), name, timeout=STOP + 60)
        code = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        if code != "137":  # 128 + SIGKILL: Docker's, once STOP had passed
            return True
        logs = docker("logs", "--tail", "30", name, check=False)
        print(f"machine {machine}: shutdown unfinished after {STOP}s, killed:")
        print(logs.stdout + logs.stderr)
        return False

    def start(self, machine: str) -> None:
        """A stopped machine powered on again, booted."""
        docker("start", self.container(machine))
        self.wait_booted(machine)

    # --- inside a machine ------------------------------------------------------------------

    def _exec(
        self,
        machine: str,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        input: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        flags = ["-i"] if input is not None else []
        for key, value in (env or {}).items():
            flags += ["-e", f"{key}={value}"]
        if user is not None:
            flags += ["-u", user]
        argv = ["docker", "exec", *flags, self.container(machine), *argv]
        return subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout)

    def run(
        self,
        machine: str,
        *argv: str,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        user: str | None = None,
        input: str | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        """argv inside the machine (`docker exec`, as root unless `user`; never a shell's
        string), its output as text. `env` adds to the image's environment (PATH has `mesh`).
        `check`: an exit other than 0 fails, with what it said."""
        done = self._exec(machine, list(argv), env=env, user=user, input=input, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"on {machine}: {list(argv)} exited {done.returncode}:\n"
                                 f"{done.stderr}{done.stdout}")  # fmt: skip
        return done

    def mesh(
        self,
        machine: str,
        *args: str,
        check: bool = True,
        folder: str = "/var/lib/mesh",
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        """`mesh ARGS` on the machine with the settings `mesh init` wrote there (FOLDER/env:
        its NATS URL, CA and the admin's credentials), when that file exists."""
        # A fixed script: the file and the arguments are its argv, never parts of it
        script = 'if [ -r "$1" ]; then set -a; . "$1"; set +a; fi; shift; exec mesh "$@"'
        return self.run(machine, "sh", "-c", script, "sh", f"{folder}/env", *args,
                        check=check, timeout=timeout)  # fmt: skip

    def address(self, machine: str) -> str:
        """The machine's IP on the test's network (asked each time: a reboot may change it)."""
        fmt = f'{{{{(index .NetworkSettings.Networks "{self.network}").IPAddress}}}}'
        address = docker("inspect", "-f", fmt, self.container(machine)).stdout.strip()
        assert address, f"machine {machine} has no address (is it running?)"
        return address

    def copy_out(self, machine: str, path: str, dest: Path | None = None) -> Path:
        """A file or folder of the machine, copied here (FOLDER/MACHINE/NAME unless `dest`)."""
        target = dest or self.folder / machine / Path(path).name
        target.parent.mkdir(parents=True, exist_ok=True)
        docker("cp", f"{self.container(machine)}:{path}", str(target))
        return target

    def copy_in(self, machine: str, source: Path, path: str) -> None:
        """A file or folder of here into the machine, at `path`."""
        docker("cp", str(source), f"{self.container(machine)}:{path}")

    def write(self, machine: str, path: str, text: str, mode: int = 0o644) -> None:
        """A file of the machine, with this text (as root)."""
        local = self.folder / f".write-{secrets.token_hex(4)}"
        local.write_text(text)
        local.chmod(mode)
        try:
            self.copy_in(machine, local, path)
        finally:
            local.unlink()

    # --- the end ---------------------------------------------------------------------------

    def report(self) -> str:
        """Each running machine's failed units and its journal's end: printed at the end, so
        pytest shows it when the test failed."""
        out = []
        for machine in self.names:
            if self.is_running(machine):
                journal = self.journal(machine, lines=60)
                out.append(f"=== {machine}\n{self.failed(machine)}\n{journal}")
        return "\n".join(out)

    def remove(self) -> None:
        if self.names:
            docker("rm", "-f", "-v", *(self.container(m) for m in self.names), check=False)
        if self._network_made:
            docker("network", "rm", self.network, check=False)


@pytest.fixture
def machines(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Machines]:
    """Machines for this test (`machines.add("a", "b")`); removed at its end, even when it
    failed. Skips, saying why, without root or a Docker Engine."""
    why = unavailable()
    if why:
        pytest.skip(why)
    remove_stale()
    build()
    made = Machines(tmp_path / "machines", request.node.nodeid)
    try:
        yield made
    finally:
        try:
            print(made.report())
        finally:
            made.remove()
