"""The controller's key of the secrets (mesh/auth/secretkeys.py): read at start and checked
against the store, every secret brought under it at a takeover, rotated by `mesh secret
rotate-key`.

- At start (`opened`): a key file that is missing, unreadable, open to others, or without a key
  the store's secrets need stops the controller with one line: it never serves secrets it
  cannot read.
- At a takeover (`take_over`): the file is read again (a rotation may have changed it while this
  controller stood by). Secrets an older mesh stored in plaintext are sealed, and secrets under
  an older key of the file re-wrapped under its first, each in a fenced transaction of its own,
  said in one line. A file that now lacks a key the store needs (an old copy: the key was
  rotated since) is said in one line too, and the holder serves everything but secrets, which it
  answers `unavailable` with that line.
- A rotation (`rotate`, the `secret-rotate-key` verb): the new key first in this controller's
  file (the old one kept), every data key re-wrapped under it, the store told (the generation of
  `mesh-secrets-key` raised, and a plan gives the controllers' module its new file), then the
  old key dropped from the file. Until the last data key is re-wrapped the holder has both keys,
  so a host asking for a secret meanwhile gets it.
"""

import base64
import binascii
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg

from mesh import wire
from mesh.auth import secretkeys
from mesh.auth.secretkeys import KeyRing, SecretsKeyError
from mesh.model import CHANGED_LISTED, RotateKeyReply, RotateKeyRequest
from mesh.store import seats, secrets

log = logging.getLogger("mesh.controller")


class Keys:
    """The key file this controller was given and the keys it holds now."""

    def __init__(self, path: Path, ring: KeyRing) -> None:
        self.path = path
        self.ring = ring
        self.unreadable: str | None = None  # why the holder cannot serve secrets, if it cannot

    def usable(self) -> KeyRing:
        if self.unreadable is not None:
            raise wire.BadRequest(self.unreadable, code="unavailable")
        return self.ring


async def lacking(conn: asyncpg.Connection, ring: KeyRing, *, path: Path) -> str | None:
    """What the store's secrets need that `ring` lacks, in one line; None if nothing."""
    known = await secrets.store_key(conn)
    needed = {k for k in await secrets.key_ids(conn) if k is not None}
    if known is not None:
        needed.add(known.key_id)
    missing = sorted(needed - set(ring.ids()))
    if not missing:
        return None
    since = (
        f" (the mesh's key since {known.changed_at:%Y-%m-%d %H:%M:%S} UTC)"
        if known is not None and known.key_id in missing
        else ""
    )
    return (
        f"secrets key file {path} holds {', '.join(ring.ids())}, but the store's secrets are "
        f"wrapped under {', '.join(missing)}{since}: the file is an old copy (the key was "
        "rotated since), another mesh's, or a new one made in place of a lost one; give this "
        "controller the mesh's current key file (restore it from your backup)"
    )


async def opened(conn: asyncpg.Connection, path: Path) -> Keys:
    """The key file, checked against the store: SecretsKeyError (one line) if it cannot serve."""
    ring = secretkeys.read(path)
    why = await lacking(conn, ring, path=path)
    if why is not None:
        raise SecretsKeyError(why)
    return Keys(path, ring)


async def take_over(pool: asyncpg.Pool, keys: Keys, *, epoch: int) -> None:
    """At a takeover: the file read again, every secret brought under its first key."""
    try:
        ring = secretkeys.read(keys.path)
        async with pool.acquire() as conn:
            why = await lacking(conn, ring, path=keys.path)
    except SecretsKeyError as e:
        why = str(e)
    if why is not None:
        keys.unreadable = f"this controller cannot read the secrets: {why}"
        log.warning("secrets are not served: %s", why)
        return
    keys.ring, keys.unreadable = ring, None
    await _bring_under(pool, ring, epoch=epoch)


async def _bring_under(pool: asyncpg.Pool, ring: KeyRing, *, epoch: int) -> Counter[str]:
    """Every secret sealed under the ring's first key, one fenced transaction each, and the
    store told which key that is; said in one line if anything changed."""
    async with pool.acquire() as conn:
        names = await secrets.not_under(conn, ring.active)
    done: Counter[str] = Counter()
    for name in names:
        async with pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=epoch)
            if name == secrets.KEY_SECRET:
                # Set as a secret by an older mesh (to give the controllers' module its key):
                # the key in plaintext in the store. It is the controllers' file now.
                if await secrets.forget(conn, name):
                    done["removed"] += 1
                continue
            what = await secrets.reseal(conn, name, ring=ring)
            if what is not None:
                done[what] += 1
    async with pool.acquire() as conn, conn.transaction():
        await seats.fence(conn, epoch=epoch)
        before = await secrets.store_key(conn)
        await secrets.set_store_key(conn, ring.active)
    if done:
        said = [f"{done['sealed']} stored in plaintext (by an older mesh) sealed"] * bool(
            done["sealed"]
        )
        said += [f"{done['rewrapped']} re-wrapped from an older key"] * bool(done["rewrapped"])
        said += [f"the row {secrets.KEY_SECRET} (the key itself) removed"] * bool(done["removed"])
        log.info("secrets: %s, under key %s", "; ".join(said), ring.active)
    elif before is not None and before.key_id != ring.active:
        log.info("secrets: the mesh's key is now %s (was %s)", ring.active, before.key_id)
    return done


def _save(path: Path, ring: KeyRing) -> None:
    try:
        secretkeys.write(path, ring)
    except SecretsKeyError as e:
        raise wire.BadRequest(f"this controller's key: {e}", code="unavailable") from None


Planned = Callable[[str], Awaitable[tuple[int | None, list[str]]]]  # given the new key's id


async def rotate(
    pool: asyncpg.Pool, keys: Keys, req: RotateKeyRequest, *, epoch: int, plan: Planned
) -> RotateKeyReply:
    """`req.key` the mesh's key from now on (see the module's docstring). Run one change at a
    time: no secret is set meanwhile, so none is left under the old key when it goes. `plan`
    records the plan that gives the controllers' module the new key file."""
    try:
        new = base64.b64decode(req.key, validate=True)
    except (binascii.Error, ValueError):
        raise wire.BadRequest("key: not base64") from None
    if len(new) != secretkeys.KEY_BYTES:
        raise wire.BadRequest(f"key: {len(new)} bytes, not {secretkeys.KEY_BYTES}")
    held = keys.ring.ids()
    if req.replaces not in held and secretkeys.key_id(new) not in held:
        raise wire.BadRequest(
            f"replaces: {req.replaces} is not a key of this controller's ({', '.join(held)}): "
            "the key file rotated is not this mesh's",
            code="conflict",
        )
    ring = keys.ring.first(new)
    async with pool.acquire() as conn:
        why = await lacking(conn, ring, path=keys.path)
    if why is not None:
        raise wire.BadRequest(why, code="unavailable")
    _save(keys.path, ring)
    keys.ring, keys.unreadable = ring, None
    done = await _bring_under(pool, ring, epoch=epoch)
    planned, changed = await plan(ring.active)
    async with pool.acquire() as conn:
        left = await secrets.not_under(conn, ring.active)
    if left:  # cannot happen one change at a time; never drop a key a secret still needs
        raise wire.BadRequest(f"secrets {', '.join(left)} are still under an older key; "
                              "rotate again", code="internal")  # fmt: skip
    previous = ring.ids()[1:]
    keys.ring = ring.only_active()
    _save(keys.path, keys.ring)
    log.info("secrets key rotated to %s (dropped %s): %d data key(s) re-wrapped; plan %s",
             ring.active, ", ".join(previous) or "nothing", done["rewrapped"], planned)  # fmt: skip
    return RotateKeyReply(
        key=ring.active, previous=previous, sealed=done["sealed"], rewrapped=done["rewrapped"],
        plan=planned, machines=changed[:CHANGED_LISTED], changed=len(changed),
        message=f"the secrets are under key {ring.active}"
        + (f"; {', '.join(previous)} dropped" if previous else "")
        + (f"; plan {planned} gives the controllers the new key file" if planned else ""),
    )  # fmt: skip
