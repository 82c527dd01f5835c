"""The bus's buckets, opened once per process and kept across holds (issue 29).

Opening a bucket (`blobs.ensure_seat`, `blobs.ensure`: stream info, raising replicas) is a
JetStream API request, which waits for the cluster's metadata leader; reading and writing a
bucket once open needs only its stream's leader. A takeover that opened them again waited for
the metadata leader's election when a nats-server was killed (5.5 s without a holder, seen by
the nemesis); a standby opens them while it waits, and every hold uses them as they are.
"""

import logging

from nats.aio.client import Client
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from mesh import blobs

log = logging.getLogger(__name__)


class Buckets:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._seat: KeyValue | None = None
        self._blobs: tuple[KeyValue, ObjectStore] | None = None

    async def seat(self) -> KeyValue:
        """The seat's bucket (epochs.py)."""
        if self._seat is None:
            self._seat = await blobs.ensure_seat(self.nc)
        return self._seat

    async def blobs(self) -> tuple[KeyValue, ObjectStore]:
        """The declarations' bucket and the bundle store."""
        if self._blobs is None:
            self._blobs = await blobs.ensure(self.nc)
        return self._blobs

    async def open(self) -> None:
        """Both, ahead of a takeover (a standby's, while it waits; cancelled when it takes)."""
        await self.seat()
        await self.blobs()
        log.debug("the seat's bucket and the bundle store are open")
