"""The buckets a controller opens or makes (mesh/blobs.py), on a real nats-server.

Two controllers starting at once (`mesh dev up` starts two) both find a bucket missing and both
make it; the second's create then differs from the first's bucket, already given room for its
consumers, and JetStream refuses it (10058, "stream name already in use with a different
configuration"). A controller of a cluster grown from two servers to three died of that in CI.
"""

import anyio
import nats

from mesh import blobs


async def test_a_bucket_made_meanwhile_by_another_controller_is_opened(nc) -> None:
    js = nc.jetstream()
    # The other controller: made the declarations bucket and gave it room for consumers.
    await js.create_key_value(bucket=blobs.DECLARATIONS, history=5)
    await blobs._room_for_consumers(nc, f"KV_{blobs.DECLARATIONS}")
    await (await js.key_value(blobs.DECLARATIONS)).put("node-1", b"theirs")

    # This one had found no bucket, and makes it now.
    kv = await blobs._most(
        blobs.DECLARATIONS,
        lambda r: js.create_key_value(bucket=blobs.DECLARATIONS, history=5, replicas=r),
        lambda: js.key_value(blobs.DECLARATIONS),
    )
    assert (await kv.get("node-1")).value == b"theirs"


async def test_both_controllers_ensure_the_buckets_at_once(nc, nats_url) -> None:
    other = await nats.connect(nats_url)
    try:
        async with anyio.create_task_group() as tg:
            for client in (nc, other):
                tg.start_soon(blobs.ensure, client)
    finally:
        await other.close()
    info = await nc.jsm().stream_info(f"KV_{blobs.DECLARATIONS}")
    assert info.config.max_consumers == blobs.CONSUMERS
