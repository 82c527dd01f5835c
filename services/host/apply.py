"""Applying this machine's declaration: watch its key in `mesh-declarations`, and make the machine
match, step by step, idempotently, reporting each apply on `mesh.event.<name>.applied`.

Order: accounts -> bundles -> files -> containers -> prepare -> processes -> tool servers ->
replaced containers (removed only once the process that replaces them is healthy). A declaration
whose epoch is older than one already applied is ignored (fencing: a paused old controller
cannot roll the machine back). What was applied is kept in ROOT/state/applied.json, so a host
restart does not redo it.
"""

import base64
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
from nats.aio.client import Client

from mesh import blobs, bus, subjects, wire
from mesh.lifetime import first_of
from mesh.model import (
    Applied,
    ApplyStepKind,
    ProcessState,
    SecretReply,
    SecretRequest,
)
from mesh.modules.compose import DBundle, Declaration, DProcess, DTool, tools_of
from mesh.modules.gate import AGENT, duration
from services.host import (
    accounts,
    bundles,
    containers,
    files,
    limits,
    metrics,
    preparing,
    successor,
    watch,
)
from services.host.limits import Cgroups
from services.host.steps import StepFailed
from services.host.supervisor import Launch, Supervisor, spec_digest
from services.host.tools import ToolRuntime

log = logging.getLogger(__name__)


class Envelope(msgspec.Struct):
    machine: str
    digest: str
    epoch: int
    declaration: Declaration
    holder: str = ""  # the controller that published it


RETRY_FIRST = 5.0
RETRY_MAX = 60.0
BUS_PATIENCE = 30.0  # how long a step waits out a bus or JetStream that does not answer
KEEP_PATIENCE = 5.0  # a secret already on disk for the declaration applied: asked this long


class _Latest:
    """The newest value of the key, and whether one came since it was last taken."""

    def __init__(self) -> None:
        self._value: bytes | None = None
        self._event = anyio.Event()
        self._newer = anyio.Event()

    def put(self, value: bytes, *, interrupts: bool = True) -> None:
        self._value = value
        self._event.set()
        if interrupts:
            self._newer.set()

    def put_back(self, value: bytes) -> None:
        if not self._event.is_set():  # nothing newer came: try this one again
            self.put(value)

    async def arrived(self) -> None:
        await self._event.wait()

    def newer(self) -> anyio.Event:
        """Set once a value with another digest comes after the one last taken: a long apply
        (a start-first trial) gives way to it. The same digest again (a new holder publishing
        under its epoch) does not interrupt anything."""
        return self._newer

    async def take(self) -> bytes:
        await self._event.wait()
        self._event = anyio.Event()
        self._newer = anyio.Event()
        assert self._value is not None
        return self._value


class _Head(msgspec.Struct):
    """What a value is, read without decoding its declaration."""

    machine: str = ""
    digest: str = ""
    epoch: int = 0
    holder: str = ""


def fenced(epoch: int, holder: str, *, applied: int, by: str) -> str | None:
    """Why a declaration of `epoch` from `holder` must not be applied on a machine that has
    applied `applied` from `by`, or None. An older epoch is a paused old holder's; the same
    epoch from another holder means two controllers got one epoch (a store that lost writes):
    the first one applied keeps it."""
    if epoch < applied:
        return f"epoch {epoch} is older than epoch {applied}"
    if epoch == applied and holder and by and holder != by:
        return f"epoch {epoch} comes from {holder}, but {by} published it first"
    return None


def _head(value: bytes) -> _Head | None:
    try:
        return wire.decode_json(value, _Head)
    except msgspec.DecodeError:
        return None


class Applier:
    def __init__(
        self, *, name: str, nc: Client, root: Path, supervisor: Supervisor, tools: ToolRuntime,
        nats_url: str = "", hand_over: Callable[[str, Path], Awaitable[None]] | None = None,
        cgroups: Cgroups | None = None,
    ) -> None:  # fmt: skip
        self._nats_url = nats_url  # told to processes, as MESH_NATS_URL: where the mesh is
        # Starts the new agent from a bundle (key, folder) and hands the machine to it (main.py);
        # raises successor.Failed when the new agent does not take over.
        self._hand_over = hand_over
        self.name = name
        self.supervisor = supervisor
        self.tools = tools
        self.engine = containers.Engine(host=name, root=str(root))
        self.cgroups = cgroups or Cgroups()  # what this machine can enforce (limits.py)
        self._unused: dict[str, float] = {}  # bundle folder -> when first seen unused
        self._first = True  # after a (re)start, apply once even an applied digest: adopt
        self._newer = anyio.Event()  # set when a newer declaration waits behind this apply
        self._applying: str | None = None  # the digest being applied now
        self._last_report: Applied | None = None  # sent again when it may have been lost
        self._nc = nc
        self._root = root
        self._state = root / "state" / "applied.json"
        self.epoch = 0
        self.holder = ""  # the controller whose declaration was applied last
        self.digest: str | None = None
        try:
            saved = json.loads(self._state.read_text())
            self.epoch, self.digest = int(saved["epoch"]), saved["digest"]
            self.holder = str(saved.get("holder", ""))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass

    def _save(self) -> None:
        self._state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text(
            json.dumps({"epoch": self.epoch, "digest": self.digest, "holder": self.holder})
        )
        tmp.replace(self._state)

    async def watch(self) -> None:
        """Apply every value of this machine's key, the current one first."""
        latest = _Latest()

        async def receive() -> None:
            # Through a consumer the server lets this host create for its own key only.
            newest, by = 0, ""  # the highest epoch seen on the key, and whose it was
            async for value in watch.values(self._nc, self.name):
                head = _head(value)
                top, top_by = max((newest, by), (self.epoch, self.holder))
                why = fenced(head.epoch, head.holder, applied=top, by=top_by) if head else None
                if head is not None and why is not None:
                    # A paused old holder's late put: refused here, so it neither interrupts
                    # the apply in progress nor takes the place of a value still to apply.
                    log.info("host %s: a declaration of %s: ignored", self.name, why)
                    await self._report(head, failed=StepFailed("fence", f"{why}: ignored"))
                    continue
                if head is not None and (head.epoch, head.holder) > (newest, by):
                    newest, by = head.epoch, head.holder
                latest.put(value, interrupts=head is None or head.digest != self._applying)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            backoff = RETRY_FIRST
            while True:
                # Only the newest value is applied: values that came during a long apply
                # (a start-first trial, a replaced container) are skipped, not replayed.
                value = await latest.take()
                self._newer = latest.newer()
                if await self.apply(value):
                    backoff = RETRY_FIRST
                    continue
                # A failed apply is tried again, later, unless a newer value comes first.
                with anyio.move_on_after(backoff):
                    await latest.arrived()
                latest.put_back(value)
                backoff = min(backoff * 2, RETRY_MAX)

    async def apply(self, value: bytes) -> bool:
        """Apply one value of the key; False if a step failed (it is worth trying again)."""
        try:
            env = wire.decode_json(value, Envelope)
        except msgspec.DecodeError as e:
            log.warning("host %s: a declaration that does not decode: %s", self.name, e)
            return True
        if env.machine != self.name:
            return True
        refused = fenced(env.epoch, env.holder, applied=self.epoch, by=self.holder)
        if refused is not None:
            why = f"{refused}: ignored"
            log.info("host %s: a declaration of %s", self.name, why)
            await self._report(env, failed=StepFailed("fence", why))
            return True
        if env.digest == self.digest and not self._first:
            newer = env.epoch > self.epoch
            self.epoch, self.holder = env.epoch, env.holder or self.holder
            self._save()
            metrics.applied(self.digest, self.epoch)
            if newer:
                # A new holder's republication: it learns at once what this machine runs,
                # on the reports' subject, not only once a registration reaches it (a paused
                # old holder, still in the queue group, may take those for a while).
                await self._report(env)
            return True
        started = time.monotonic()
        self._applying = env.digest
        try:
            await self._apply(env.declaration, resuming=env.digest == self.digest)
        except StepFailed as e:
            log.warning("host %s: apply of %s stopped at %s", self.name, env.digest[:19], e)
            _count_failure(e.kind, started)
            await self._report(env, failed=e)
            return False
        except Exception as e:  # a step that failed in a way we did not name: still a report
            log.exception("host %s: apply of %s failed", self.name, env.digest[:19])
            _count_failure("apply", started)
            await self._report(env, failed=StepFailed("apply", f"{type(e).__name__}: {e}"))
            return False
        finally:
            self._applying = None
            # Until an apply works, the machine may be part way to a declaration it never
            # reached: the one it had (a plan's revert) must be applied again, not skipped.
            self._first = True
        self._first = False  # adopted what the last host left: only after an apply that worked
        self.epoch, self.digest = env.epoch, env.digest
        self.holder = env.holder or self.holder
        self._save()
        # Never the bundle this agent runs from, declared or not (an agent taken off mesh-host).
        keep = {*env.declaration.bundles, successor.own_key()}
        bundles.collect(self._root, keep, self._unused, time.time())
        took = time.monotonic() - started
        metrics.APPLY_SECONDS.labels("ok").observe(took)
        metrics.applied(env.digest, env.epoch)
        log.info("host %s applied %s (epoch %d) in %.2fs", self.name, env.digest[:19], env.epoch,
                 took)  # fmt: skip
        await self._report(env)
        return True

    async def _report(self, env: Envelope | _Head, *, failed: StepFailed | None = None) -> None:
        """Say how an apply ended: ok, or `failed`."""
        applied = Applied(
            name=self.name, digest=env.digest, epoch=env.epoch, ok=failed is None,
            step=failed.step if failed else "", error=failed.error if failed else "",
            processes=self.supervisor.states(),
        )  # fmt: skip
        # A refused stale value (the fence) says nothing of what the machine has.
        if failed is None or failed.kind != "fence":
            self._last_report = applied
        await self._nc.publish(subjects.event(self.name, "applied"), wire.encode(applied))

    async def report_again(self) -> None:
        """The last `applied` report again, with the processes as they are now: a core NATS
        publish is lost when a nats-server dies under the host or under the holder, and a
        plan's step would wait for it until its deadline. Sent when the host's connection
        comes back and when the holder says `held` again (after its own reconnect)."""
        last = self._last_report
        if last is None:
            return
        again = msgspec.structs.replace(last, processes=self.supervisor.states())
        await self._nc.publish(subjects.event(self.name, "applied"), wire.encode(again))

    async def _apply(self, decl: Declaration, *, resuming: bool = False) -> None:
        """`resuming`: the declaration applied last, again after a restart (or a reboot)."""
        self._limits(decl)
        ids: dict[str, accounts.Identity] = {}
        for name, account in sorted(decl.accounts.items()):
            try:
                ids[name] = await anyio.to_thread.run_sync(accounts.ensure, name, account)
            except Exception as e:
                raise StepFailed("account", str(e), name=name) from None
        for key, bundle in sorted(decl.bundles.items()):
            try:
                # A JetStream that does not answer for a while (a server of the cluster lost,
                # a leader being elected) is waited out, not taken for a failed step.
                await blobs.patiently(
                    lambda b=bundle, k=key: self._bundle(k, b), within=BUS_PATIENCE
                )
            except Exception as e:
                raise StepFailed("bundle", str(e), name=key) from None
        # A tool server has its folder and files where a process has them (their names differ).
        runs: dict[str, DProcess | DTool] = {**decl.processes, **tools_of(decl)}
        nobody = False  # no controller gave a kept secret: the rest are kept without asking
        for proc, p in sorted(runs.items()):
            owner = ids[p.account] if p.account else accounts.current()
            folder = files.ensure_folder(self._root / "processes" / proc / "files", owner=owner)
            for rel, f in sorted(p.files.items()):
                try:
                    kept = resuming and f.text is None and (folder / rel).exists()
                    data = (
                        f.text.encode()
                        if f.text is not None
                        else None
                        if kept and nobody
                        else await self._secret(f.secret, keep=kept)
                    )
                    if data is None:
                        nobody = True
                        # After a reboot the controller may be a process of this very machine,
                        # which nobody else starts: the secret written for this declaration
                        # serves until a controller answers (asked once an apply, not 5 s each).
                        log.info("host %s: no controller gave secret %s: %s/%s kept as applied",
                                 self.name, f.secret, proc, rel)  # fmt: skip
                        continue
                    files.write(folder, rel, data, mode=int(f.mode, 8), owner=owner)
                except Exception as e:
                    raise StepFailed("file", str(e), name=f"{proc}/{rel}") from None
        await self._containers(decl)
        launches = {
            name: self._launch(name, p, decl, ids)
            for name, p in sorted(decl.processes.items())
            if name != AGENT  # the agent itself: handed over to, never supervised (_agent)
        }
        for name, launch in launches.items():
            running = self.supervisor.running.get(name)
            if launch.decl.prepare and (running is None or running.launch.spec != launch.spec):
                if not self.supervisor.adoptable(name, launch.spec):
                    await preparing.prepare(launch)
        problems = await self.supervisor.reconcile(launches, interrupt=self._newer)
        if problems:
            raise StepFailed("processes", "; ".join(problems))
        servers = {name: self._launch(name, t, decl, ids) for name, t in tools_of(decl).items()}
        problems = await self.tools.reconcile(servers, interrupt=self._newer)
        if problems:
            raise StepFailed("tools", "; ".join(problems))
        await self._replace(decl)
        await self._agent(decl)

    def _limits(self, decl: Declaration) -> None:
        """The first step: a limit this machine cannot enforce fails the apply before anything
        changes, as a container does on a machine without an engine."""
        runs: dict[str, DProcess | DTool] = {**decl.processes, **tools_of(decl)}
        for name, p in sorted(runs.items()):
            why = limits.refusal(self.cgroups, p.limits) if p.limits else None
            if why is not None:
                raise StepFailed("limits", why, name=name)

    async def _agent(self, decl: Declaration) -> None:
        """The last step: the agent itself (mesh-host). Running the declared bundle, it reports
        itself running and healthy; otherwise it hands the machine to a new agent from that
        bundle (services/host/successor.py), which applies this declaration again and reports
        it. This agent then exits; if the new one fails to start, this one runs on."""
        p = decl.processes.get(AGENT)
        if p is None or p.bundle == successor.own_key():
            if p is not None:
                successor.forget_failure(self._root)
            self.supervisor.agent = (
                None if p is None
                else ProcessState(name=AGENT, state="running", healthy=True, pid=os.getpid())
            )  # fmt: skip
            return
        self.supervisor.agent = None
        failed = successor.failure(self._root, p.bundle)
        if failed is not None:
            raise StepFailed("agent", f"{failed} (not tried again until another version)")
        if self._hand_over is None:
            raise StepFailed("agent", "this agent cannot hand itself over")
        try:
            await self._hand_over(p.bundle, bundles.folder(self._root, p.bundle))
        except successor.Failed as e:
            successor.record_failure(self._root, p.bundle, str(e))
            raise StepFailed("agent", str(e)) from None

    async def _containers(self, decl: Declaration) -> None:
        """Declared containers running as declared; ours that are not declared (and that no
        process replaces: those go only once their replacement is healthy) removed."""
        replaced = {p.replaces for p in decl.processes.values() if p.replaces}
        try:
            for name, c in sorted(decl.containers.items()):
                await self.engine.ensure(name, c)
            for name in await self.engine.mine():
                if name not in decl.containers and name not in replaced:
                    log.info("container %s is no longer declared: removing it", name)
                    await self.engine.remove(name)
        except containers.EngineMissing as e:
            if decl.containers:
                raise StepFailed("containers", str(e)) from None
        except Exception as e:
            raise StepFailed("containers", f"{type(e).__name__}: {e}") from None

    async def _replace(self, decl: Declaration) -> None:
        """A container a process replaces goes once that process is healthy, not before."""
        for name, p in sorted(decl.processes.items()):
            if not p.replaces:
                continue
            supervised = self.supervisor.running.get(name)
            within = 60.0
            if p.check is not None:  # each check may take its timeout to answer
                every = duration(p.check.every) + duration(p.check.timeout)
                within = max(within, (p.check.passes + 3) * every)
            if supervised is not None:
                with anyio.move_on_after(within):
                    await first_of(supervised.became_healthy, self._newer)
            if supervised is not None and not supervised.healthy and self._newer.is_set():
                raise StepFailed(
                    "replaces",
                    f"a newer declaration came first; container {p.replaces} left serving",
                    name=p.replaces,
                )
            if supervised is None or not supervised.healthy:
                why = supervised.last_error if supervised else "not running"
                raise StepFailed(
                    "replaces",
                    f"process {name} did not get healthy within {within:g}s ({why}); "
                    f"container {p.replaces} left serving",
                    name=p.replaces,
                )
            try:
                if await self.engine.remove(p.replaces):
                    log.info("process %s is healthy: container %s removed", name, p.replaces)
            except containers.EngineMissing:
                pass  # no engine, so no container to remove
            except Exception as e:
                raise StepFailed("replaces", f"{type(e).__name__}: {e}", name=p.replaces) from None

    def _launch(
        self, name: str, p: DProcess | DTool, decl: Declaration, ids: dict[str, accounts.Identity]
    ) -> Launch:
        owner = ids[p.account] if p.account else None
        bundle = decl.bundles[p.bundle]
        if bundle.kind == "system":
            cwd = Path(bundle.path or "/")
        else:
            cwd = bundles.folder(self._root, p.bundle)
        files_folder = self._root / "processes" / name / "files"
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": owner.home if owner and owner.home else str(files_folder),
            "MESH_FILES": str(files_folder),
            "MESH_PROCESS": name,
            "MESH_MACHINE": self.name,
            **({"MESH_NATS_URL": self._nats_url} if self._nats_url else {}),
            **p.env,
        }
        uid = owner.uid if owner else (None if not p.root else 0)
        gid = owner.gid if owner else (None if not p.root else 0)
        return Launch(
            name=name,
            decl=p,
            spec=spec_digest(p),
            cwd=cwd,
            env=env,
            uid=uid,
            gid=gid,
            groups=owner.groups() if owner else [],
            log_file=self._root / "processes" / name / "logs" / "output.log",
            cgroups=self.cgroups,
            group=f"{p.module}.{name}",
        )

    async def _bundle(self, key: str, bundle: DBundle) -> None:
        await bundles.ensure(self._nc, self._root, key, bundle)

    async def _secret(self, name: str | None, *, keep: bool = False) -> bytes | None:
        """The secret from the controller; None if none answers and `keep`: the file on disk
        was written for this declaration."""
        assert name is not None
        try:
            data = await bus.request(
                self._nc,
                subjects.ctl_host(self.name, "secret"),
                wire.encode(SecretRequest(name=name)),
                # retried while the seat or a server moves
                deadline=time.monotonic() + (KEEP_PATIENCE if keep else BUS_PATIENCE),
            )
        except bus.NoAnswer:
            if keep:
                return None
            raise
        reply = wire.decode_reply(data, SecretReply)
        return base64.b64decode(reply.value)


def _count_failure(step: ApplyStepKind, started: float) -> None:
    metrics.APPLY_FAILURES.labels(step).inc()
    metrics.APPLY_SECONDS.labels("failed").observe(time.monotonic() - started)
