"""The JetStream side of the truth's copies: the object store `mesh-bundles` (module sources,
bundles and build logs, content-addressed) and the KV bucket `mesh-declarations`.

The declarations can be rebuilt from PostgreSQL (a new holder republishes them); bundles and
module sources live only here, which is why they are replicated. Nobody but the controller (and
an admin) writes the bundle store: a builder leaves what it built in `mesh-builds`, an operator
the module it pushes in `mesh-uploads` (each bounded in size and age, each writer adding objects
under names of its own), and the controller checks the bytes against their digest and stores
them here (`adopt`).

Objects are read message by message through the stream's `STREAM.MSG.GET` (`get`), never by a
consumer or a direct get: a consumer's deliver subject and a direct get's reply land stored
bytes, raw, on any subject their asker names (docs/security.md, the bus), while a MSG.GET answer
is a JSON envelope no part of the mesh takes for a message of its own (mesh/wire.py).

The controller creates the buckets at takeover, with as many replicas as the NATS cluster
allows up to 3 (NATS's guidance for what must survive the loss of a server): one on a lone
server, 2 on two, 3 on three or more. On a cluster that has grown (2 servers to 3, 3 to 5), the
next takeover raises the replicas of both and JetStream copies the data over. A lone server's
JetStream does not join a cluster: grown from one server, the buckets start empty
(docs/operations.md).
"""

import base64
import hashlib
import io
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
from nats.aio.client import Client
from nats.errors import (
    ConnectionReconnectingError,
    NoRespondersError,
    StaleConnectionError,
)
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions, ObjectStoreConfig
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    NotFoundError,
    ObjectNotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from mesh.errors import MeshError
from mesh.modules import archive

log = logging.getLogger(__name__)
T = TypeVar("T")

BUNDLES = "mesh-bundles"
BUILDS = "mesh-builds"  # what builders built, until the controller has adopted it
BUILDS_MAX_BYTES = 1024 * 2**20  # at most: a builder can fill this, and only this
BUILDS_MAX_AGE = 24 * 3600.0  # seconds: what no controller adopted is dropped after this
UPLOADS = "mesh-uploads"  # modules' archives operators push, until the controller adopts them
UPLOADS_MAX_BYTES = 1024 * 2**20  # at most: an operator can fill this, and only this
UPLOADS_MAX_AGE = 3600.0  # seconds: a push or a dry run adopts its archive long before
DECLARATIONS = "mesh-declarations"
SEAT = "mesh-seat"  # the seat's epoch as the bus knows it (services/controller/seat/epochs.py)
REPLICAS = 3  # at most; fewer where the cluster has fewer servers
# Consumers a stream may have at once. Every host watches its declaration through a consumer of
# its own (services/host/watch.py: two for a minute while it makes it again) and fetches bundles
# through others; nats-server 2.15 caps a stream that sets none at 1000, which a fleet of a
# thousand machines reaches (bench/scale.py found it: hosts could no longer watch their key).
CONSUMERS = 100_000
# JetStream's answers to "too many replicas for this cluster": no suitable peers, insufficient
# resources, replicas > 1 on a lone server. Anything else is raised, not taken for a small cluster.
_TOO_FEW_SERVERS = {10005, 10023, 10074}
_MADE_OTHERWISE = 10058  # "stream name already in use with a different configuration"
MADE_WITHIN = 15.0  # how long a bucket another controller is making may take to be found
CHUNK = 128 * 1024  # an object's chunk, as nats-py cuts them, on a server that takes that much
CHUNK_HEADROOM = 1024  # a chunk's message carries headers and a subject besides its bytes
_NO_BUCKET = "no object store {bucket}: has a controller held the seat yet?"


class BlobMissing(Exception):
    pass


class BlobsUnavailable(MeshError):
    """JetStream did not answer long enough to open the bucket and the store."""


class BlobCorrupt(Exception):
    pass


class BlobTooLarge(BlobCorrupt):
    """Larger than the reader accepts: refused before it is fetched."""


def declaration_subject(machine: str) -> str:
    """The subject a machine's declaration is put on in the declarations' bucket."""
    return f"$KV.{DECLARATIONS}.{machine}"


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def object_name(d: str) -> str:
    return d.replace(":", "-")  # object names become subject tokens inside JetStream


async def ensure(nc: Client, *, within: float = 60.0) -> tuple[KeyValue, ObjectStore]:
    """Open (creating if new) the declarations bucket and the bundle store, each with the most
    replicas the cluster allows up to REPLICAS, raising them on a cluster that has grown.

    JetStream may not answer for a while (a cluster electing its leader after a restart, the
    server we are connected to just lost): asked again until `within` seconds have passed."""
    return await patiently(lambda: _ensure(nc), within=within)


# One request on the seat's bucket: a takeover asks again (patiently) rather than wait out
# nats-py's 5 s while the stream elects a new leader (about 2 s after a nats-server is lost).
SEAT_TRY = 1.0


async def ensure_seat(nc: Client, *, within: float = 60.0) -> KeyValue:
    """The bucket where the seat's holder records its epoch, opened (or created) as `ensure`
    opens the others; each request on it bounded by SEAT_TRY."""
    return await patiently(lambda: _ensure_seat(nc), within=within)


async def _ensure_seat(nc: Client) -> KeyValue:
    js = nc.jetstream(timeout=SEAT_TRY)
    try:
        kv = await js.key_value(SEAT)
    except (BucketNotFoundError, NotFoundError):
        kv = await _most(
            SEAT,
            lambda r: js.create_key_value(bucket=SEAT, history=5, replicas=r),
            lambda: js.key_value(SEAT),
        )
    await _grow(nc, f"KV_{SEAT}")
    return kv


# What a server lost, a cluster electing a leader or a connection moving to another server look
# like to a JetStream request; worth asking again.
_NOT_ANSWERING = (
    NatsTimeout, ServiceUnavailableError, NoRespondersError, ConnectionReconnectingError,
    StaleConnectionError,
)  # fmt: skip


async def patiently(attempt: Callable[[], Awaitable[T]], *, within: float) -> T:
    """`attempt()`, asked again while JetStream does not answer (timeouts, no responders,
    503s), until `within` seconds have passed; then BlobsUnavailable."""
    deadline = time.monotonic() + within
    told = False
    while True:
        try:
            return await attempt()
        except _NOT_ANSWERING as e:
            if time.monotonic() > deadline:
                raise BlobsUnavailable(
                    f"JetStream did not answer for {within:g}s ({type(e).__name__})"
                ) from None
            if not told:
                log.info("JetStream is not answering yet (%s); asking again", type(e).__name__)
                told = True
            await anyio.sleep(0.5)


async def _ensure(nc: Client) -> tuple[KeyValue, ObjectStore]:
    js = nc.jetstream()
    try:
        kv = await js.key_value(DECLARATIONS)
    except (BucketNotFoundError, NotFoundError):
        kv = await _most(
            DECLARATIONS,
            lambda r: js.create_key_value(bucket=DECLARATIONS, history=5, replicas=r),
            lambda: js.key_value(DECLARATIONS),
        )
    try:
        obs = await js.object_store(BUNDLES)
    except (BucketNotFoundError, NotFoundError):
        obs = await _most(
            BUNDLES,
            lambda r: js.create_object_store(BUNDLES, config=ObjectStoreConfig(replicas=r)),
            lambda: js.object_store(BUNDLES),
        )
    for staging, most, age in ((BUILDS, BUILDS_MAX_BYTES, BUILDS_MAX_AGE),
                               (UPLOADS, UPLOADS_MAX_BYTES, UPLOADS_MAX_AGE)):  # fmt: skip
        try:
            await js.object_store(staging)
        except (BucketNotFoundError, NotFoundError):
            await _most(staging, lambda r, b=staging, n=most, a=age: js.create_object_store(
                b, config=ObjectStoreConfig(replicas=r, max_bytes=n, ttl=a)),
                lambda b=staging: js.object_store(b))  # fmt: skip
    for stream in (f"KV_{DECLARATIONS}", f"OBJ_{BUNDLES}"):
        await _grow(nc, stream)
        await _room_for_consumers(nc, stream)
    return kv, obs


async def _most(
    what: str, create: Callable[[int], Awaitable[T]], existing: Callable[[], Awaitable[T]]
) -> T:
    """Create with REPLICAS, then fewer while the cluster has too few servers for them; or open
    the one another controller made meanwhile (two starting at once both found none, and the
    other's is already grown or given room for consumers: `create` would differ from it)."""
    for replicas in range(REPLICAS, 0, -1):
        try:
            made = await create(replicas)
        except APIError as e:
            if e.err_code == _MADE_OTHERWISE:
                log.info("%s was made meanwhile by another; opened it", what)
                return await _made_by_another(existing)
            if replicas == 1 or e.err_code not in _TOO_FEW_SERVERS:
                raise
            log.debug("%s with %d replicas: %s", what, replicas, e.description)
            continue
        log.info("created %s with %d replica(s)", what, replicas)
        return made
    raise AssertionError("unreachable")


async def _made_by_another(existing: Callable[[], Awaitable[T]]) -> T:
    """The bucket another controller is making: in a cluster its name is taken before every
    server can say what it is (found missing for a moment: CI saw a controller stop on it), so
    it is asked for again until MADE_WITHIN."""
    deadline = time.monotonic() + MADE_WITHIN
    while True:
        try:
            return await existing()
        except (BucketNotFoundError, NotFoundError):
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.2)  # polling a condition with a deadline


async def replicas(nc: Client, stream: str) -> int:
    info = await nc.jsm().stream_info(stream)
    return info.config.num_replicas or 1


async def _grow(nc: Client, stream: str) -> None:
    """Raise the stream's replicas toward REPLICAS as far as the cluster allows (a no-op on a
    lone server, or once there)."""
    jsm = nc.jsm()
    info = await jsm.stream_info(stream)
    have = info.config.num_replicas or 1
    if info.cluster is None or not info.cluster.name:
        return  # a lone server: one replica is all it can hold
    for wanted in range(REPLICAS, have, -1):
        try:
            await jsm.update_stream(info.config, num_replicas=wanted)
        except APIError as e:
            if e.err_code not in _TOO_FEW_SERVERS:
                raise
            log.debug("%s to %d replicas: %s", stream, wanted, e.description)
            continue
        log.info("raised %s from %d to %d replicas (the cluster has grown)", stream, have, wanted)
        return


async def _room_for_consumers(nc: Client, stream: str) -> None:
    """Let the stream have CONSUMERS consumers. A stream made with no limit (-1, which nats-py
    asks for) gets the server's default, 1000 on nats-server 2.15; a server from before that
    default has no limit, and one that refuses the change is left as it is, said once."""
    jsm = nc.jsm()
    info = await jsm.stream_info(stream)
    if (info.config.max_consumers or -1) >= CONSUMERS:
        return
    try:
        await jsm.update_stream(info.config, max_consumers=CONSUMERS)
    except APIError as e:
        log.warning("%s: could not allow %d consumers (%s): a fleet of more than the server's "
                    "default may not watch its declarations", stream, CONSUMERS,
                    e.description)  # fmt: skip
        return
    log.info("%s may have %d consumers", stream, CONSUMERS)


async def store(nc: Client) -> ObjectStore:
    """The bundle store, for clients and hosts: it exists once a controller has held the seat."""
    return await _open(nc, BUNDLES)


async def _open(nc: Client, bucket: str) -> ObjectStore:
    try:
        return await nc.jetstream().object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        raise BlobMissing(_NO_BUCKET.format(bucket=bucket)) from None


def _nats_digest(data: bytes) -> str:
    # How JetStream's object store names an object's digest.
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


async def put(obs: ObjectStore, data: bytes) -> str:
    """Store `data` under its digest and return the digest. An object already stored under that
    name is kept only if it really has those bytes: nobody can squat a digest with garbage."""
    d = digest(data)
    try:
        info = await obs.get_info(object_name(d))
        if info.digest == _nats_digest(data) and not info.deleted:
            return d
    except (ObjectNotFoundError, NotFoundError):
        pass
    await _put(obs, object_name(d), data)
    return d


async def _put(obs: ObjectStore, name: str, data: bytes) -> None:
    """Put in chunks the server takes: nats-py cuts 128 KiB ones whatever the server's
    max_payload, and a server that takes less refuses every object larger than it."""
    max_payload = obs._js._nc.max_payload  # the connection the store was opened on
    chunk = max(1024, min(CHUNK, max_payload - CHUNK_HEADROOM))
    options = ObjectMetaOptions(max_chunk_size=chunk)
    await obs.put(name, data, meta=ObjectMeta(name=name, options=options))


async def has(obs: ObjectStore, d: str) -> bool:
    try:
        info = await obs.get_info(object_name(d))
    except (ObjectNotFoundError, NotFoundError):
        return False
    return not info.deleted


class _Stored(msgspec.Struct):
    seq: int
    data: bytes = b""  # base64 in the envelope; msgspec decodes it


class _Refusal(msgspec.Struct):
    code: int
    err_code: int = 0
    description: str = ""


class _Got(msgspec.Struct):
    """STREAM.MSG.GET's answer: the message, or why not."""

    message: _Stored | None = None
    error: _Refusal | None = None


_NO_MESSAGE = 10037  # JetStream's "no message found"
_STREAM_GONE = 10059  # "stream not found"
GET_WITHIN = 10.0  # seconds for one message of a stream to come back


async def _message(nc: Client, bucket: str, query: dict[str, object]) -> _Stored | None:
    """One message of the bucket's stream (None: there is none such)."""
    stream = f"OBJ_{bucket}"
    answer = await nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps(query).encode(),
                              timeout=GET_WITHIN)  # fmt: skip
    try:
        got = msgspec.json.decode(answer.data, type=_Got)
    except msgspec.DecodeError as e:
        raise BlobCorrupt(f"{stream}: JetStream answered what is not a message: {e}") from None
    if got.error is not None:
        if got.error.err_code == _NO_MESSAGE:
            return None
        if got.error.err_code == _STREAM_GONE:
            raise BlobMissing(_NO_BUCKET.format(bucket=bucket))
        if got.error.code == 503:  # no leader yet, a server lost: worth asking again
            raise ServiceUnavailableError(
                code=503, err_code=got.error.err_code, description=got.error.description
            )
        raise BlobCorrupt(f"{stream}: {got.error.description} ({got.error.err_code})")
    return got.message


async def info(nc: Client, name: str, *, bucket: str = BUNDLES) -> ObjectInfo | None:
    """What the bucket says of the object `name` (None: absent or deleted)."""
    meta = f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"
    stored = await _message(nc, bucket, {"last_by_subj": meta})
    if stored is None:
        return None
    try:
        found = ObjectInfo.from_response(json.loads(stored.data))
    except Exception as e:
        raise BlobCorrupt(f"{name}: its description in {bucket} is damaged ({e})") from None
    return None if found.deleted else found


async def _read(nc: Client, name: str, *, bucket: str, limit: int, what: str = "") -> bytes:
    """The object's bytes, checked against the digest its description gives. `what` names it
    in errors (a digest, rather than the object's name)."""
    what = what or name
    found = await info(nc, name, bucket=bucket)
    if found is None:
        raise BlobMissing(f"{what} is not in {bucket}")
    if found.is_link():
        raise BlobCorrupt(f"{what}: the stored object is a link, not a blob")
    if (found.size or 0) > limit:
        raise BlobTooLarge(f"{what} is {found.size} bytes, at most {limit}")
    chunks = f"$O.{bucket}.C.{found.nuid}"
    buffer = io.BytesIO()
    after = 0
    for _ in range(found.chunks or 0):
        stored = await _message(nc, bucket, {"seq": after + 1, "next_by_subj": chunks})
        if stored is None:
            raise BlobCorrupt(f"{what}: a chunk is missing from {bucket}")
        buffer.write(stored.data)
        if buffer.tell() > limit:
            raise BlobTooLarge(f"{what} is more than {limit} bytes")
        after = stored.seq
    data = buffer.getvalue()
    if len(data) != (found.size or 0) or _nats_digest(data) != found.digest:
        raise BlobCorrupt(f"{what}: the stored object is damaged (size or digest)")
    return data


async def get(
    nc: Client, d: str, *, bucket: str = BUNDLES, limit: int = archive.MAX_ARCHIVE
) -> bytes:
    """Fetch by digest and verify it: a corrupt or substituted blob is refused, and so is one
    larger than `limit` (every blob is an archive), before it is read into memory."""
    data = await _read(nc, object_name(d), bucket=bucket, limit=limit, what=d)
    if digest(data) != d:
        raise BlobCorrupt(f"{d}: the stored bytes have digest {digest(data)}")
    return data


async def staged(nc: Client, bucket: str = BUILDS) -> ObjectStore:
    """Where a builder leaves what it built, or an operator what it pushes (UPLOADS): each may
    write there and nowhere else."""
    return await _open(nc, bucket)


async def stage(builds: ObjectStore, what: str, data: bytes) -> str:
    """Leave `data` in a staging bucket for the controller to adopt, under a name of its own
    (`what` and a random part: a writer may add there, never replace, since replacing purges);
    the name."""
    name = f"{what}.{secrets.token_hex(8)}"
    await _put(builds, name, data)
    return name


async def staged_bytes(nc: Client, name: str, *, d: str, bucket: str) -> bytes:
    """What is staged as `name`, checked against the digest `d` it was staged for."""
    data = await _read(nc, name, bucket=bucket, limit=archive.MAX_ARCHIVE, what=d)
    if digest(data) != d:
        raise BlobCorrupt(f"{d}: the stored bytes have digest {digest(data)}")
    return data


async def unstage(nc: Client, name: str, *, bucket: str) -> None:
    """Delete what was staged as `name` (adopted, or read by a dry run)."""
    try:
        await (await staged(nc, bucket)).delete(name)
    except Exception as e:  # what is left there is dropped at its age (the bucket's ttl)
        log.info("could not delete %s from %s: %s", name, bucket, e)


async def adopt(
    nc: Client, obs: ObjectStore, name: str, *, d: str | None = None, keep_as: str = ""
) -> bytes:
    """Controller: take `name` out of the builds' bucket into the bundle store and return its
    bytes: checked against digest `d` and stored under it, or else stored as `keep_as`."""
    if d is not None:
        data = await staged_bytes(nc, name, d=d, bucket=BUILDS)
        await put(obs, data)
    else:
        data = await get_named(nc, name, bucket=BUILDS)
        await put_named(obs, keep_as or name, data)
    await unstage(nc, name, bucket=BUILDS)
    return data


async def put_named(obs: ObjectStore, name: str, data: bytes) -> None:
    """A named object (a build log), replaced on every put."""
    await _put(obs, name, data)


async def get_named(nc: Client, name: str, *, bucket: str = BUNDLES) -> bytes:
    """A named object (a build log), checked against its description's digest."""
    return await _read(nc, name, bucket=bucket, limit=archive.MAX_ARCHIVE)


async def delete(obs: ObjectStore, d: str) -> bool:
    """Delete the object stored under digest `d` (its chunks purged); False if there was none."""
    try:
        await obs.delete(object_name(d))
    except (ObjectNotFoundError, NotFoundError):
        return False
    return True
