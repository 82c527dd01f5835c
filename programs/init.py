"""`mesh init`: a new mesh on this machine, its controller a process from the start.

In order: credentials for every piece (NATS admits nobody else), nats-server with JetStream,
PostgreSQL and the store's schema, then the controller, the way the mesh installs any service: a
short-lived controller (`mesh-init`) holds the seat, this machine is placed as an operator places
any machine (tier 0, the builder, `role=control`: where services/controller runs) and its host
starts, `services/controller` is pushed and its plan runs, the host starts the controller
process from its module, and `mesh-init` hands the seat over to it and exits. The servers and
the host outlive the command; DIR/mesh.json lists them. Never a container.

With `--address HOST` (programs/addresses.py), the servers listen for other machines too, their
certificates name those addresses and the URLs written (DIR/env, DIR/nats/url, every credentials
file, the controllers' store URL) name the first: a credentials file copied to another machine
leads back here.

Another mesh's settings in the environment (a `mesh dev up`'s DIR/env sourced) are dropped first
and said in one line: this command checks its servers against its own CA and connects with its
own URLs and credentials, and the pieces it starts (the host, `mesh-init`, their units) are given
this mesh's settings alone.

Then systemd units for the servers and the host (programs/units.py), in DIR/units: where systemd
is the service manager and we are root, they are installed, enabled and started in place of the
processes started here (each stopped, then its unit started with the same argv), so they come
back after a reboot; otherwise, or with `--print-units`, they are printed and nothing is
installed.
"""

import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import anyio
import anyio.to_thread

import services.controller
from mesh import blobs, bus, subjects, wire
from mesh.auth import creds, registry, secretkeys
from mesh.client import changes
from mesh.client.asking import VerbFailed, connected
from mesh.embedded import pgauth, postgres
from mesh.embedded.children import Child, spawn, stop_supervised
from mesh.entry import command
from mesh.model import PlanProgress, PlanReply, StatusReply
from mesh.modules import gate
from mesh.modules.load import load
from mesh.names import check_name
from mesh.store import db
from mesh.store.migrate import migrate
from programs.addresses import served
from programs.dev_up import DevError, DevMesh, DirLock, _nats_answers, check_nats, say
from programs.placement import CONTROL, NotPlaced, place, place_new
from programs.units import Unit, UnitError, main_pid, of_mesh, shown, systemctl, systemd_runs
from programs.units import install as install_units
from programs.units import write as write_units

INIT_INSTANCE = "mesh-init"
STORE_CA_FILE = "store-ca.pem"  # services/controller/module.toml: the secret mesh-store-ca
WITHIN = 180.0
# What names one mesh in particular, which a shell that sourced another's DIR/env (or runs
# inside a host's process) holds: read where this command connects (mesh/config.py) and carried
# into the pieces it starts and their units (programs/units.py keeps every MESH_*). Settings of
# how programs run (MESH_POSTGRES_BIN, MESH_PORTS, MESH_DEBUG, ...) are kept.
ANOTHER_MESHS = (
    "MESH_CA", "MESH_NATS_URL", "MESH_CREDS", "MESH_SYSTEM_CREDS", "MESH_DIR",
    "MESH_DATABASE_URL", "MESH_SECRETS_KEY_FILE", "MESH_FILES", "MESH_MACHINE", "MESH_PROCESS",
    "MESH_CONSOLE_TOKEN", "MESH_NATS_SIGNER_FILE",
)  # fmt: skip


def default_dir() -> Path:
    return Path("/var/lib/mesh") if os.geteuid() == 0 else Path.home() / ".mesh"


async def init(
    *, folder: Path, name: str, port: int | None, nats: int = 1, print_units: bool = False,
    addresses: list[str] | None = None,
) -> None:  # fmt: skip
    check_name(name, field="--name")
    check_nats(nats)
    where = served(addresses or [])  # before anything is made: a refusal leaves no folder
    forget_another_mesh()
    folder.mkdir(parents=True, exist_ok=True)
    lock = DirLock(folder)
    lock.acquire()
    record = folder.resolve() / "mesh.json"
    if record.exists():
        raise DevError(
            f"{folder} already holds a mesh (see {record}); `source {folder}/env` to use it, "
            "or choose another --dir"
        )
    mesh = DevMesh(folder=folder, hosts=0, port=port, detached=True, nats=nats, served=where)
    try:
        status = await _make(mesh, name=name, record=record)
    finally:
        lock.release()
    await _record_and_say(mesh, name=name, record=record, status=status, print_units=print_units)


def forget_another_mesh(command: str = "mesh init", tell: Callable[[str], None] = say) -> None:
    """Another mesh's settings dropped from this process's environment, which every connection
    here reads and every piece started inherits; said in one line (`mesh join` too)."""
    found = [key for key in ANOTHER_MESHS if key in os.environ]
    for key in found:
        del os.environ[key]
    if found:
        tell(f"{command}: ignoring {', '.join(found)} from the environment (another mesh's): "
            "this mesh uses its own")  # fmt: skip


async def _make(mesh: DevMesh, *, name: str, record: Path) -> StatusReply:
    """The mesh, up to its controller holding the seat as a process; on any failure, whatever
    was started is stopped and `record` is not left behind."""
    temporary: Child | None = None
    try:
        # The URL(s) first: every credentials file issued then carries them.
        mesh.choose_nats()
        mesh.issue_credentials()
        with registry.locked(mesh.mesh) as users:
            host_creds = users.ensure("host", name, builder=True)
            users.save()
        await mesh.start_nats()
        await mesh.start_postgres()
        await mesh.ensure_secrets_key()
        conn = await db.connect(mesh.database_url)
        try:
            applied = await migrate(conn)
        finally:
            await conn.close()
        say(f"store schema ready ({len(applied)} migration(s) applied)")
        temporary = await spawn(
            INIT_INSTANCE,
            mesh._mesh_argv("controller", "run", "--instance", INIT_INSTANCE,
                            "--creds", str(mesh.creds["ctl"])),
            log=mesh.dir / "logs" / f"{INIT_INSTANCE}.log", env=mesh._env(store=True),
        )  # fmt: skip
        await _until(mesh, lambda s: s.seat is not None and s.seat.holder == INIT_INSTANCE,
                     f"the seat held by {INIT_INSTANCE}")  # fmt: skip
        # This machine's place, set as an operator sets any machine's (never by the host
        # itself): tier 0, the builder, and a control machine, where services/controller runs.
        await _place(mesh, name)
        host = await mesh._start(
            name,
            mesh._mesh_argv(
                "host", "run", "--name", name,
                "--root", str(mesh.dir / "host"), "--creds", str(host_creds),
            ),
        )  # fmt: skip
        say(f"host {name} started, tier 0, builder (pid {host.pid}, root {mesh.dir / 'host'})")
        await _until(mesh, lambda s: s.nodes.up >= 1, f"host {name} registered")

        # The controllers' URL with their role's password: the host writes it as a file only
        # the controller's account reads, and the CA that the store's certificate is checked
        # by beside it (`sslrootcert` names that file: mesh.config.database_url).
        await _install_controller(mesh.nats_url, admin=mesh.creds["admin"], secrets={
            "mesh-database-url": pgauth.with_rootcert(mesh.database_url, STORE_CA_FILE),
            "mesh-store-ca": mesh.mesh.ca.read_text(),
            "mesh-controller-creds": mesh.creds["ctl"].read_text(),
            "mesh-system-creds": mesh.creds["system"].read_text(),
            "mesh-nats-signer": mesh.mesh.nats_signer.read_text(),  # admits `mesh join`s
        })  # fmt: skip

        temporary.proc.send_signal(signal.SIGTERM)  # hands the seat to the controller process
        await _until(mesh, lambda s: s.seat is not None and s.seat.holder != INIT_INSTANCE,
                     "the controller process to hold the seat")  # fmt: skip
        status = await _status(mesh)
        assert status is not None and status.seat is not None
        await temporary.stop()
        return status
    except BaseException:
        with anyio.CancelScope(shield=True):
            say("mesh init failed: stopping what it started")
            if temporary is not None:
                await temporary.stop(sig=signal.SIGKILL)
            for child in mesh.children:
                if child.name == name:  # the host first: DevMesh.stop knows node-N only
                    await child.stop()
            await mesh.stop()
            stop_supervised(mesh.dir)
            for made in (record, mesh.dir / "env"):
                made.unlink(missing_ok=True)
        raise


async def _record_and_say(
    mesh: DevMesh, *, name: str, record: Path, status: StatusReply, print_units: bool
) -> None:
    """DIR/env, DIR/mesh.json and the units; the units installed where systemd runs and we are
    root (unless `print_units`); then what was made, and how to use and stop it."""
    env = mesh.write_env()
    pids = {c.name: c.pid for c in mesh.children}
    servers = [c for c in mesh.children if c.name.startswith("nats-")]

    def save() -> None:
        record.write_text(json.dumps({
            "name": name, "made": datetime.now(UTC).isoformat(), "nats_url": mesh.nats_url,
            "database_url": pgauth.without_password(mesh.database_url), "pids": pids,
            "host_root": str(mesh.dir / "host"),
        }, indent=2) + "\n")  # fmt: skip

    save()
    units = of_mesh(mesh.children, host=name, folder=mesh.dir)
    written = write_units(units, mesh.dir / "units")
    managed = systemd_runs() and os.geteuid() == 0 and not print_units
    if managed:
        pids.update(await _to_systemd(mesh, units))
        save()
    seat = status.seat
    assert seat is not None
    say(f"the controller runs as a process: {seat.holder} (pid {seat.pid}), epoch {seat.epoch}")
    print(
        f"\nmade a mesh in {mesh.dir}:\n"
        f"  nats-server   {mesh.nats_url} (pid {', '.join(str(pids[c.name]) for c in servers)}), "
        f"TLS with the mesh's CA ({mesh.mesh.ca}), every connection authenticated; "
        f"credentials in {mesh.mesh.creds}\n"
        f"  PostgreSQL    pid {pids['postgres']}, data in {mesh.dir / 'pg'}, TLS only "
        + (
            f"through its front (pid {pids['postgres-front']}), "
            if "postgres-front" in pids
            else ""
        )
        + f"with the mesh's CA, and passwords only (in {mesh.mesh.store_passwords}; the "
        "controllers' role `mesh` is no superuser)\n"
        f"  host {name:<8} pid {pids[name]}, tier 0, builds bundles\n"
        f"  controller    a process the host runs from services/controller (pid {seat.pid})\n"
        f"use it:          source {env}; mesh status\n"
        f"add a machine:   mesh machine add NAME --dir {mesh.dir}   (prints its join command)\n"
        + (
            f"systemd runs the servers and the host (enabled: they start at every boot): "
            f"{' '.join(u.name for u in units)}\n"
            f"stop it:         systemctl disable --now {' '.join(u.name for u in units)} "
            "(the host leaves the controller running: kill it too)\n"
            if managed
            else f"stop it:         kill {' '.join(str(p) for p in pids.values())} "
            "(the host leaves the controller running: kill it too)\n"
        ),
        flush=True,
    )
    if not managed:
        print(f"systemd units for them, in {mesh.dir / 'units'} ({_why_printed(print_units)}):\n")
        print(shown(units, written), flush=True)


def _why_printed(asked: bool) -> str:
    if asked:
        return "--print-units: not installed"
    if not systemd_runs():
        return "systemd is not this machine's service manager: not installed"
    return (
        "not installed: that takes root; as root, copy them into /etc/systemd/system and "
        "`systemctl enable` them, and they start at the next boot"
    )


async def _to_systemd(mesh: DevMesh, units: list[Unit]) -> dict[str, int]:
    """Hand each piece to its unit, one at a time: the units installed and enabled, then our
    process stopped and its unit started with the same argv (the host's unit is ready once its
    agent registered). Returns each piece's new pid."""
    try:
        await anyio.to_thread.run_sync(install_units, units)
    except UnitError as e:
        raise DevError(f"installing the units: {e}; the mesh runs as started") from None
    children = {c.name: c for c in mesh.children}
    urls, admin = mesh.nats_url.split(","), str(mesh.creds["admin"])
    pids = {}
    for unit in units:
        child = children[unit.piece]
        await child.stop(sig=signal.SIGINT if unit.kill_signal == "SIGINT" else signal.SIGTERM)
        try:
            await anyio.to_thread.run_sync(systemctl, "start", unit.name)
        except UnitError as e:
            raise DevError(f"{unit.piece} is stopped and its unit did not start: {e}; "
                           f"`journalctl -u {unit.name}` says why") from None  # fmt: skip
        if unit.piece.startswith("nats-"):
            url = urls[int(unit.piece.removeprefix("nats-n")) - 1]
            await _ready(f"nats-server on {url}", lambda u=url: _nats_answers(u, admin))
        elif unit.piece in ("postgres", "postgres-front"):  # answers through the front, if any
            port = int(mesh.database_url.rsplit("@", 1)[-1].split("/")[0].rsplit(":", 1)[1])
            await postgres.wait_ready(
                port, password=mesh.passwords.of(postgres.PG_USER), deadline=WITHIN,
                alive=lambda: True, ca=mesh.store_ca,
            )  # fmt: skip
        pids[unit.piece] = await anyio.to_thread.run_sync(main_pid, unit.name)
        say(f"{unit.piece} runs under systemd: {unit.name} (pid {pids[unit.piece]})")
    return pids


async def _ready(what: str, probe: Callable[[], Awaitable[bool]]) -> None:
    deadline = time.monotonic() + WITHIN
    while time.monotonic() < deadline:
        if await probe():
            return
        await anyio.sleep(0.2)
    raise DevError(f"not ready within {WITHIN:g}s: {what}")


async def _install_controller(url: str, *, admin: Path, secrets: dict[str, str]) -> None:
    """As the admin, on the library's client: the controller's secrets set, services/controller
    pushed, and its plan followed to its end (a line per tier as it moves)."""
    module = Path(services.controller.__file__).parent
    try:
        local = load(module)
    except gate.Refused as e:
        raise DevError(f"{module}: {e}") from None
    told: dict[int, str] = {}

    def show(p: PlanReply | PlanProgress) -> None:
        for t in p.tiers:
            if told.get(t.tier) != t.state:
                told[t.tier] = t.state
                say(f"  tier {t.tier}: {t.state}")

    async with connected(url=url, creds=str(admin), what="installing the controller") as nc:
        try:
            for name, value in secrets.items():
                await changes.set_secret(nc, url=url, name=name, value=value.encode())
            say(f"installing the controller: mesh push {module}")
            reply = await changes.push(nc, url=url, module=local)
            say(reply.message)
            if reply.plan is not None:
                await changes.until_done(nc, url=url, plan_id=reply.plan, show=show)
        except (VerbFailed, blobs.BlobMissing) as e:
            raise DevError(f"installing the controller: {e}") from None


async def _place(mesh: DevMesh, name: str) -> None:
    nc = await bus.connect(
        mesh.nats_url, name="mesh init", creds=str(mesh.creds["admin"]), reconnect=False
    )
    try:
        await place(nc, url=mesh.nats_url, machine=name, tier=0,
                    labels={"builder": "true", **CONTROL}, timeout=30)  # fmt: skip
    except VerbFailed as e:
        raise DevError(f"placing {name}: {e}") from None
    finally:
        await nc.close()
    say(f"machine {name} placed: tier 0, labels builder=true, role=control")


async def _status(mesh: DevMesh) -> StatusReply | None:
    return await _status_at(mesh.nats_url, creds=mesh.creds["admin"])


async def _status_at(url: str, *, creds: Path) -> StatusReply | None:
    try:
        nc = await bus.connect(url, name="mesh init", creds=str(creds), reconnect=False)
    except bus.Unreachable:
        return None
    try:
        data = await bus.request(nc, subjects.ctl("status"), b"{}", deadline=time.monotonic() + 2)
        return wire.decode_reply(data, StatusReply)
    except (bus.NoAnswer, wire.RemoteError):
        return None
    finally:
        await nc.close()


async def _until(mesh: DevMesh, ok: Callable[[StatusReply], bool], what: str) -> None:
    await _until_at(mesh.nats_url, creds=mesh.creds["admin"], ok=ok, what=what,
                    alive=mesh._check_alive, logs=mesh.dir / "logs")  # fmt: skip


async def _until_at(
    url: str, *, creds: Path, ok: Callable[[StatusReply], bool], what: str,
    alive: Callable[[], None], logs: Path,
) -> StatusReply:  # fmt: skip
    deadline = time.monotonic() + WITHIN
    while time.monotonic() < deadline:
        alive()
        status = await _status_at(url, creds=creds)
        if status is not None and ok(status):
            return status
        await anyio.sleep(0.2)
    raise DevError(f"not ready within {WITHIN:g}s: waiting for {what}; logs in {logs}")


async def init_running(
    *, url: str, admin: Path, controller: Path, database_url: str, hosts: int, control: int,
    placed: Path, logs: Path,
) -> StatusReply:  # fmt: skip
    """`mesh dev init` (compose.dev.yaml's one-shot `init`): `mesh init`'s way of installing the
    controller, for a nats-server and a PostgreSQL that already run and hosts node-1..N that
    start once their machines are placed. The store's schema; a short-lived controller
    (`mesh-init`, a child of this command) takes the seat; node-1..N placed as `mesh dev up`
    places them, node-1..`control` also `role=control`; `placed` written (the hosts wait for
    it); once every host is up the controller's secrets are set, services/controller is pushed,
    and `mesh-init` hands the seat to a controller process a control machine's host runs, the
    others standing by. A mesh whose controller already runs (kept volumes) is left as it is."""
    conn = await db.connect(database_url)
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    say(f"store schema ready ({len(applied)} migration(s) applied)")
    status = await _status_at(url, creds=admin)
    if status is not None and status.seat is not None and status.seat.holder != INIT_INSTANCE:
        # a controller runs already (init run again beside a running mesh): placed, and done
        say(f"the controller runs already: {status.seat.holder} holds the seat")
        return await _install(url=url, admin=admin, controller=controller,
                              database_url=database_url, hosts=hosts, control=control,
                              placed=placed, logs=logs, temporary=None)  # fmt: skip
    # The key of the secrets: `mesh dev creds --export` puts it beside the controllers'
    # credentials (their volume alone); every controller of this mesh opens the store with it.
    key = controller.parent / secretkeys.FILE_NAME
    if not key.is_file():
        raise DevError(f"{key}: no key of the secrets beside the controllers' credentials "
                       "(mesh dev creds --export writes it)")  # fmt: skip
    env = {**os.environ, "MESH_NATS_URL": url, "MESH_DATABASE_URL": database_url,
           "MESH_SECRETS_KEY_FILE": str(key)}  # fmt: skip
    temporary = await spawn(
        INIT_INSTANCE,
        command("controller", "run", "--instance", INIT_INSTANCE, "--creds", str(controller)),
        log=logs / f"{INIT_INSTANCE}.log", env=env,
    )  # fmt: skip
    try:
        return await _install(url=url, admin=admin, controller=controller,
                              database_url=database_url, hosts=hosts, control=control,
                              placed=placed, logs=logs, temporary=temporary)  # fmt: skip
    finally:
        with anyio.CancelScope(shield=True):
            await temporary.stop(sig=signal.SIGKILL)


async def _install(
    *, url: str, admin: Path, controller: Path, database_url: str, hosts: int, control: int,
    placed: Path, logs: Path, temporary: Child | None,
) -> StatusReply:  # fmt: skip
    """The machines placed, `placed` written, every host up; then, with a short-lived
    controller holding the seat (`temporary`), the controller installed and the seat handed to
    it; without one (the controller runs already), nothing more."""

    def alive() -> None:
        if temporary is not None and not temporary.running:
            raise DevError(f"{INIT_INSTANCE} exited with code {temporary.proc.returncode}; "
                           f"last lines of {temporary.log}:\n{temporary.tail()}")  # fmt: skip

    def until(
        ok: Callable[[StatusReply], bool], what: str, *, check: Callable[[], None] = alive
    ) -> Awaitable[StatusReply]:
        return _until_at(url, creds=admin, ok=ok, what=what, alive=check, logs=logs)

    if temporary is not None:
        await until(lambda s: s.seat is not None and s.seat.holder == INIT_INSTANCE,
                    f"the seat held by {INIT_INSTANCE}")  # fmt: skip
    nc = await bus.connect(url, name="mesh dev init", creds=str(admin), reconnect=False)
    try:
        lines = await place_new(nc, url=url, hosts=hosts, alive=alive, within=WITHIN,
                                control=control)  # fmt: skip
    except NotPlaced as e:
        raise DevError(str(e)) from None
    finally:
        await nc.close()
    for line in lines:
        say(line)
    placed.write_text("")
    await until(lambda s: s.nodes.up >= hosts, f"{hosts} host(s) up")
    say(f"{hosts} host(s) up")
    if temporary is None:
        return await until(lambda s: True, "the status")
    # The CA a TLS store's certificate is checked by (services/controller/module.toml), as
    # `mesh init` sets it; compose's store is not TLS, and its URL names no such file.
    await _install_controller(url, admin=admin, secrets={
        "mesh-database-url": database_url,
        "mesh-controller-creds": controller.read_text(),
        "mesh-store-ca": creds.read(admin).ca or "",
        "mesh-system-creds": "",  # compose's nats-server has no system account: no kicker
        "mesh-nats-signer": "",  # no machine joins compose's mesh: it has its three
    })  # fmt: skip
    temporary.proc.send_signal(signal.SIGTERM)  # hands the seat to a controller process
    status = await until(
        lambda s: s.seat is not None and s.seat.holder != INIT_INSTANCE
        and len(s.standbys) >= control - 1,
        "a controller process to hold the seat, the others standing by",
        check=lambda: None,  # mesh-init exits as it hands over
    )  # fmt: skip
    assert status.seat is not None
    say(f"the controller runs as a process: {status.seat.holder} (pid {status.seat.pid}), "
        f"{len(status.standbys)} standing by")  # fmt: skip
    return status
