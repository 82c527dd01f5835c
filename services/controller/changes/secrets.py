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
    SecretSetRequest,
)
from mesh.store import modules, seats, secrets
from services.controller.catalog import secretkeys
from services.controller.catalog.secretkeys import Keys
from services.controller.plans.recording import Recorder, replied
from services.controller.trust.audit import Audit

log = logging.getLogger(__name__)


class SecretChanges:
    def __init__(self, *, pool: asyncpg.Pool, epoch: int, keys: Keys, recorder: Recorder) -> None:
        self._pool = pool
        self._epoch = epoch
        self._keys = keys  # the key the secrets are sealed under (secretkeys.py)
        self._rec = recorder

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
                version = await secrets.set_secret(conn, name=req.name, value=value, ring=ring,
                                                   by=req.by, modules=req.modules)  # fmt: skip
                # A secret's old value is not kept, so there is nothing to revert to.
                plan, changed = await self._rec.plan(
                    conn, await modules.assignments(conn), trigger="secret", subject=req.name,
                    by=req.by, settings=PlanSettings(auto_revert=False), undo={}, audit=audit,
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
