"""The bundles the holder keeps: those of each module's newest versions (`--versions-kept`, 10)
and of its current one, so that a rollback to any of them needs no push and no build. Older
versions' bundles and source archives are deleted from the bundle store (`mesh-bundles`), every
`--versions-prune-every`, except what is still named: by a machine's stored declaration (a
drained machine keeps an old version running), by a plan not yet ended (a step's declaration,
before or after, or a bundle a push has stored for its build), or by a version that is kept (a
bundle two versions share stays with the newer one). The versions themselves stay in the store:
`mesh history` shows every one, and a version whose bundles are gone is rolled back to by
pushing its folder again (which stores them again).

Only the holder prunes, under the same lock as every change (a rollback never sees a bundle
vanish between its check and its plan), in runs of at most PRUNE_MOST versions, each decided in
a transaction fenced by its epoch; a backlog goes a run a second. A push stores its bundles
before it takes that lock: one that meets a bundle pruned meanwhile (its version shares it with
an old one and no other) has its plan fail before any machine is touched, naming the bundle,
and the same push again stores it again.
"""

import logging

import anyio
import asyncpg
from nats.errors import Error as NatsError
from nats.js.object_store import ObjectStore

from mesh import blobs
from mesh.config import VersionsKept
from mesh.errors import reason
from mesh.store import db, events, modules, plans, seats
from services.controller import metrics

log = logging.getLogger(__name__)

PRUNE_MOST = 100  # versions a run looks at: a few JetStream requests each
PRUNE_AGAIN = 1.0  # seconds between runs while a backlog lasts
PRUNE_WITHIN = 120.0  # a run not done by then is given up, and tried next time
NAMED = 5  # versions a log line names; the rest are counted
# How long a plan waits for the bundle store to say whether it has its bundles (a nats-server
# lost, JetStream electing): past it the plan starts, the hosts fetching with their own retries.
BUNDLE_CHECK_WITHIN = 15.0


async def missing(pool: asyncpg.Pool, obs: ObjectStore, module: str, *, plan: int) -> str | None:
    """Why a plan of `module` cannot start, if a bundle of its current version is not in the
    bundle store (lost with JetStream's data, or purged): then every machine would fail to
    fetch it. A push of the module's folder stores it again (changes.Changes.push)."""
    async with pool.acquire() as conn:
        current = (await modules.current_modules(conn)).get(module)
    if current is None:
        return None
    for name, digest in sorted(current.bundles.items()):
        if not digest.startswith("sha256:"):
            continue
        try:  # JetStream electing a leader (a nats-server lost) answers late, or 503
            there = await blobs.patiently(lambda d=digest: blobs.has(obs, d),
                                          within=BUNDLE_CHECK_WITHIN)  # fmt: skip
        except blobs.BlobsUnavailable as e:
            log.warning("plan %d: could not look for bundle %s in the bundle store (%s); "
                        "starting it all the same", plan, name, e)  # fmt: skip
            return None
        if not there:
            return (
                f"bundle {name} of module {module} ({digest[:19]}…) is not in the "
                f"bundle store: push the module's folder again (mesh push DIR) to store "
                "it, then ask again"
            )
    return None


async def keep_pruned(
    pool: asyncpg.Pool, obs: ObjectStore, *, epoch: int, kept: VersionsKept, lock: anyio.Lock
) -> None:
    """Until cancelled (the hold ends): a run every `kept.every` seconds, the first one after
    that long too (a takeover has more urgent work)."""
    if kept.count is None:
        return
    wait = kept.every
    after = 0  # a backlog's versions looked at so far (by id)
    while True:
        await anyio.sleep(wait)
        more = None
        try:
            with anyio.fail_after(PRUNE_WITHIN):
                more = await prune(pool, obs, epoch=epoch, keep=kept.count, lock=lock, after=after)
        except (*db.GONE, asyncpg.PostgresError, NatsError, TimeoutError) as e:
            # A fenced run (seats.Fenced) is not caught: the seat moved on, and this hold ends.
            log.warning("could not prune bundles (next try in %gs): %s", kept.every, reason(e))
        after = more or 0
        wait = PRUNE_AGAIN if more else kept.every


async def prune(
    pool: asyncpg.Pool,
    obs: ObjectStore,
    *,
    epoch: int,
    keep: int,
    lock: anyio.Lock,
    after: int = 0,
) -> int | None:
    """One run over the versions from just after the id `after`: delete the bundles and sources
    of versions past the newest `keep` of their module that nothing names any more. The last
    version looked at when there may be more (the next run goes on after it), else None."""
    async with lock:
        async with pool.acquire() as conn, conn.transaction():
            await seats.fence(conn, epoch=epoch)
            old, kept = await modules.old_versions(conn, keep=keep, most=PRUNE_MOST, after=after)
            candidates = sorted({d for v in old for d in v.digests} - kept)
            held = (
                await modules.still_named(conn, candidates, ended=list(plans.ENDED))
                if candidates
                else set()
            )
        if not old:
            return None
        deleted = [d for d in candidates if d not in held and await blobs.delete(obs, d)]
        metrics.BUNDLES_PRUNED.inc(len(deleted))
        # A version with a bundle still named is looked at again by later runs: once nothing
        # names it (the drained machine brought up to date, the plan ended), it goes too.
        done = [v for v in old if not v.digests & held]
        if done or deleted:
            async with pool.acquire() as conn, conn.transaction():
                await seats.fence(conn, epoch=epoch)
                await modules.mark_pruned(conn, [v.id for v in done])
                await events.record(
                    conn, "bundles.pruned", epoch=epoch, kept=keep, deleted=len(deleted),
                    versions=[f"{v.module} {v.number}" for v in done], held=len(held),
                )  # fmt: skip
    if done or deleted:
        names = ", ".join(f"{v.module} {v.number}" for v in done[:NAMED])
        more = f" and {len(done) - NAMED} more" if len(done) > NAMED else ""
        log.info("pruned %d bundle(s) and source(s) of version(s) %s%s past the newest %d of "
                 "their module; %d still named by a machine or a plan", len(deleted),
                 names or "-", more, keep, len(held))  # fmt: skip
    return old[-1].id if len(old) == PRUNE_MOST else None
