"""The nemesis's clients, from the `client` namespace: status streams on the library's client
with the command line's defaults (a connection per request, `status` asked for 5 s, each try
1 s: programs/cli/client.py), changes with the real command line (`mesh push|assign|secret set
--wait --json`, `mesh handover --json`), and what the bus says beside them (the seat's record,
declarations put, hosts' `applied` events), all into the history."""

import asyncio
import json
import os
import random
import re
import signal
from pathlib import Path

import anyio
import nats.errors
from nats.aio.client import Client

from mesh import blobs, bus
from mesh.client.asking import VerbFailed, ask, connected
from mesh.model import StatusReply

from .checker import STATUS_TIMEOUT
from .cluster import HOSTS, Cluster
from .inject import Injector

CHANGE_TIMEOUT = 60.0  # a change's --timeout (the command line's default, 900 s, is a build's)
CHANGE_BOUND = 180.0  # a change's command with --wait, to its end
SECRET = "nem-token"
PACE = 0.5  # between two status requests of one stream
HUNG_AFTER = 10.0  # past the status's own timeout: the client's bounds did not hold


def module(folder: Path, name: str, version: int, *, assigned: bool) -> Path:
    """A module of one process that does nothing for long (root: no account to make), its file
    the version and the secret, on every tier if `assigned`."""
    (folder / "src").mkdir(parents=True, exist_ok=True)
    (folder / "src" / "version.txt").write_text(f"{name} version {version}\n")
    (folder / "module.toml").write_text(
        f'[module]\nname = "{name}"\ndescription = "nemesis, version {version}"\n'
        '[bundle.code]\nkind = "files"\nsource = "src"\n'
        f'[process.{name}]\nbundle = "code"\ncommand = ["sleep", "infinity"]\nroot = true\n'
        f'[process.{name}.files]\n"token" = {{ secret = "{SECRET}", mode = "0400" }}\n'
        + ("[assign]\ntiers = [0, 1, 2]\n" if assigned else "")
    )
    return folder


FRAMES = ("cr_frame", "gi_frame", "ag_frame")
AWAITS = ("cr_await", "gi_yieldfrom", "ag_await")


def awaiting(task: asyncio.Task) -> str:
    """The chain of awaits `task` stands in, outermost first, the innermost last."""
    frames: list[str] = []
    coro: object = task.get_coro()
    while coro is not None:
        frame = next((f for f in (getattr(coro, a, None) for a in FRAMES) if f), None)
        if frame is None:
            frames.append(repr(coro)[:120])  # a future, or a coroutine that has ended
            break
        code = frame.f_code
        frames.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        coro = next((c for c in (getattr(coro, a, None) for a in AWAITS) if c), None)
        held = frame.f_locals.get("self")
        if code.co_name == "__aenter__" and hasattr(held, "gen"):
            coro = held.gen  # an asynccontextmanager's generator: its asend shows no frame
    return " > ".join(frames)


class Workload:
    def __init__(self, cluster: Cluster, injector: Injector, seed: int) -> None:
        self.c, self.injector = cluster, injector
        self.history = cluster.history
        self.rng = random.Random(f"workload {seed}")
        self.versions = 0
        self.stopping = anyio.Event()
        self.changes_ended = anyio.Event()

    # --- status, as `mesh status` asks it ------------------------------------------------------

    async def status_once(self) -> None:
        oid = self.history.next_id()
        self.history.add("op", phase="invoke", id=oid, op="status")
        # Where a request that outlives every bound of the client stands, taken just before
        # it is cancelled: the awaits of this task, innermost last.
        stuck: list[str] = []
        task = asyncio.current_task()
        assert task is not None
        looking = asyncio.get_running_loop().call_later(
            STATUS_TIMEOUT + HUNG_AFTER - 0.1, lambda: stuck.append(awaiting(task))
        )
        try:
            with anyio.fail_after(STATUS_TIMEOUT + HUNG_AFTER):
                async with connected(url=self.c.url, creds=None, what="status") as nc:
                    s = await ask(nc, url=self.c.url, verb="status", reply=StatusReply,
                                  timeout=STATUS_TIMEOUT, attempt=1.0)  # fmt: skip
        except VerbFailed as e:
            self.history.add("op", phase="fail", id=oid, op="status", error=str(e)[:200])
            return
        except TimeoutError:
            where = stuck[0] if stuck else "?"
            self.history.add("op", phase="timeout", id=oid, op="status", error=f"hung in {where}")
            return
        finally:
            looking.cancel()
        seat = s.seat
        holder, epoch = (seat.holder, seat.epoch) if seat else (None, None)
        self.history.add("op", phase="ok", id=oid, op="status", holder=holder, epoch=epoch)
        if seat is not None:
            self.injector.holder = seat.holder
            self.history.add("epoch", source="status", holder=seat.holder, epoch=seat.epoch)

    async def status_stream(self) -> None:
        while not self.stopping.is_set():
            await self.status_once()
            await anyio.sleep(PACE)  # ok: a person's pace between two commands

    # --- changes, with the command line ------------------------------------------------------

    async def bounded(self, argv: list[str], oid: int) -> tuple[int | None, Path, Path]:
        """The command run to its end, or to CHANGE_BOUND: then it is sent SIGABRT, which
        (faulthandler) prints where each of its threads stands on its stderr, and killed.
        Its exit code (None: it hung) and where its stdout and stderr are (FOLDER/cli/)."""
        env = {**os.environ, **self.c.env(), "PYTHONFAULTHANDLER": "1"}
        env.pop("MESH_CREDS", None)
        folder = self.c.dir / "cli"
        folder.mkdir(exist_ok=True)
        out_path, err_path = folder / f"{oid}.out", folder / f"{oid}.err"
        with out_path.open("wb") as out_file, err_path.open("wb") as err_file:
            proc = await anyio.open_process(argv, env=env, stdout=out_file, stderr=err_file)
            try:
                with anyio.move_on_after(CHANGE_BOUND):
                    await proc.wait()
                if proc.returncode is not None:
                    return proc.returncode, out_path, err_path
                proc.send_signal(signal.SIGABRT)
                with anyio.move_on_after(5):
                    await proc.wait()
            finally:  # not left behind when the run ends (or is cancelled) meanwhile
                if proc.returncode is None:
                    proc.kill()
        return None, out_path, err_path

    async def cli(self, op: str, args: list[str], **asked) -> None:
        oid = self.history.next_id()
        self.history.add("op", phase="invoke", id=oid, op=op, **asked)
        argv = [*self.c.mesh, *args, "--json", "--timeout", f"{CHANGE_TIMEOUT:g}"]
        code, out_path, err_path = await self.bounded(argv, oid)
        if code is None:
            self.history.add("op", phase="timeout", id=oid, op=op,
                             error=f"ran {CHANGE_BOUND:g}s; its stacks: {err_path}")  # fmt: skip
            return
        out = out_path.read_text(errors="replace").strip()
        try:
            reply = json.loads(out) if out.startswith("{") else None
        except json.JSONDecodeError:
            reply = None
        error = err_path.read_text(errors="replace").strip().splitlines()[-1:]
        if reply is None or (op != "handover" and "plan" not in reply):
            self.history.add("op", phase="fail", id=oid, op=op, code=code,
                             error=error[0][:300] if error else "")  # fmt: skip
            return
        said = re.search(r"at version (\d+)", reply.get("message", ""))
        self.history.add(
            "op", phase="ok", id=oid, op=op, code=code, plan=reply.get("plan"),
            version=said.group(1) if said else reply.get("version"),
            outcome=(reply.get("outcome") or {}).get("state"),
        )  # fmt: skip

    async def push(self, name: str = "nem", *, assigned: bool = True) -> None:
        self.versions += 1
        folder = module(self.c.dir / "modules" / name, name, self.versions, assigned=assigned)
        await self.cli("push", ["push", str(folder), "--wait"], module=name)

    async def assign(self) -> None:
        machine = self.rng.choice(HOSTS)
        await self.cli("assign", ["assign", "extra", machine, "--wait"], module="extra",
                       machines=[machine])  # fmt: skip

    async def secret(self) -> None:
        value = self.c.dir / "secret"
        value.write_text(f"value {self.rng.randrange(10**9)}\n")
        await self.cli("secret", ["secret", "set", SECRET, "--from-file", str(value), "--wait"],
                       name=SECRET)  # fmt: skip

    async def handover(self) -> None:
        await self.cli("handover", ["handover"])

    async def changes(self) -> None:
        ops = [self.push, self.assign, self.secret, self.handover]
        try:
            while not self.stopping.is_set():
                await self.rng.choices(ops, [3, 2, 2, 1])[0]()
                with anyio.move_on_after(self.rng.uniform(1.0, 3.0)):
                    await self.stopping.wait()
        finally:
            self.changes_ended.set()

    async def prepare(self) -> None:
        """The secret the modules name, module `nem` on every machine, module `extra` on none."""
        await self.secret()
        await self.push()
        await self.push("extra", assigned=False)

    # --- what the bus says -------------------------------------------------------------------

    async def watch(self, nc: Client) -> None:
        """Hosts' `applied` events and declarations put (core subscriptions, as they are sent);
        the seat's record read every half second (its revision orders it)."""

        async def applied(msg) -> None:
            e = json.loads(msg.data)
            self.history.add("epoch", source="applied", machine=e["name"], epoch=e["epoch"],
                             digest=e["digest"], ok=e["ok"], step=e.get("step", ""))  # fmt: skip

        async def declared(msg) -> None:
            e = json.loads(msg.data)
            self.history.add("epoch", source="declared", machine=e.get("machine"),
                             epoch=e.get("epoch"), digest=e.get("digest"))  # fmt: skip

        await nc.subscribe("mesh.event.*.applied", cb=applied)
        await nc.subscribe(f"$KV.{blobs.DECLARATIONS}.>", cb=declared)
        last = 0
        while not self.stopping.is_set():
            try:
                kv = await nc.jetstream().key_value(blobs.SEAT)
                entry = await kv.get("mesh-controller")
            except (nats.errors.Error, TimeoutError, OSError):
                entry = None
            if entry is not None and entry.revision != last and entry.value:
                last = entry.revision
                record = json.loads(entry.value)
                self.history.add("epoch", source="bus", holder=record.get("holder"),
                                 epoch=record.get("epoch"), revision=entry.revision)  # fmt: skip
            await anyio.sleep(0.5)  # ok: the record's poll


async def watcher(cluster: Cluster) -> Client:
    return await bus.connect(cluster.url, name="nemesis watch", ca=cluster.ca)
