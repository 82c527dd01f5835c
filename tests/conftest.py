"""Fixtures: a real PostgreSQL once per session, a database and a nats-server per test, and
real controller and host processes that are always killed at the end, even when a test fails.

Set MESH_TEST_DATABASE_URL to use an existing PostgreSQL instead of the embedded one.

Beside them, what tests share as fixtures: a fleet started with their parameters
(`start_fleet`), the command line on their NATS (`cli`), a folder other accounts reach
(`open_dir`, `made`), stores with a standby (`pairs`); plain helpers are helpers.py's.
"""

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
from faults import servers  # noqa: F401 (a fixture: tests/faults.py)
from helpers import MESH, Fleet, Procs, fleet_up, mesh_cli, seeds_container, wait_until
from machines import machines  # noqa: F401 (a fixture: tests/machines.py)
from netmesh import net, netmesh  # noqa: F401 (fixtures: tests/netmesh.py)
from secured import as_identity, secured, secured_fleet  # noqa: F401 (fixtures: tests/secured.py)
from standby import Pair

from mesh.auth import secretkeys
from mesh.embedded import natsd, pgauth, ports, postgres
from mesh.embedded.children import stop_supervised

# Ports of their own for each worker of a run in workers (pytest-xdist's gw0, gw1, ...): below
# the kernel's ephemeral range, so that no other worker's server nor any outgoing connection's
# local end takes a port between its choice and its server's bind (mesh/embedded/ports.py).
# Inherited by every process a test starts.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit() and int(_WORKER[2:]) < 8:
    _first = 20000 + 1500 * int(_WORKER[2:])
    os.environ[ports.RANGE] = f"{_first}-{_first + 1499}"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _names(database: str) -> set[str]:
    out = subprocess.run(["getent", database], capture_output=True, text=True).stdout
    return {line.split(":", 1)[0] for line in out.splitlines() if line}


SESSIONS = Path(tempfile.gettempdir()) / "mesh-test-sessions"


def _live_sessions() -> list[Path]:
    """Marker files of pytest sessions of this suite still running on this machine."""
    live = []
    for marker in SESSIONS.glob("*.pid"):
        try:
            os.kill(int(marker.stem), 0)
            live.append(marker)
        except (ValueError, ProcessLookupError):
            marker.unlink(missing_ok=True)
        except PermissionError:
            live.append(marker)
    return live


@pytest.fixture(scope="session", autouse=True)
def remove_accounts_made_by_tests() -> Iterator[None]:
    """Hosts in tests create real accounts (as root): every account and group that appears
    during the session is removed at its end, even when tests fail. Set up first, torn down
    last, after the servers that run as such accounts have stopped.

    Several sessions may run at once on one machine (people iterating on different parts):
    the accounts known before the first of them started are kept in SESSIONS/baseline, and
    only the last session to end removes what appeared since, so no session removes the
    accounts another is still using."""
    SESSIONS.mkdir(exist_ok=True)
    baseline = SESSIONS / "baseline.json"
    if not _live_sessions() or not baseline.exists():
        baseline.write_text(json.dumps({"passwd": sorted(_names("passwd")),
                                        "group": sorted(_names("group"))}))  # fmt: skip
    marker = SESSIONS / f"{os.getpid()}.pid"
    marker.touch()
    yield
    marker.unlink(missing_ok=True)
    if os.geteuid() != 0 or _live_sessions():
        return
    try:
        known = json.loads(baseline.read_text())
    except FileNotFoundError:  # another session ended in the same moment and cleaned up
        return
    for name in sorted(_names("passwd") - set(known["passwd"])):
        subprocess.run(["userdel", "--remove", name], capture_output=True)
    for name in sorted(_names("group") - set(known["group"])):
        subprocess.run(["groupdel", name], capture_output=True)
    baseline.unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def secrets_key_file() -> Iterator[Path]:
    """The key of the secrets (mesh/auth/secretkeys.py) for every controller a test starts, as
    `mesh dev up` gives its own: MESH_SECRETS_KEY_FILE, inherited by the processes tests start.
    One per session: every test has a database of its own, whose secrets it seals."""
    folder = Path(tempfile.mkdtemp(prefix="mesh-test-key-"))
    path = folder / "secrets.key"
    secretkeys.make(path)
    os.environ["MESH_SECRETS_KEY_FILE"] = str(path)
    yield path
    os.environ.pop("MESH_SECRETS_KEY_FILE", None)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    # Hosts' roots live outside pytest's folder, which pytest makes 0700 whenever a session
    # starts: processes run as other accounts must reach their bundles. tmp_path/hosts links
    # there, so tests read their hosts' files where they always did.
    real = Path(tempfile.mkdtemp(prefix="mesh-test-hosts-"))
    real.chmod(0o755)
    (tmp_path / "hosts").symlink_to(real, target_is_directory=True)
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()
        shutil.rmtree(real, ignore_errors=True)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder of this test's own outside pytest's (which pytest makes 0700 whenever a session
    starts, even another's), open to the accounts servers and hosts run as; removed after."""
    path = Path(tempfile.mkdtemp(prefix="mesh-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def made(open_dir: Path) -> Iterator[Path]:
    """A folder for `mesh init` (OPEN_DIR/mesh); what the mesh started there is stopped after,
    even when init failed half-way."""
    folder = open_dir / "mesh"
    yield folder
    record = folder / "mesh.json"
    if record.exists():
        for pid in json.loads(record.read_text())["pids"].values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    stop_supervised(folder)  # the controller the host ran
    for proc in Path("/proc").glob("[0-9]*"):  # anything else started there, even if init failed
        try:
            if str(open_dir).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.fixture
async def pairs(open_dir: Path) -> AsyncIterator[list[Pair]]:
    """The PostgreSQL primaries and standbys a test started (tests/standby.py, in OPEN_DIR):
    every one is stopped at its end."""
    started: list[Pair] = []
    yield started
    for pair in started:
        for child in reversed(pair.children):
            await child.stop(sig=signal.SIGINT, timeout=20)


# --- PostgreSQL: one server per session, one database per test ----------------------------------


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    given = os.environ.get("MESH_TEST_DATABASE_URL")
    if given:
        yield given
        return
    # Not under pytest's own temporary folder: pytest makes /tmp/pytest-of-<user> private
    # (0700) whenever a session starts, which would cut PostgreSQL's account off its data.
    folder = Path(tempfile.mkdtemp(prefix="mesh-test-pg-"))
    data = folder / "data"
    passwords = pgauth.Passwords(folder / "passwords")
    superuser = passwords.of(postgres.PG_USER)
    postgres.init(data, passwords=passwords)
    port = ports.free_port()
    log = open(data.parent / "postgres.log", "ab")
    proc = subprocess.Popen(
        postgres.argv(data, port=port),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=data,
        **postgres.run_as(),
        start_new_session=True,
    )
    try:
        asyncio.run(
            postgres.wait_ready(
                port, password=superuser, deadline=30, alive=lambda: proc.poll() is None
            )
        )
        yield postgres.url(port, password=superuser)  # the superuser: it makes every test's db
    finally:
        proc.send_signal(signal.SIGINT)  # fast shutdown
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def database_url(pg_admin_url: str) -> str:
    """A fresh, empty database for this test; dropped afterwards."""
    name = f"mesh_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    base, _, _ = pg_admin_url.rpartition("/")
    yield f"{base}/{name}"
    admin = await asyncpg.connect(pg_admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


# --- NATS: a server per test (it starts in milliseconds) ----------------------------------------


@pytest.fixture
def nats_server(tmp_path: Path, procs: Procs, request: pytest.FixtureRequest) -> subprocess.Popen:
    """This test's nats-server process (its URL is the `nats_url` fixture). An indirect
    parameter, if any, is the server's `max_payload`."""
    port = ports.free_port()
    conf = natsd.write_config(
        tmp_path / "nats", port=port, name=f"test-{port}",
        max_payload=getattr(request, "param", None),
    )  # fmt: skip
    proc = procs.start("nats-server", natsd.argv(conf))
    wait_until(
        lambda: proc.poll() is not None or _port_open(port), within=10, what="nats-server to listen"
    )
    assert proc.poll() is None, (tmp_path / "nats-server.log").read_text()
    proc.url = f"nats://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return proc


@pytest.fixture
def nats_url(nats_server: subprocess.Popen) -> str:
    return nats_server.url  # type: ignore[attr-defined]


@pytest.fixture
async def nc(nats_url: str):
    client = await nats.connect(nats_url)
    yield client
    await client.close()


# --- mesh services as real processes ------------------------------------------------------------


@pytest.fixture
def start_controller(procs: Procs, nats_url: str, database_url: str):
    def start(instance: str, *extra: str) -> subprocess.Popen:
        return procs.start(
            instance,
            [*MESH, "controller", "run", "--instance", instance, *extra],
            env={"MESH_NATS_URL": nats_url, "MESH_DATABASE_URL": database_url},
        )

    return start


@pytest.fixture
def start_host(procs: Procs, nats_url: str, tmp_path: Path):
    def start(name: str, *extra: str, beat: float = 1.0) -> subprocess.Popen:
        return procs.start(
            name,
            [*MESH, "host", "run", "--name", name, "--root", str(tmp_path / "hosts" / name),
             "--beat", str(beat), *extra],
            env={"MESH_NATS_URL": nats_url},
        )  # fmt: skip

    return start


@pytest.fixture
def start_fleet(nc, start_controller, start_host) -> Callable[..., Awaitable[Fleet]]:
    """`await start_fleet(hosts=N, builder=..., controllers=..., within=...)`: a fleet of this
    test's controllers and hosts up (helpers.fleet_up, whose keywords it takes; a test may
    give its own `start_controller` or `start_host` too)."""
    return functools.partial(fleet_up, nc, start_controller=start_controller, start_host=start_host)


@pytest.fixture
async def host(start_fleet):
    """A controller and one host, node-1 (tier 0), up; the host's process is returned."""
    return (await start_fleet(hosts=1)).hosts["node-1"]


@pytest.fixture
def cli(nats_url: str) -> Callable[..., subprocess.CompletedProcess]:
    """`cli(*args, stdin=...)`: the `mesh` command line on this test's NATS as the end-to-end
    tests run it (helpers.mesh_cli), --timeout 120 and three minutes in all for a loaded
    machine; keywords given override these."""
    return functools.partial(mesh_cli, nats_url=nats_url, answer=120, timeout=180)


# --- the fast subset ----------------------------------------------------------------------------

REAL_SERVICES = {"procs", "nats_server", "pg_admin_url", "database_url", "machines"}
# Modules that start whole meshes themselves (`mesh dev up`, `mesh init`, namespaces).
WHOLE_MESHES = {"test_dev_up", "test_init", "test_cluster", "test_network"}


# What in a test module's source says it starts host agents otherwise than by the `start_host`
# fixture (itself, or inside a whole mesh).
_STARTS_HOSTS = re.compile(r'start_host|"host", "run"|DevUp\(|"dev", "up"|"init"|secured_fleet')


def _starts_hosts(module: object, seen: dict[str, bool]) -> bool:
    path = getattr(module, "__file__", None)
    if path is None:
        return False
    if path not in seen:
        seen[path] = bool(_STARTS_HOSTS.search(Path(path).read_text()))
    return seen[path]


def pytest_configure(config: pytest.Config) -> None:
    # beside pyproject.toml's markers: it is set here, by the fixture's use
    config.addinivalue_line(
        "markers", "machines: runs machines with systemd in containers (tests/machines.py)"
    )
    config.addinivalue_line(
        "markers",
        "deploys_controller: its hosts deploy services/controller, which retires a container "
        "named mesh-controller (helpers.seeds_container)",
    )


@pytest.fixture(autouse=True)
def _seeds_container_shared(request: pytest.FixtureRequest):
    """A test whose hosts deploy services/controller waits while the story holds its container."""
    if request.node.get_closest_marker("deploys_controller") is None:
        yield
        return
    with seeds_container(alone=False):
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts real servers or services is `slow` (seconds to minutes each):
    `pytest -m "not slow"` runs the rest (gate, composition, archives, wire, planner logic) in
    seconds while iterating. The whole suite stays the README's test command and CI's.

    A slow test of a module that starts host agents is also `hosts`: its outcome can depend on
    whether a container engine answers on the machine (a host probes for one at its start and
    reports it), so CI runs these again with the engine hidden (.ci/run); the rest would only
    repeat themselves."""
    sources: dict[str, bool] = {}
    for item in items:
        if REAL_SERVICES & set(getattr(item, "fixturenames", ())) or (
            item.module is not None and item.module.__name__ in WHOLE_MESHES
        ):
            item.add_marker(pytest.mark.slow)
        # Hosts inside `machines` (tests/machines.py) never see this machine's engine: hiding
        # it would only make those tests skip. Nor do they run this process's loop: .ci/run's
        # uvloop pass leaves out what is marked `machines`, which would only repeat itself.
        if "machines" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.machines)
        if (
            item.get_closest_marker("slow") is not None
            and "machines" not in item.fixturenames
            and ("start_host" in item.fixturenames or _starts_hosts(item.module, sources))
        ):
            item.add_marker(pytest.mark.hosts)
    # Slow tests first (in their order): in workers, the quick ones then fill the gaps at the
    # end rather than a minute-long test starting last and running alone.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the suite's default, pyproject.toml): twice the cores, at least 4. Most of a
    slow test's time is spent waiting on the services it started (a beat, a check, a plan's
    step), so more workers than cores keep the cores busy; more than that only queues."""
    return max(4, 2 * (os.cpu_count() or 1))
