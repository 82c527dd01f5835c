"""Applying this machine's declaration: watch its key in `mesh-declarations`, and make the machine
match, step by step, idempotently, reporting each apply on `mesh.event.<name>.applied`.

Order: accounts -> bundles -> files (processes, checks and containers come next). A declaration
whose epoch is older than one already applied is ignored (fencing: a paused old controller
cannot roll the machine back). What was applied is kept in ROOT/state/applied.json, so a host
restart does not redo it.
"""

import base64
import json
import logging
import time
from pathlib import Path

import anyio
import msgspec
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, NotFoundError

from mesh import blobs, bus, subjects, wire
from mesh.model import Applied, SecretReply, SecretRequest
from mesh.modules.compose import Declaration
from services.host import accounts, bundles, files

log = logging.getLogger(__name__)


class Envelope(msgspec.Struct):
    machine: str
    digest: str
    epoch: int
    declaration: Declaration


class StepFailed(Exception):
    def __init__(self, step: str, error: str) -> None:
        super().__init__(f"{step}: {error}")
        self.step = step
        self.error = error


class Applier:
    def __init__(self, *, name: str, nc: Client, root: Path) -> None:
        self.name = name
        self._nc = nc
        self._root = root
        self._state = root / "state" / "applied.json"
        self.epoch = 0
        self.digest: str | None = None
        try:
            saved = json.loads(self._state.read_text())
            self.epoch, self.digest = int(saved["epoch"]), saved["digest"]
        except (OSError, ValueError, KeyError, TypeError):
            pass

    def _save(self) -> None:
        self._state.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"epoch": self.epoch, "digest": self.digest}))
        tmp.replace(self._state)

    async def watch(self) -> None:
        """Apply every value of this machine's key, the current one first."""
        js = self._nc.jetstream()
        while True:
            try:
                kv = await js.key_value(blobs.DECLARATIONS)
                break
            except (BucketNotFoundError, NotFoundError):
                await anyio.sleep(1)  # no controller has held the seat yet
        watcher = await kv.watch(self.name)
        async for entry in watcher:
            if entry is None or not entry.value:
                continue  # the end of the initial values, or a delete
            await self.apply(entry.value)

    async def apply(self, value: bytes) -> None:
        try:
            env = msgspec.json.decode(value, type=Envelope)
        except msgspec.DecodeError as e:
            log.warning("host %s: a declaration that does not decode: %s", self.name, e)
            return
        if env.machine != self.name:
            return
        if env.epoch < self.epoch:
            why = f"epoch {env.epoch} is older than the applied epoch {self.epoch}: ignored"
            log.info("host %s: a declaration of %s", self.name, why)
            await self._report(env, ok=False, step="fence", error=why)
            return
        if env.digest == self.digest:
            self.epoch = env.epoch
            self._save()
            return
        started = time.monotonic()
        try:
            await self._apply(env.declaration)
        except StepFailed as e:
            log.warning("host %s: apply of %s stopped at %s", self.name, env.digest[:19], e)
            await self._report(env, ok=False, step=e.step, error=e.error)
            return
        self.epoch, self.digest = env.epoch, env.digest
        self._save()
        log.info(
            "host %s applied %s (epoch %d) in %.2fs",
            self.name, env.digest[:19], env.epoch, time.monotonic() - started,
        )  # fmt: skip
        await self._report(env, ok=True)

    async def _report(self, env: Envelope, *, ok: bool, step: str = "", error: str = "") -> None:
        applied = Applied(
            name=self.name, digest=env.digest, epoch=env.epoch, ok=ok, step=step, error=error
        )
        await self._nc.publish(f"mesh.event.{self.name}.applied", wire.encode(applied))

    async def _apply(self, decl: Declaration) -> None:
        ids: dict[str, accounts.Identity] = {}
        for name, account in sorted(decl.accounts.items()):
            try:
                ids[name] = await anyio.to_thread.run_sync(accounts.ensure, name, account)
            except Exception as e:
                raise StepFailed(f"account {name}", str(e)) from None
        obs = await blobs.store(self._nc)
        for key, bundle in sorted(decl.bundles.items()):
            try:
                await bundles.ensure(obs, self._root, key, bundle)
            except Exception as e:
                raise StepFailed(f"bundle {key}", str(e)) from None
        for proc, p in sorted(decl.processes.items()):
            owner = ids[p.account] if p.account else accounts.current()
            folder = self._root / "processes" / proc / "files"
            for rel, f in sorted(p.files.items()):
                try:
                    data = f.text.encode() if f.text is not None else await self._secret(f.secret)
                    files.write(folder, rel, data, mode=int(f.mode, 8), owner=owner)
                except Exception as e:
                    raise StepFailed(f"file {proc}/{rel}", str(e)) from None

    async def _secret(self, name: str | None) -> bytes:
        assert name is not None
        data = await bus.request(
            self._nc,
            subjects.ctl_host(self.name, "secret"),
            wire.encode(SecretRequest(name=name)),
            deadline=time.monotonic() + 10,
        )
        reply = wire.decode_reply(data, SecretReply)
        return base64.b64decode(reply.value)
