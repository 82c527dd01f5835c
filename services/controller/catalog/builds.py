"""The controller's side of builds: it asks a host labelled builder=true to build a bundle with
`build` (never building in the controller) and records the build in the store.

Keyed by the digest of the bundle's source folder, its argv and its output: the same inputs
reuse the cached bundle. A failed build fails the change with the build's last lines.

The request is signed by the controllers (mesh.auth.signing): a builder runs nothing else. The
builder leaves the bundle and its log in `mesh-builds`, the one place it may write; the
controller checks the bundle against its digest and stores both in the bundle store.
"""

import hashlib
import json
import logging

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.object_store import ObjectStore

from mesh import blobs, subjects, wire
from mesh.auth.signing import Signing
from mesh.model import BuildReply, BuildRequest
from mesh.modules import gate
from mesh.modules.manifest import Bundle
from mesh.store import builds
from services.controller import metrics
from services.controller.fleet.fleet import Fleet

log = logging.getLogger(__name__)


MESH_RECIPE = ["mesh", 1]  # how a builder makes a mesh bundle (services/host/meshbuild.py)


def build_key(*, tree: str, bundle: Bundle) -> str:
    """The digest of what a build sees (its source folder's archive) and what it runs."""
    what = MESH_RECIPE if bundle.kind == "mesh" else [bundle.build, bundle.output]
    assert what[0] is not None
    recipe = json.dumps([tree, *what], separators=(",", ":"))
    return "sha256:" + hashlib.sha256(recipe.encode()).hexdigest()


def builder(fleet: Fleet) -> str:
    candidates = sorted(
        m.name for m in fleet.machines.values() if m.up and m.labels.get("builder") == "true"
    )
    if not candidates:
        raise wire.BadRequest(
            "no machine is up with the label builder=true to build on", code="no_builder"
        )
    return candidates[0]


async def cached(pool: asyncpg.Pool, obs: ObjectStore, key: str) -> str | None:
    """The bundle a finished build with this key made, if it is still stored."""
    row = await builds.build(pool, key)
    if row is None or row.state != "done" or row.digest is None:
        return None
    return row.digest if await blobs.has(obs, row.digest) else None


async def build(
    *,
    nc: Client,
    signing: Signing,
    pool: asyncpg.Pool,
    obs: ObjectStore,
    fleet: Fleet,
    key: str,
    module: str,
    name: str,
    bundle: Bundle,
    source: str,
) -> str:
    """Build on a builder host and return the bundle's digest; raise BadRequest on failure."""
    mesh = bundle.kind == "mesh"  # the builder's own recipe, no argv (meshbuild.py)
    assert mesh or (bundle.build is not None and bundle.output is not None)
    on = builder(fleet)
    timeout = gate.duration(bundle.timeout)
    await builds.start_build(pool, key=key, module=module, bundle=name, source=source, builder=on)
    log.info("building %s/%s on %s (key %s)", module, name, on, key[:19])
    req = BuildRequest(
        key=key,
        module=module,
        bundle=name,
        source=source,
        path=".",  # the source is the bundle's folder already
        argv=[] if mesh else (bundle.build or []),
        output="." if mesh else (bundle.output or "."),
        timeout=timeout,
        kind="mesh" if mesh else "command",
    )
    subject, body = subjects.host(on, "build"), wire.encode(req)
    try:
        msg = await nc.request(
            subject, body, timeout=timeout + 30, headers=signing.headers(subject, body)
        )
        reply = wire.decode_json(msg.data, BuildReply)
    except (NoRespondersError, NatsTimeout, msgspec.DecodeError) as e:
        metrics.BUILDS.labels("no_answer").inc()
        await builds.finish_build(pool, key=key, ok=False, digest=None, tail="", log_object=None)
        raise wire.BadRequest(
            f"the build of {module}/{name} on {on} got no answer ({type(e).__name__})",
            code="build_failed",
        ) from None
    reply = msgspec.structs.replace(reply, tail=builds.clip_tail(reply.tail))
    try:
        if reply.staged:
            reply = await _adopt(nc, obs, reply, log_as="build-log-" + key.replace(":", "-"))
        stored = reply.digest is not None and await blobs.has(obs, reply.digest)
    except (NatsError, TimeoutError) as e:  # the bundle store slow (a loaded server) or gone
        metrics.BUILDS.labels("no_answer").inc()
        await builds.finish_build(pool, key=key, ok=False, digest=None, tail="", log_object=None)
        raise wire.BadRequest(
            f"the build of {module}/{name} on {on} could not be stored in the bundle store "
            f"({type(e).__name__}); try again", code="unavailable",
        ) from None  # fmt: skip
    if reply.ok and not stored:
        reply = msgspec.structs.replace(reply, ok=False, error="the builder stored no bundle")
    await builds.finish_build(
        pool, key=key, ok=reply.ok, digest=reply.digest, tail=reply.tail, log_object=reply.log
    )
    metrics.BUILDS.labels("built" if reply.ok and reply.digest else "failed").inc()
    if not reply.ok or reply.digest is None:
        log.info("build of %s/%s on %s failed: %s", module, name, on, reply.error)
        raise wire.BadRequest(
            f"the build of {module}/{name} on {on} failed: {reply.error}; "
            f"last lines:\n{reply.tail}",
            code="build_failed",
        )
    log.info("built %s/%s on %s: %s", module, name, on, reply.digest[:19])
    return reply.digest


async def _adopt(nc: Client, obs: ObjectStore, reply: BuildReply, *, log_as: str) -> BuildReply:
    """Take what the builder left in `mesh-builds` into the bundle store: the log as `log_as`
    (best effort: a build is not failed for its log) and the bundle, checked against its
    digest. The reply then names the log as it is kept."""
    log_object = ""
    if reply.log:
        try:
            await blobs.adopt(nc, obs, reply.log, keep_as=log_as)
            log_object = log_as
        except Exception as e:
            log.warning("the log %s of a build could not be kept: %s", reply.log, e)
    reply = msgspec.structs.replace(reply, log=log_object)
    if reply.ok and reply.digest is not None:
        try:
            await blobs.adopt(nc, obs, reply.staged_as, d=reply.digest)
        except (blobs.BlobMissing, blobs.BlobCorrupt) as e:
            return msgspec.structs.replace(
                reply, ok=False, error=f"what the builder left is not its bundle: {e}"
            )
    return reply
