"""Watching this machine's own key in `mesh-declarations`, in a way the server can restrict.

nats-py's KV watcher creates its consumer without a name, so the filter (the key) travels only
in the request's body, where permissions cannot see it. This one names its consumer, so the
create request goes to `$JS.API.CONSUMER.CREATE.<stream>.<consumer>.<filter>`: the server
checks that filter against the body, and a host's permissions allow that subject for its own
key only (mesh.auth.policy). A host therefore cannot read another machine's declaration.

The consumer delivers the key's newest value, then every new one. It is made again (newest
value first) when its heartbeats stop, as after a server restart that forgot it, or when a
message was missed; a value already yielded (same stream sequence) is not yielded again, so a
long apply is never interrupted by the value it is applying.

On a cluster the consumer stays one replica in memory, deliberately: it holds nothing that
matters (the bucket is replicated; the consumer only points at its newest value). When the
server holding it is lost, its heartbeats stop and it is made again on a server that is left,
newest value first, so nothing is missed; a replicated consumer would cost every host a RAFT
group for the same outcome.
"""

import logging
import secrets
from collections.abc import AsyncIterator

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header

from mesh import origin
from mesh.blobs import DECLARATIONS, declaration_subject
from mesh.errors import reason

log = logging.getLogger(__name__)

HEARTBEAT = 2.0  # the server's idle heartbeat on the consumer
MISSED = 3  # heartbeats missed before the consumer is taken for gone
RETRY = 1.0  # between attempts to create it (no bucket yet, no connection)


def _heartbeat(msg: Msg) -> bool:
    return bool(msg.headers) and msg.headers.get(Header.STATUS) == "100" and not msg.data


def consumer(key: str, *, deliver: str) -> ConsumerConfig:
    """The consumer of `key`'s values, delivered to `deliver`: named (so the server can check
    its filter against the host's permissions), the newest value first, in memory."""
    return ConsumerConfig(
        name=f"{key}-{secrets.token_hex(6)}",
        filter_subject=declaration_subject(key),
        deliver_subject=deliver,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ack_policy=AckPolicy.NONE,
        idle_heartbeat=HEARTBEAT,
        inactive_threshold=60.0,
        mem_storage=True,
        num_replicas=1,
    )


async def values(nc: Client, key: str) -> AsyncIterator[bytes]:
    """Every value of `key` (deleted or purged ones skipped), the current one first."""
    stream = f"KV_{DECLARATIONS}"
    subject = declaration_subject(key)
    waiting = False
    last = 0  # the stream sequence of the last value yielded
    while True:
        deliver = nc.new_inbox()
        sub = await nc.subscribe(deliver)
        try:
            try:
                await nc.jsm().add_consumer(stream, config=consumer(key, deliver=deliver))
            except (NatsError, OSError) as e:  # no bucket yet (no seat held yet), no connection
                if not waiting:
                    log.info("cannot watch %s yet (%s); retrying", subject, reason(e))
                    waiting = True
                await anyio.sleep(RETRY)
                continue
            waiting = False
            seen = 0  # the consumer's sequence of the last value delivered
            while True:
                try:
                    msg = await sub.next_msg(timeout=HEARTBEAT * MISSED)
                except NatsTimeout:
                    log.info("no heartbeat on the watch of %s: watching again", subject)
                    break
                if _heartbeat(msg):
                    told = msg.headers.get("Nats-Last-Consumer") if msg.headers else None
                    if told is not None and int(told) != seen:
                        log.info("missed a value of %s: watching again", subject)
                        break
                    continue
                if msg.subject != subject:  # a value of our key, or nothing (mesh/origin.py)
                    origin.STRAYS.refused(deliver, msg, "not a value of this machine's key")
                    continue
                sequence = msg.metadata.sequence.consumer
                if sequence != seen + 1:
                    log.info("missed a value of %s: watching again", subject)
                    break
                seen = sequence
                # The value already yielded comes again when the key is watched again: skipped.
                # A lower sequence is a bucket made again (removed, or its server's store lost;
                # the holder puts every declaration again): its values are new.
                if msg.data and msg.metadata.sequence.stream != last:
                    last = msg.metadata.sequence.stream
                    yield msg.data
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await sub.unsubscribe()
                except (NatsError, OSError):
                    pass
