"""Setting a secret and rotating the key the secrets are sealed under (`mesh secret set`, `mesh
secret rotate-key`): each a change of its own, one at a time with the catalog's, whose plan gives
the machines whose declarations name the secret (or the key's file) its new version.
"""

import base64
import logging

import asyncpg

from mesh import wire
from mesh.model import (
    ChangeReply,
    PlanSettings,
    RotateKeyReply,
    RotateKeyRequest,
    SecretDeleteReply,
    SecretDeleteRequest,
    SecretSetRequest,
)
from mesh.store import modules, seats, secrets
from services.controller.catalog import scoping, secretkeys
from services.controller.catalog.pushing import settings_of
from services.controller.catalog.secretkeys import Keys
from services.controller.fleet.publishing import Manifests
from services.controller.plans.recording import Recorder, replied
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


class SecretChanges:
    def __init__(
        self, *, pool: asyncpg.Pool, epoch: int, keys: Keys, recorder: Recorder,
        manifests: Manifests,
    ) -> None:  # fmt: skip
        self._pool = pool
        self._epoch = epoch
        self._keys = keys  # the key the secrets are sealed under (secretkeys.py)
        self._rec = recorder
        self._manifests = manifests

    async def secret_delete(self, req: SecretDeleteRequest, audit: Audit) -> SecretDeleteReply:
        """The secret gone from the store: refused while a module's current version names it
        (its machines would find it missing at their next start)."""
        if req.name == secrets.KEY_SECRET:
            raise wire.BadRequest(
                f"name: {req.name} is the key of the secrets, never stored: mesh secret "
                "rotate-key replaces it", code="conflict",
            )  # fmt: skip
        async with self._rec.one_change:  # no push registers a module naming it meanwhile
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                using = (await scoping.in_use(conn, self._manifests)).get(req.name, [])
                if using:
                    raise wire.BadRequest(
                        f"secret {req.name} is named by module(s) {', '.join(using)}: push "
                        "them without it first", code="conflict",
                    )  # fmt: skip
                if not await secrets.forget(conn, req.name):
                    raise wire.BadRequest(f"secret {req.name} is not set", code="not_found")
                await audit.write(conn, detail="deleted")
        log.info("secret %s deleted", req.name)
        return SecretDeleteReply(name=req.name, message=f"secret {req.name} deleted")

    async def secret_set(self, req: SecretSetRequest, audit: Audit) -> ChangeReply:
        try:
            value = base64.b64decode(req.value, validate=True)
        except ValueError:  # binascii.Error, or text that is not ASCII
            raise wire.BadRequest("value: not base64") from None
        if req.name == secrets.KEY_SECRET:
            raise wire.BadRequest(
                f"name: {req.name} is the key of the secrets, never stored: it is the "
                "controllers' key file (mesh secret rotate-key makes a new one)"
            )
        ring = self._keys.usable()
        async with self._rec.one_change:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                was = (await secrets.secret_versions(conn)).get(req.name)
                version = await secrets.set_secret(conn, name=req.name, value=value, ring=ring,
                                                   by=req.by, modules=req.modules)  # fmt: skip
                # Rolled out as the modules that name it roll out (their canary, soak, revert);
                # a revert puts the version before back (secrets.undo).
                plan, changed = await self._rec.plan(
                    conn, await modules.assignments(conn), trigger="secret", subject=req.name,
                    by=req.by, settings=await self._settings(conn, req.name),
                    undo={"secret": req.name, "from": was, "to": version}, audit=audit,
                )  # fmt: skip
        self._rec.wake()
        log.info("secret %s set (version %d): plan %s", req.name, version, plan)
        return replied(
            plan=plan,
            changed=changed,
            message=f"secret {req.name} is at version {version}; "
            + (
                f"plan {plan} changes {len(changed)} machine(s)"
                if changed
                else "no machine's declaration changes"
            ),
        )

    async def _settings(self, conn: asyncpg.Connection, name: str) -> PlanSettings:
        """The rollout of a change of secret `name`: the `[rollout]` of the modules that name
        it, the most careful of each where they differ."""
        using = (await scoping.in_use(conn, self._manifests)).get(name, [])
        current = await modules.current_modules(conn)
        return careful([settings_of(self._manifests.of(current[m])) for m in using])

    async def secret_rotate_key(self, req: RotateKeyRequest, audit: Audit) -> RotateKeyReply:
        """One change at a time, like setting a secret: none is sealed under the old key
        while the rotation moves every secret off it (secretkeys.rotate)."""

        async def plan(key: str) -> tuple[int | None, list[str]]:
            async with self._pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=self._epoch)
                # The entry says what changed: the key (a plan's own line would say "no change"
                # where no machine's declaration names the key's file).
                await audit.write(conn, detail=f"the secrets under key {key}")
                # Its new file for every machine whose declaration names the key.
                return await self._rec.plan(
                    conn, await modules.assignments(conn), trigger="secret",
                    subject=secrets.KEY_SECRET, by=req.by,
                    settings=PlanSettings(auto_revert=False), undo={}, audit=audit,
                )  # fmt: skip

        async with self._rec.one_change:
            reply = await secretkeys.rotate(
                self._pool, self._keys, req, epoch=self._epoch, plan=plan
            )
        self._rec.wake()
        return reply


def careful(each: list[PlanSettings]) -> PlanSettings:
    """One rollout for a change several modules take: the longest deadline and soak, the
    fewest machines at once, a revert if any reverts, down machines skipped only if all skip
    them, every pause, the first canary (by module name), the shortest crash loop."""
    if not each:
        return PlanSettings()
    parallel = [s.max_parallel for s in each if s.max_parallel]
    return PlanSettings(
        deadline=max(s.deadline for s in each), max_parallel=min(parallel, default=0),
        auto_revert=any(s.auto_revert for s in each), skip_down=all(s.skip_down for s in each),
        canary=next((s.canary for s in each if s.canary is not None), None),
        soak=max(s.soak for s in each), crash_loop=min(s.crash_loop for s in each),
        pause_after=sorted({t for s in each for t in s.pause_after}),
    )  # fmt: skip
