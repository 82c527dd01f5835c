"""The JetStream side of the truth's copies: the object store `mesh-bundles` (module sources,
bundles and build logs, content-addressed) and the KV bucket `mesh-declarations`.

Everything here can be rebuilt from PostgreSQL; the controller creates both at takeover.
"""

import base64
import hashlib

from nats.aio.client import Client
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    DigestMismatchError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from mesh.modules import archive

BUNDLES = "mesh-bundles"
DECLARATIONS = "mesh-declarations"


class BlobMissing(Exception):
    pass


class BlobCorrupt(Exception):
    pass


class BlobTooLarge(BlobCorrupt):
    """Larger than the reader accepts: refused before it is fetched."""


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _object_name(d: str) -> str:
    return d.replace(":", "-")  # object names become subject tokens inside JetStream


async def ensure(nc: Client) -> tuple[KeyValue, ObjectStore]:
    """Open (creating if new) the declarations bucket and the bundle store."""
    js = nc.jetstream()
    try:
        kv = await js.key_value(DECLARATIONS)
    except (BucketNotFoundError, NotFoundError):
        kv = await js.create_key_value(bucket=DECLARATIONS, history=5)
    try:
        obs = await js.object_store(BUNDLES)
    except (BucketNotFoundError, NotFoundError):
        obs = await js.create_object_store(BUNDLES)
    return kv, obs


async def store(nc: Client) -> ObjectStore:
    """The bundle store, for clients and hosts: it exists once a controller has held the seat."""
    try:
        return await nc.jetstream().object_store(BUNDLES)
    except (BucketNotFoundError, NotFoundError):
        raise BlobMissing(
            f"no object store {BUNDLES}: has a controller held the seat yet?"
        ) from None


def _nats_digest(data: bytes) -> str:
    # How JetStream's object store names an object's digest.
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


async def put(obs: ObjectStore, data: bytes) -> str:
    """Store `data` under its digest and return the digest. An object already stored under that
    name is kept only if it really has those bytes: nobody can squat a digest with garbage."""
    d = digest(data)
    try:
        info = await obs.get_info(_object_name(d))
        if info.digest == _nats_digest(data) and not info.deleted:
            return d
    except (ObjectNotFoundError, NotFoundError):
        pass
    await obs.put(_object_name(d), data)
    return d


async def has(obs: ObjectStore, d: str) -> bool:
    try:
        info = await obs.get_info(_object_name(d))
    except (ObjectNotFoundError, NotFoundError):
        return False
    return not info.deleted


async def get(obs: ObjectStore, d: str, *, limit: int = archive.MAX_ARCHIVE) -> bytes:
    """Fetch by digest and verify it: a corrupt or substituted blob is refused, and so is one
    larger than `limit` (every blob is an archive), before it is read into memory."""
    try:
        info = await obs.get_info(_object_name(d))
        if info.is_link():  # get() would follow it into another bucket
            raise BlobCorrupt(f"{d}: the stored object is a link, not a blob")
        if (info.size or 0) > limit:
            raise BlobTooLarge(f"{d} is {info.size} bytes, at most {limit}")
        result = await obs.get(_object_name(d))
    except (ObjectNotFoundError, NotFoundError):
        raise BlobMissing(f"{d} is not in {BUNDLES}") from None
    except (DigestMismatchError, BadObjectMetaError) as e:
        raise BlobCorrupt(f"{d}: the stored object is damaged ({type(e).__name__})") from None
    data = result.data or b""
    if digest(data) != d:
        raise BlobCorrupt(f"{d}: the stored bytes have digest {digest(data)}")
    return data


async def put_named(obs: ObjectStore, name: str, data: bytes) -> None:
    """A named object (a build log), replaced on every put."""
    await obs.put(name, data)


async def get_named(obs: ObjectStore, name: str) -> bytes:
    try:
        return (await obs.get(name)).data or b""
    except (ObjectNotFoundError, NotFoundError):
        raise BlobMissing(f"{name} is not in {BUNDLES}") from None
