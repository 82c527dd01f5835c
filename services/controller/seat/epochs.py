"""The seat's epoch on the bus, beside the store's: an epoch never repeats, whatever the store lost.

The store's epoch lives in PostgreSQL; with asynchronous replication a promoted standby can lack
the last increment, and a new holder would get an epoch an old holder already used. So the
holder also records its epoch in the KV bucket `mesh-seat` (key `mesh-controller`) with
compare-and-set against the revision it read: a controller taking the seat uses an epoch above
both, and one whose write finds a newer revision has lost a race it must not win. A holder
that sees a higher epoch on the bus than its own steps down.
"""

import logging
from datetime import UTC, datetime

import anyio
import msgspec
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from mesh import subjects, wire
from mesh.errors import MeshError
from services.controller.seat.kick import Where

log = logging.getLogger(__name__)

WATCH_EVERY = 1.0  # how often the holder reads the bus's epoch


class BusEpoch(msgspec.Struct):
    epoch: int
    holder: str
    pid: int
    at: datetime
    # Where the holder's NATS connection is (kick.py): the next holder closes it if the seat
    # did not come by a handover. Empty from an older controller.
    server: str = ""
    client: int = 0
    # And its hosts' connection (the hosts' requests, beats and reports: main.py), likewise.
    hosts_server: str = ""
    hosts_client: int = 0

    def connection(self) -> Where | None:
        return Where(server=self.server, client=self.client) if self.server else None

    def hosts_connection(self) -> Where | None:
        if not self.hosts_server:
            return None
        return Where(server=self.hosts_server, client=self.hosts_client)


class Seen(msgspec.Struct):
    record: BusEpoch | None
    revision: int  # 0: the key has never been written


class EpochTaken(MeshError):
    """Another controller recorded an epoch on the bus that this one did not expect."""


async def read(kv: KeyValue) -> Seen:
    try:
        entry = await kv.get(subjects.SEAT)
    except KeyNotFoundError:
        return Seen(record=None, revision=0)
    try:
        record = wire.decode_json(entry.value or b"", BusEpoch)
    except msgspec.DecodeError:
        record = None  # unreadable: its revision still orders the writes
    return Seen(record=record, revision=entry.revision or 0)


async def claim(
    kv: KeyValue, *, seen: Seen, epoch: int, holder: str, pid: int, at: Where | None = None,
    hosts_at: Where | None = None,
) -> Seen:  # fmt: skip
    """Record `epoch` as the holder's (its connections `at` and `hosts_at`), if nobody wrote
    since `seen`; what is recorded now."""
    record = BusEpoch(epoch=epoch, holder=holder, pid=pid, at=datetime.now(UTC),
                      server=at.server if at else "", client=at.client if at else 0,
                      hosts_server=hosts_at.server if hosts_at else "",
                      hosts_client=hosts_at.client if hosts_at else 0)  # fmt: skip
    body = msgspec.json.encode(record)
    try:
        if seen.revision == 0:
            revision = await kv.create(subjects.SEAT, body)
        else:
            revision = await kv.update(subjects.SEAT, body, last=seen.revision)
    except KeyWrongLastSequenceError:
        now = await read(kv)
        mine = (epoch, holder, pid)
        if now.record is not None and (now.record.epoch, now.record.holder, now.record.pid) == mine:
            return now  # our own write, whose acknowledgement was lost (a try asked again)
        who = f"{now.record.holder}, epoch {now.record.epoch}" if now.record else "unknown"
        raise EpochTaken(
            f"another controller recorded the seat on the bus first ({who}): not taking it"
        ) from None
    return Seen(record=record, revision=revision)


async def moved(
    kv: KeyValue, *, mine: Seen, at: Where | None, hosts_at: Where | None = None
) -> Seen:
    """The holder's connections are somewhere else now (one reconnected, maybe to another
    server): record where, if the record is still ours; what is recorded now."""
    if mine.record is None or at is None:
        return mine
    if mine.record.connection() == at and mine.record.hosts_connection() == hosts_at:
        return mine
    try:
        return await claim(kv, seen=mine, epoch=mine.record.epoch, holder=mine.record.holder,
                           pid=mine.record.pid, at=at, hosts_at=hosts_at)  # fmt: skip
    except EpochTaken:  # a newer holder wrote: `watch` steps us down
        return mine


async def watch(kv: KeyValue, *, epoch: int) -> None:
    """Return never; raise EpochTaken once the bus names a higher epoch than ours (two stores
    that each think they are the primary). A bus that does not answer is the step-down on
    losing NATS's business, not this one's."""
    while True:
        await anyio.sleep(WATCH_EVERY)
        try:
            seen = await read(kv)
        except (NatsTimeout, OSError):
            continue
        if seen.record is not None and seen.record.epoch > epoch:
            raise EpochTaken(
                f"{seen.record.holder} holds epoch {seen.record.epoch} on the bus, above ours "
                f"({epoch}): stepping down"
            )
